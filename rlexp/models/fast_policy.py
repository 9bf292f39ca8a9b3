"""A fast batched forward of a Qwen3-VL maze policy over one-image turns (``history_window=1``).

What the project's rollout shows the policy at a turn with a history window of 1 is one user message
(the image, then the task prompt and the turn text) followed by the generation prompt; the reply is one
action token and ``<|im_end|>``. Every such context has the same layout: the image sits at a fixed
offset and only the few tokens of the turn text vary ("This is step k ...", the environment
feedback). This module exploits that, for supervised training and evaluation of many turns at once:

- ``TurnLayout`` tokenizes each turn-text variant once, exactly as ``rollout.conversation`` does (one
  processor call per variant), right-padded into a (variants, L) table, with the M-RoPE position ids
  of the layout computed once: they are the same for every sample (right padding, causal attention).
- ``FastTurnForward`` runs the vision tower over B same-size images with one attention call per block
  (transformers' non-flash path loops over the images), scatters the merged tokens at the fixed offset,
  runs the text model with the fixed position ids and no attention mask (causal; pads come last and are
  never attended by the positions read), and applies ``lm_head`` only at the positions asked for.

The output equals ``Qwen3VLForConditionalGeneration`` on the same inputs (tested on CPU to float32
rounding). Two constants of the vision tower are captured from one ordinary forward: the rotary
cos/sin of an image's patches and the interpolated learned position embedding. The latter depends on
``visual.pos_embed``, which this forward therefore requires to be frozen (``freeze_vision_pos_embed``);
``refresh_constants()`` recaptures after a weight load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rlexp.envs.actions import format_action
from rlexp.envs.prompts import instructions, step_text, turn_text

__all__ = ["TurnLayout", "FastTurnForward", "freeze_vision_pos_embed", "variant_index"]


def variant_index(step: int, feedback_id: int) -> int:
    """Row of ``TurnLayout`` for turn ``step`` (0-based) whose previous feedback is ``feedback_id``."""
    return 0 if step == 0 else 1 + (step - 1) * 2 + feedback_id


@dataclass
class TurnLayout:
    """Token ids of every one-image turn context, right-padded, plus what is shared by all of them.

    Row ``variant_index(k, f)``: turn ``k`` (0 .. max_steps-1) after feedback ``f`` (0 = the action was
    executed, 1 = it bumped into a wall); row 0 is the first turn, which has no feedback. Each row is the
    context followed by a placeholder reply (action 0 + ``<|im_end|>``): write the action token at
    ``reply_pos[v]``. ``position_ids`` (3, 1, L) holds for every row.
    """

    ids: torch.Tensor  # (V, L) long, pad-filled past each row's end
    lengths: torch.Tensor  # (V,) long, context + reply
    reply_pos: torch.Tensor  # (V,) long, position of the action token
    image_offset: int
    image_tokens: int
    image_grid: int  # merged tokens per side
    position_ids: torch.Tensor  # (3, 1, L) long
    action_token_ids: torch.Tensor  # (5,) long, in action order right, up, left, down, stop
    eos_id: int
    pad_id: int
    image_token_id: int
    feedback_texts: tuple[str, ...]

    @classmethod
    def build(
        cls,
        processor,
        size: int,
        cell_px: int,
        max_steps: int,
        prompt: str = "visgym",
        action_format: str = "visgym_tuple",
        feedbacks: tuple[str, ...] = ("Action executed successfully.", "Cannot move into a wall."),
    ) -> TurnLayout:
        from PIL import Image

        tok = processor.tokenizer
        marker = "\x00TEXT\x00"
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": marker}]}]
        template = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prefix, suffix = template.split(marker)
        task = instructions(prompt, action_format, size)
        image = Image.fromarray(np.full((size * cell_px, size * cell_px, 3), 255, dtype=np.uint8))
        texts = [step_text(0, max_steps)]
        for k in range(1, max_steps):
            texts.extend(turn_text(fb, k, max_steps) for fb in feedbacks)
        eos_id = tok.convert_tokens_to_ids("<|im_end|>")
        action_ids = []
        for a in range(5):
            enc = tok.encode(format_action(a, action_format), add_special_tokens=False)
            if len(enc) != 1:
                raise ValueError(f"action {a} is {len(enc)} tokens in this tokenizer; the fast path needs one")
            action_ids.append(enc[0])
        rows, grid = [], None
        for text in texts:
            batch = processor(text=[prefix + f"{task}\n{text}" + suffix], images=[image], return_tensors="pt")
            rows.append(batch["input_ids"][0].tolist() + [action_ids[0], eos_id])
            grid = batch["image_grid_thw"][0]
        image_token_id = tok.convert_tokens_to_ids("<|image_pad|>")
        merge = processor.image_processor.merge_size
        gh, gw = int(grid[1]) // merge, int(grid[2]) // merge
        offsets = {row.index(image_token_id) for row in rows}
        if len(offsets) != 1 or any(row.count(image_token_id) != gh * gw for row in rows):
            raise ValueError("turn variants do not share one image offset")
        offset = offsets.pop()
        length = max(len(r) for r in rows)
        pad_id = tok.pad_token_id
        ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
        lengths = torch.tensor([len(r) for r in rows])
        return cls(
            ids=ids,
            lengths=lengths,
            reply_pos=lengths - 2,
            image_offset=offset,
            image_tokens=gh * gw,
            image_grid=gh,
            position_ids=mrope_position_ids(length, offset, gh, gw).unsqueeze(1),
            action_token_ids=torch.tensor(action_ids),
            eos_id=eos_id,
            pad_id=pad_id,
            image_token_id=image_token_id,
            feedback_texts=tuple(feedbacks),
        )

    def to(self, device) -> TurnLayout:
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return TurnLayout(**moved)

    @property
    def num_variants(self) -> int:
        return self.ids.shape[0]

    def batch(self, variants: torch.Tensor, actions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L) input ids for ``variants`` (B,) with reply action ``actions`` (B,) written in (default 0),
        and the (B,) positions whose next-token logits predict the action."""
        ids = self.ids[variants].clone()
        pos = self.reply_pos[variants]
        if actions is not None:
            ids[torch.arange(ids.shape[0], device=ids.device), pos] = self.action_token_ids[actions]
        return ids, pos - 1


def mrope_position_ids(length: int, offset: int, grid_h: int, grid_w: int) -> torch.Tensor:
    """(3, length) M-RoPE ids (t, h, w) of a sequence with one grid_h x grid_w image at ``offset``,
    as Qwen3-VL's ``get_rope_index``: text counts on, the image spans t=offset, h/w=offset+row/col,
    and the text after it continues at offset + max(grid_h, grid_w)."""
    pos = torch.zeros(3, length, dtype=torch.long)
    pos[:, :offset] = torch.arange(offset)
    hh, ww = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    n = grid_h * grid_w
    pos[0, offset : offset + n] = offset
    pos[1, offset : offset + n] = offset + hh.reshape(-1)
    pos[2, offset : offset + n] = offset + ww.reshape(-1)
    after = length - offset - n
    pos[:, offset + n :] = offset + max(grid_h, grid_w) + torch.arange(after)
    return pos


def freeze_vision_pos_embed(model) -> None:
    """The fast path precomputes the interpolated learned position embedding: keep it fixed."""
    model.model.visual.pos_embed.weight.requires_grad_(False)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class FastTurnForward:
    """Batched forward for same-size single-image turns; see the module docstring."""

    def __init__(self, model, layout: TurnLayout, pixel_values_one: torch.Tensor, grid_thw_one: torch.Tensor):
        self.model = model
        self.layout = layout
        self._probe = (pixel_values_one, grid_thw_one)
        self.refresh_constants()

    @torch.no_grad()
    def refresh_constants(self) -> None:
        visual = self.model.model.visual
        pixel_values, grid_thw = self._probe
        device = visual.patch_embed.proj.weight.device
        captured = {}

        def patch_hook(_module, _args, output):
            captured["patches"] = output

        def block_hook(_module, args, kwargs):
            captured["hidden"] = args[0] if args else kwargs["hidden_states"]
            pe = kwargs.get("position_embeddings")
            if pe is None and len(args) > 2:
                pe = args[2]
            captured["rope"] = pe

        h1 = visual.patch_embed.register_forward_hook(patch_hook)
        h2 = visual.blocks[0].register_forward_pre_hook(block_hook, with_kwargs=True)
        try:
            with torch.autocast(device_type=device.type, enabled=False):
                visual(pixel_values.to(device, visual.patch_embed.proj.weight.dtype), grid_thw=grid_thw.to(device))
        finally:
            h1.remove()
            h2.remove()
        if captured.get("rope") is None:
            raise RuntimeError("could not capture the vision rotary embedding from this transformers version")
        self.vision_pos = (captured["hidden"] - captured["patches"]).float()  # (S, D)
        cos, sin = captured["rope"]
        self.vision_cos, self.vision_sin = cos.float(), sin.float()  # (S, head_dim)
        self.seq = self.vision_pos.shape[0]

    def vision(self, pixel_values: torch.Tensor, n_images: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Merged image tokens (n * T, D_text) and the deepstack features, one attention call per block."""
        visual = self.model.model.visual
        proj = visual.patch_embed.proj
        w = proj.weight.reshape(proj.weight.shape[0], -1)
        s = self.seq
        x = pixel_values
        if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
            x = x.to(w.dtype)
        h = F.linear(x, w, proj.bias)  # Conv3d with kernel == stride == input
        h = h.view(n_images, s, -1) + self.vision_pos.to(h.dtype)
        cos = self.vision_cos[None, :, None, :]
        sin = self.vision_sin[None, :, None, :]
        deepstack = []
        indexes = list(visual.deepstack_visual_indexes)
        for i, blk in enumerate(visual.blocks):
            attn = blk.attn
            a = blk.norm1(h)
            qkv = attn.qkv(a).view(n_images, s, 3, attn.num_heads, -1)
            q, k, v = qkv.unbind(2)  # (n, s, heads, hd)
            dt = q.dtype
            qf, kf = q.float(), k.float()
            q = (qf * cos + _rotate_half(qf) * sin).to(dt)
            k = (kf * cos + _rotate_half(kf) * sin).to(dt)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=attn.scaling
            )
            o = o.transpose(1, 2).reshape(n_images, s, -1)
            h = h + attn.proj(o)
            h = h + blk.mlp(blk.norm2(h))
            if i in indexes:
                deepstack.append(visual.deepstack_merger_list[indexes.index(i)](h.reshape(n_images * s, -1)))
        merged = visual.merger(h.reshape(n_images * s, -1))
        return merged, deepstack

    def __call__(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor,
        select: torch.Tensor,
    ) -> torch.Tensor:
        """Logits (B, K, V) at positions ``select`` (B, K) of right-padded ``input_ids`` (B, L)."""
        lay = self.layout
        b, length = input_ids.shape
        text_model = self.model.model.language_model
        merged, deepstack = self.vision(pixel_values, b)
        emb = text_model.embed_tokens(input_ids)
        off, n = lay.image_offset, lay.image_tokens
        img = merged.view(b, n, -1).to(emb.dtype)
        emb = torch.cat([emb[:, :off], img, emb[:, off + n :]], dim=1)
        mask = torch.zeros(b, length, dtype=torch.bool, device=input_ids.device)
        mask[:, off : off + n] = True
        position_ids = lay.position_ids[:, :, :length].expand(3, b, length)
        out = text_model(
            inputs_embeds=emb,
            position_ids=position_ids,
            use_cache=False,
            visual_pos_masks=mask,
            deepstack_visual_embeds=[d.to(emb.dtype) for d in deepstack],
        )
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        rows = torch.arange(b, device=hidden.device)[:, None]
        return self.model.lm_head(hidden[rows, select])
