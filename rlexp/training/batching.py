"""From training sequences to padded tensors, and from a forward pass to per-token log-probs."""

import torch

from rlexp.algorithms.grpo import selective_log_softmax
from rlexp.models import mm_token_type_ids
from rlexp.rollout.conversation import Sequence
from rlexp.rollout.engine import VisionInputs

#: scored positions whose fp32 log-softmax is taken at a time (about 3 x 0.6 GB at V = 152k).
LOGPROB_CHUNK = 1024


def collate(sequences: list[Sequence], pad_id: int, model_config, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded model inputs plus the next-token ``loss_mask`` ([B, T-1])."""
    length = max(len(s.token_ids) for s in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    loss_mask = torch.zeros_like(input_ids)
    for row, s in enumerate(sequences):
        n = len(s.token_ids)
        input_ids[row, :n] = torch.tensor(s.token_ids)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(s.loss_mask)
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "mm_token_type_ids": mm_token_type_ids(input_ids, model_config),
        "loss_mask": loss_mask[:, 1:],
    }
    batch = {k: v.to(device) for k, v in batch.items()}
    vision = VisionInputs.concat([s.vision for s in sequences if s.vision is not None])
    if vision is not None:
        batch["pixel_values"], batch["image_grid_thw"] = vision.tensors(device)
    return batch


def token_logprobs(
    model, batch: dict[str, torch.Tensor], temperature: float, suppressed_ids: list[int] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each next token under softmax(logits / T), and the entropy there; [B, T-1] each,
    taken at the ``loss_mask`` positions only (0 elsewhere).

    Scored at the temperature the engine sampled with, over the vocabulary it sampled from (the
    ``suppressed_ids`` it never emits are masked here too), so that the ratio starts at exactly 1.

    The vocabulary is projected only where the loss reads it: a pre-hook on the output embedding
    hands it the final hidden states of the masked positions instead of all of them, so the model
    returns ``[1, N, V]`` logits for the N scored tokens, never ``[B, T, V]``; the head still runs in
    its own call (where FSDP2 has its weight gathered). The log-softmax is then taken chunk by chunk
    in fp32 (``selective_log_softmax``).
    """
    inputs = {k: v for k, v in batch.items() if k != "loss_mask"}
    mask = batch["loss_mask"].bool()
    # hidden state t predicts token t + 1: pad the next-token mask to the input's length
    at = torch.cat([mask, torch.zeros_like(mask[:, :1])], dim=1)

    def masked_positions(_module, args):
        return (args[0][at].unsqueeze(0),)

    handle = model.get_output_embeddings().register_forward_pre_hook(masked_positions)
    try:
        logits = model(**inputs, use_cache=False).logits
    finally:
        handle.remove()
    if suppressed_ids:
        index = torch.tensor(list(suppressed_ids), device=logits.device)
        logits = logits.index_fill(-1, index, float("-inf"))
    labels = batch["input_ids"][:, 1:][mask].unsqueeze(0)
    logp, entropy = selective_log_softmax(
        logits, labels, chunk_size=LOGPROB_CHUNK, temperature=temperature if temperature > 0 else 1.0
    )
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return zeros.masked_scatter(mask, logp[0]), zeros.masked_scatter(mask, entropy[0])
