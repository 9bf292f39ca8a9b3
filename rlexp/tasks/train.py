"""``task=train``: the training recipe that ``algorithm.name`` names."""

import importlib

from omegaconf import DictConfig

#: algorithm.name -> the recipe module whose ``train(cfg)`` runs it.
RECIPES = {"grpo": "rlexp.tasks.train_grpo", "sft": "rlexp.tasks.train_sft"}


def train(cfg: DictConfig) -> float:
    """Returns the final eval success rate (a sweeper's objective)."""
    return importlib.import_module(RECIPES[cfg.algorithm.name.value]).train(cfg)
