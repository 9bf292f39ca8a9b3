"""Learning-rate schedules, built from ``algorithm.lr_scheduler`` (a ``_target_`` taking the optimizer
and ``warmup_steps``)."""

import torch


def warmup_constant(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over the first ``warmup_steps`` optimizer steps (from lr / (warmup + 1)), then constant."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: min(1.0, (n + 1) / (warmup_steps + 1)))
