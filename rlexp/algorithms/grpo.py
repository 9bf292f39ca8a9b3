"""GRPO (and SFT) as pure tensor functions: advantages, losses, reductions, token log-probs.

Nothing here knows about models, configs or distributed training; every function takes tensors
and returns tensors, and is unit-tested against hand-computed values.

How this "GRPO" differs from the paper (DeepSeekMath, Shao et al. 2024), and what it does instead
(these are SkyRL's defaults, which the seed run used):

* **Outcome supervision only.** One scalar reward per trajectory (1.0 iff the agent stopped on the
  goal). It notionally sits on the last generated token and is broadcast, as the advantage, over
  every loss-masked (model-generated) token of the trajectory: there is no per-step process reward.
* **Advantages per group** of ``G`` samples of the same maze: ``(r - mean) / (std + eps)`` with the
  *unbiased* (Bessel-corrected, ``G - 1``) standard deviation and ``eps = 1e-6``, as SkyRL.
  ``norm_by_std=False`` skips the division (Dr. GRPO, Liu et al. 2025, who argue that dividing by the
  std over-weights groups that are nearly all right or all wrong).
* **Zero-variance groups** (all samples equal reward) get advantage exactly 0 — never NaN, and never
  a rounding residue blown up by ``1 / eps``. They then contribute no policy gradient (only KL, if
  on). :func:`nonzero_variance_groups` gives a per-sample mask so the trainer can drop them instead.
* **Clipped ratio loss** (PPO surrogate) with separate ``eps_low`` / ``eps_high`` (default 0.2 / 0.2;
  raise ``eps_high`` for DAPO's "clip-higher"). The paper's objective is the same surrogate; with one
  policy update per rollout batch the ratio is 1 and the clip is inactive on the first mini-batch.
* **Loss reduction** is a choice, not the paper's per-sequence ``1/|o_i|`` average:
    - ``token_mean`` (default, SkyRL/DAPO): mean over *all* loss-masked tokens of the whole
      mini-batch. Pass ``normalizer`` = the mini-batch's total masked-token count so that the sum
      over micro-batches (and ranks) equals one big batch; see :func:`loss_normalizer`.
    - ``sequence_mean`` (the paper): per-sequence token mean, then mean over sequences
      (``normalizer`` = number of sequences in the mini-batch).
    - ``seq_mean_token_sum_norm`` (Dr. GRPO): per-sequence token *sum* divided by a constant
      ``max_seq_len``, then mean over sequences; removes the length bias of both means above.
* **KL to the reference** (the base model = the LoRA model with its adapter disabled) is optional,
  off by default (``kl_coef = 0``), and enters as a *loss term* with the k3 estimator
  ``exp(ref - logp) - (ref - logp) - 1`` (Schulman's "approximating KL"), as in the paper — never
  folded into the reward. It is reduced with the same reduction as the policy loss.
* **Entropy** is computed for logging only (detached); there is no entropy bonus.
* No value network, no reference-model reward shaping, no length penalty.

Distributed note: the reductions divide by the *global* ``normalizer`` you pass. FSDP/DDP then
*average* gradients over ``world_size`` ranks, so pass ``normalizer / world_size`` (or scale the
loss by ``world_size``) to make 2 ranks equal to one process.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.utils.checkpoint
from torch import Tensor

__all__ = [
    "LOSS_REDUCTIONS",
    "LossReduction",
    "group_advantages",
    "nonzero_variance_groups",
    "masked_mean",
    "masked_sum",
    "loss_normalizer",
    "reduce_loss",
    "kl_k3",
    "policy_loss",
    "sft_loss",
    "selective_log_softmax",
    "token_logprobs_and_entropy",
]

LossReduction = Literal["token_mean", "sequence_mean", "seq_mean_token_sum_norm"]
LOSS_REDUCTIONS: tuple[str, ...] = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")

# Bound on |log-ratio| before exponentiating (exp(20) ~ 5e8): only reached by broken inputs, where it
# keeps the loss finite instead of inf/NaN.
_MAX_LOG_RATIO = 20.0


# --------------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------------


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"number of rewards ({rewards.numel()}) is not a multiple of group_size ({group_size})"
        )
    return rewards.reshape(-1, group_size)


def nonzero_variance_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Per-sample bool mask: True where the sample's group has not all-equal rewards.

    ``rewards`` is ``[N]`` in group-major order (consecutive ``group_size`` entries are one group).
    A group of size 1 always has zero variance.
    """
    r = _grouped(rewards, group_size)
    varied = r.amax(dim=1) != r.amin(dim=1)
    return varied.repeat_interleave(group_size)


def group_advantages(
    rewards: Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO advantages ``(r - group mean) / (unbiased group std + eps)`` per sample, ``[N] -> [N]``.

    ``rewards`` is in group-major order. With ``norm_by_std=False`` (Dr. GRPO) only the mean is
    subtracted. Groups whose rewards are all equal get exactly 0. Computed in float32 (or float64
    if given), returned in that dtype.
    """
    r = _grouped(rewards, group_size)
    if not r.is_floating_point() or r.dtype in (torch.float16, torch.bfloat16):
        r = r.float()
    if norm_by_std and group_size < 2:
        raise ValueError("norm_by_std needs group_size >= 2 (the unbiased std of one sample is undefined)")
    adv = r - r.mean(dim=1, keepdim=True)
    if norm_by_std:
        adv = adv / (r.std(dim=1, keepdim=True, correction=1) + eps)
    varied = (r.amax(dim=1) != r.amin(dim=1)).unsqueeze(1)
    adv = torch.where(varied, adv, torch.zeros_like(adv))
    return adv.reshape(-1)


# --------------------------------------------------------------------------------------------------
# Masked reductions
# --------------------------------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is set. Masked-out entries may hold inf/NaN: they are ignored."""
    masked = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, normalizer: float | Tensor | None = None) -> Tensor:
    """``sum(x * mask) / normalizer``; ``normalizer`` defaults to ``mask.sum()`` (at least 1).

    Pass a global ``normalizer`` (e.g. the whole mini-batch's token count) to make per-micro-batch
    results add up to the mean over the whole mini-batch.
    """
    total = masked_sum(x, mask)
    if normalizer is None:
        normalizer = mask.sum().clamp(min=1).to(total.dtype)
    return total / normalizer


def loss_normalizer(loss_mask: Tensor, loss_reduction: LossReduction) -> int:
    """The local count that :func:`policy_loss`'s ``normalizer`` expects for ``loss_reduction``.

    Sum it over every micro-batch (and all-reduce over ranks) of a mini-batch and pass the total to
    each micro-batch's :func:`policy_loss` call: token count for ``token_mean``, sequence count for
    the two per-sequence reductions.
    """
    _check_reduction(loss_reduction)
    if loss_reduction == "token_mean":
        return int(loss_mask.bool().sum().item())
    return int(loss_mask.shape[0])


def _check_reduction(loss_reduction: str) -> None:
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"unknown loss_reduction {loss_reduction!r}; choose one of {LOSS_REDUCTIONS}")


def reduce_loss(
    loss_tok: Tensor,
    loss_mask: Tensor,
    loss_reduction: LossReduction,
    normalizer: float | Tensor | None = None,
    max_seq_len: int | None = None,
    sequence_tokens: Tensor | None = None,
) -> Tensor:
    """Reduce a token-level loss ``[B, T]`` to a scalar with one of :data:`LOSS_REDUCTIONS`.

    ``normalizer``: global masked-token count (``token_mean``) or global sequence count (the
    per-sequence reductions); ``None`` means "this batch is the whole mini-batch".
    ``max_seq_len`` is required by ``seq_mean_token_sum_norm`` (Dr. GRPO's constant).
    ``sequence_tokens`` ``[B]``: what ``sequence_mean`` divides each row's sum by, by default the row's
    own masked-token count. When one trajectory spans several rows (a history window gives one row per
    turn), pass the trajectory's count on each of its rows and count trajectories in ``normalizer``:
    the rows then add up to one mean per trajectory.
    """
    _check_reduction(loss_reduction)
    if loss_tok.dim() != 2 or loss_mask.shape != loss_tok.shape:
        raise ValueError(
            f"loss_tok and loss_mask must both be [B, T]; got {tuple(loss_tok.shape)} "
            f"and {tuple(loss_mask.shape)}"
        )
    mask = loss_mask.bool()
    if loss_reduction == "token_mean":
        return masked_mean(loss_tok, mask, normalizer)
    per_seq_sum = masked_sum(loss_tok, mask, dim=1)
    if loss_reduction == "sequence_mean":
        counts = mask.sum(dim=1) if sequence_tokens is None else sequence_tokens
        per_seq = per_seq_sum / counts.clamp(min=1).to(per_seq_sum.dtype)
    else:  # seq_mean_token_sum_norm
        if max_seq_len is None or max_seq_len <= 0:
            raise ValueError("loss_reduction='seq_mean_token_sum_norm' needs a positive max_seq_len")
        per_seq = per_seq_sum / float(max_seq_len)
    n_seq = loss_tok.shape[0] if normalizer is None else normalizer
    return per_seq.sum() / n_seq


# --------------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------------


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || ref): ``exp(ref - logp) - (ref - logp) - 1`` (>= 0).

    The log-ratio is clamped to +-20 so that broken inputs give a large finite value, not inf.
    """
    delta = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(delta) - delta - 1.0


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    loss_reduction: LossReduction = "token_mean",
    normalizer: float | Tensor | None = None,
    max_seq_len: int | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    sequence_tokens: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped-ratio GRPO loss (to minimise) and detached metrics.

    Args:
        logprobs: ``[B, T]`` log-probs of the taken tokens under the current policy (with grad).
        old_logprobs: ``[B, T]`` the same under the policy that sampled them (no grad).
        advantages: ``[B]`` (broadcast over the response) or ``[B, T]``.
        loss_mask: ``[B, T]``, 1 on model-generated tokens, 0 on prompt/observation/padding.
        eps_low, eps_high: ratio clipped to ``[1 - eps_low, 1 + eps_high]``.
        loss_reduction, normalizer, max_seq_len, sequence_tokens: see :func:`reduce_loss`.
        ref_logprobs, kl_coef: if ``kl_coef > 0``, adds ``kl_coef * reduce(kl_k3(logprobs, ref))``.

    Per token: ``-min(ratio * A, clip(ratio) * A)`` with ``ratio = exp(logprobs - old_logprobs)``.

    Returns ``(loss, metrics)``; metrics are 0-dim detached tensors, each a mean over *this* call's
    masked tokens: ``pg_loss`` (the reduced policy term), ``clip_frac`` (fraction of tokens where
    the clipped branch was taken, i.e. gets no gradient), ``ratio_mean``, ``ratio_max``,
    ``approx_kl`` (k3 estimate of KL(old || new)), and ``kl`` (to the reference) when given.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != loss_mask.shape:
        raise ValueError(
            "logprobs, old_logprobs and loss_mask must share one [B, T] shape; got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(loss_mask.shape)}"
        )
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"eps_low/eps_high must be >= 0, got {eps_low}/{eps_high}")
    mask = loss_mask.bool()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(logprobs.dtype)

    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    log_ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    surr_unclipped = ratio * advantages
    surr_clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    loss_tok = -torch.minimum(surr_unclipped, surr_clipped)
    pg = reduce_loss(loss_tok, mask, loss_reduction, normalizer, max_seq_len, sequence_tokens)
    loss = pg

    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        clipped = (surr_clipped < surr_unclipped) & mask
        metrics: dict[str, Tensor] = {
            "pg_loss": pg.detach(),
            "clip_frac": clipped.sum() / n,
            "ratio_mean": masked_sum(ratio, mask) / n,
            "ratio_max": torch.where(mask, ratio, torch.zeros_like(ratio)).max()
            if mask.any()
            else torch.ones((), dtype=ratio.dtype, device=ratio.device),
            "approx_kl": masked_sum(ratio - 1.0 - log_ratio, mask) / n,
        }

    if ref_logprobs is not None and kl_coef != 0.0:
        kl_tok = kl_k3(logprobs, ref_logprobs)
        kl = reduce_loss(kl_tok, mask, loss_reduction, normalizer, max_seq_len, sequence_tokens)
        loss = loss + kl_coef * kl
        with torch.no_grad():
            metrics["kl"] = masked_sum(kl_tok, mask) / mask.sum().clamp(min=1)
    elif ref_logprobs is not None:
        with torch.no_grad():
            metrics["kl"] = masked_sum(kl_k3(logprobs, ref_logprobs), mask) / mask.sum().clamp(min=1)
    return loss, metrics


def sft_loss(logprobs: Tensor, loss_mask: Tensor, normalizer: float | Tensor | None = None) -> Tensor:
    """Negative log-likelihood of the masked tokens: ``-masked_mean(logprobs, loss_mask, normalizer)``."""
    return -masked_mean(logprobs, loss_mask, normalizer)


# --------------------------------------------------------------------------------------------------
# Token log-probs without a full fp32 log-softmax
# --------------------------------------------------------------------------------------------------


class _SelectiveLogSoftmax(torch.autograd.Function):
    """log_softmax(logits)[label] row by row in chunks; backward recomputes softmax per chunk.

    Saves only the input logits (already alive in the caller) and one fp32 logsumexp per row, so
    the fp32 ``[rows, V]`` tensors exist one chunk at a time, in forward and in backward.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, chunk_size: int, scale: float):  # type: ignore[override]
        rows = logits.shape[0]
        logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
        ent = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse_all = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for s in range(0, rows, chunk_size):
            z = logits[s : s + chunk_size].float()
            if scale != 1.0:
                z = z * scale
            lse = torch.logsumexp(z, dim=-1)
            lab = labels[s : s + chunk_size]
            logp[s : s + chunk_size] = z.gather(-1, lab.unsqueeze(-1)).squeeze(-1) - lse
            # entropy = lse - sum_j p_j z_j; masked-out tokens (z = -inf, p = 0) add nothing, not 0 * -inf
            ent[s : s + chunk_size] = lse - (torch.softmax(z, dim=-1) * z.nan_to_num(neginf=0.0)).sum(dim=-1)
            lse_all[s : s + chunk_size] = lse
        ctx.save_for_backward(logits, labels, lse_all)
        ctx.chunk_size = chunk_size
        ctx.scale = scale
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_ent: Tensor):  # type: ignore[override]
        logits, labels, lse_all = ctx.saved_tensors
        chunk, scale = ctx.chunk_size, ctx.scale
        grad = torch.empty_like(logits)
        grad_logp = grad_logp.float()
        for s in range(0, logits.shape[0], chunk):
            z = logits[s : s + chunk].float()
            if scale != 1.0:
                z = z * scale
            g = grad_logp[s : s + chunk].unsqueeze(-1)
            # d logp / d z = onehot(label) - softmax(z); chain through z = scale * logits
            gz = -torch.exp(z - lse_all[s : s + chunk].unsqueeze(-1)) * g
            gz.scatter_add_(-1, labels[s : s + chunk].unsqueeze(-1), g)
            if scale != 1.0:
                gz = gz * scale
            grad[s : s + chunk] = gz.to(grad.dtype)
        return grad, None, None, None


def selective_log_softmax(
    logits: Tensor,
    labels: Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    ignore_index: int = -100,
) -> tuple[Tensor, Tensor]:
    """Per-token ``log softmax(logits / temperature)[label]`` and entropy, chunked over rows.

    Args:
        logits: ``[B, T, V]`` (any float dtype; upcast to fp32 one chunk at a time).
        labels: ``[B, T]`` token ids; positions equal to ``ignore_index`` (or any negative id)
            get log-prob 0, entropy 0 and no gradient.
        chunk_size: rows (``B*T`` positions) per chunk; peak extra memory is about
            ``3 * chunk_size * V * 4`` bytes instead of ``B * T * V * 4``.
        temperature: sampling temperature; log-probs must be taken at the temperature the
            rollout sampled with, to match the engine's ``old_logprobs``.

    Returns ``(logprobs [B, T] fp32, with grad; entropy [B, T] fp32, detached, for logging)``.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits [B, T, V] and labels [B, T]; got {tuple(logits.shape)}, {tuple(labels.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    b, t, v = logits.shape
    flat_logits = logits.reshape(b * t, v)
    flat_labels = labels.reshape(b * t).long()
    valid = (flat_labels >= 0) & (flat_labels != ignore_index)
    safe_labels = torch.where(valid, flat_labels, torch.zeros_like(flat_labels))
    logp, ent = _SelectiveLogSoftmax.apply(flat_logits, safe_labels, chunk_size, 1.0 / temperature)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(valid, logp, zero)
    ent = torch.where(valid, ent, zero)
    return logp.reshape(b, t), ent.reshape(b, t)


def token_logprobs_and_entropy(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    ignore_index: int = -100,
) -> tuple[Tensor, Tensor]:
    """Like :func:`selective_log_softmax`, but from the last hidden states and the LM-head weight.

    Never builds the ``[B, T, V]`` logits: each chunk of ``chunk_size`` positions is projected,
    scored and (through activation checkpointing) recomputed in backward. ``hidden`` is
    ``[B, T, H]``, ``lm_head_weight`` is ``[V, H]`` (bias-free head, as in Qwen-VL models).
    """
    if hidden.dim() != 3 or labels.shape != hidden.shape[:2]:
        raise ValueError(
            f"expected hidden [B, T, H] and labels [B, T]; got {tuple(hidden.shape)}, {tuple(labels.shape)}"
        )
    b, t, h = hidden.shape
    flat_h = hidden.reshape(b * t, h)
    flat_labels = labels.reshape(b * t, 1)

    def _chunk(hc: Tensor, lc: Tensor) -> tuple[Tensor, Tensor]:
        logits = (hc @ lm_head_weight.T).unsqueeze(0)
        lp, en = selective_log_softmax(logits, lc.T, chunk_size, temperature, ignore_index)
        return lp.squeeze(0), en.squeeze(0)

    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad)
    lps, ents = [], []
    for s in range(0, b * t, chunk_size):
        hc, lc = flat_h[s : s + chunk_size], flat_labels[s : s + chunk_size]
        if need_grad:
            lp, en = torch.utils.checkpoint.checkpoint(_chunk, hc, lc, use_reentrant=False)
        else:
            lp, en = _chunk(hc, lc)
        lps.append(lp)
        ents.append(en)
    return torch.cat(lps).reshape(b, t), torch.cat(ents).reshape(b, t).detach()
