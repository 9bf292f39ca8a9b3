"""RL / SFT objectives as pure tensor functions (see :mod:`rlexp.algorithms.grpo`)."""

from rlexp.algorithms.grpo import (
    LOSS_REDUCTIONS,
    group_advantages,
    kl_k3,
    loss_normalizer,
    masked_mean,
    nonzero_variance_groups,
    policy_loss,
    reduce_loss,
    selective_log_softmax,
    sft_loss,
    token_logprobs_and_entropy,
)

__all__ = [
    "LOSS_REDUCTIONS",
    "group_advantages",
    "kl_k3",
    "loss_normalizer",
    "masked_mean",
    "nonzero_variance_groups",
    "policy_loss",
    "reduce_loss",
    "selective_log_softmax",
    "sft_loss",
    "token_logprobs_and_entropy",
]
