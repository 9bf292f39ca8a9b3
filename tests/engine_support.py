"""Comparing two engines' greedy replies: identical, or parting first where the trainer itself sees a near tie
(two candidates whose log-probs are closer than the kernels' rounding can tell apart)."""

import torch

from rlexp.models import mm_token_type_ids, never_generated_ids
from rlexp.rollout.engine import GenerationOutput, GenerationRequest


def next_token_logprobs(model, processor, request: GenerationRequest, reply_prefix: list[int]) -> torch.Tensor:
    """The trainer's log-softmax over the next token after ``prompt + reply_prefix`` (never-generated ids masked)."""
    ids = torch.tensor([request.prompt_token_ids + reply_prefix], device=model.device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": mm_token_type_ids(ids, model.config)}
    if request.vision is not None:
        inputs.update(pixel_values=request.vision.pixel_values.to(model.device), image_grid_thw=request.vision.image_grid_thw.to(model.device))
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits[0, -1].float()
    logits[never_generated_ids(processor.tokenizer)] = float("-inf")
    return torch.log_softmax(logits, -1)


def assert_same_or_near_tie(
    model, processor, requests: list[GenerationRequest], ours: list[GenerationOutput], reference: list[GenerationOutput], near_tie: float
) -> int:
    """Each pair of greedy replies is identical or parts where ``model``'s two candidates are within
    ``near_tie`` (log-prob); returns how many were identical."""
    same = 0
    for request, a, b in zip(requests, ours, reference):
        if a.token_ids == b.token_ids:
            same += 1
            continue
        at = next(i for i, (x, y) in enumerate(zip(a.token_ids + [-1], b.token_ids + [-1])) if x != y)
        assert at < min(len(a.token_ids), len(b.token_ids)), "one reply is a prefix of the other: they stopped apart"
        first = next_token_logprobs(model, processor, request, b.token_ids[:at])
        gap = abs(float(first[a.token_ids[at]] - first[b.token_ids[at]]))
        print(f"greedy replies part at token {at}: {a.token_ids[at]} against {b.token_ids[at]}, trainer's log-prob gap {gap:.1e}")
        assert gap < near_tie, f"greedy replies part at token {at} without a near tie ({gap:.1e} >= {near_tie:.0e})"
    return same
