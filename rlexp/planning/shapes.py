"""The model's shape, from its config alone: parameter counts by meta-device construction (no weights are
read or allocated), and the sizes the memory estimate needs.

``model.path`` is read the way training reads it (``resolve_model_path``, never touching the network):
the tiny model's dir, a local dir, or a hub id found in the local Hugging Face cache. A hub id that is not
cached falls back to the shape files in ``configs/`` (Qwen3-VL-2B/8B-Instruct), so that a plan for the
seed's recipe needs no download.
"""

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from rlexp.models.lora import _resolve_targets
from rlexp.models.loading import TINY_MODEL, resolve_model_path
from rlexp.models.tiny import tiny_config

#: shape-only configs of models the planner knows without a download, by hub id.
BUNDLED = {f"Qwen/{p.stem}": p for p in (Path(__file__).parent / "configs").glob("*.json")}


@dataclass(frozen=True)
class ModelShape:
    #: every parameter (language model, vision tower, mergers, embeddings, lm_head).
    params: int
    #: the largest FSDP unit (one decoder or vision block), in parameters.
    largest_block: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    q_dim: int
    kv_dim: int
    vocab: int
    #: pixels per merged vision token (patch_size × spatial_merge_size).
    pixels_per_token: int
    source: str

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token of context."""
        return 2 * self.layers * self.kv_dim * dtype_bytes


def load_config(path: str):
    """(transformers config, where it came from) for ``model.path``, with no network access."""
    from transformers import AutoConfig, Qwen3VLConfig

    if path == TINY_MODEL:
        return tiny_config(), "the tiny model's config (rlexp.models.tiny)"
    try:
        local = resolve_model_path(path, local_files_only=True)
    except FileNotFoundError:
        if path not in BUNDLED:
            raise FileNotFoundError(
                f"model.path={path}: no config here (not a local dir, not in the Hugging Face cache) and no bundled "
                f"shape for it (bundled: {', '.join(sorted(BUNDLED))}); point model.path at a local copy"
            ) from None
        values = json.loads(BUNDLED[path].read_text())
        values = {k: v for k, v in values.items() if k not in ("_source", "model_type", "architectures")}
        return Qwen3VLConfig(**values), f"bundled shape of {path}"
    return AutoConfig.from_pretrained(local), local


@functools.cache
def _meta_model(path: str):
    """(the model built on the meta device: shapes, no storage; its config; where the config came from)."""
    from transformers import AutoModelForImageTextToText

    config, source = load_config(path)
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config), config, source


def model_shape(path: str) -> ModelShape:
    model, config, source = _meta_model(path)
    text, vision = config.text_config, config.vision_config
    blocks = [*model.model.language_model.layers, *model.model.visual.blocks]
    return ModelShape(
        params=sum(p.numel() for p in model.parameters()),
        largest_block=max(sum(p.numel() for p in b.parameters()) for b in blocks),
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        heads=text.num_attention_heads,
        q_dim=text.num_attention_heads * text.head_dim,
        kv_dim=text.num_key_value_heads * text.head_dim,
        vocab=text.vocab_size,
        pixels_per_token=vision.patch_size * vision.spatial_merge_size,
        source=str(source),
    )


@functools.cache
def lora_params(path: str, rank: int, target_modules: str | tuple[str, ...]) -> int:
    """Parameters of a rank-``rank`` LoRA on the linear layers peft would adapt: ``rank × (in + out)`` each."""
    model = _meta_model(path)[0]
    targets = _resolve_targets(target_modules if isinstance(target_modules, str) else list(target_modules))
    total = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        hit = re.fullmatch(targets, name) if isinstance(targets, str) else any(name == t or name.endswith(f".{t}") for t in targets)
        if hit:
            total += rank * (module.in_features + module.out_features)
    return total
