"""Process-level facts every task shares: where a run lives, and seeding."""

import random
from pathlib import Path

import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


def run_dir_of(cfg: DictConfig) -> Path:
    """Hydra's output dir: ``outputs/<name>/<run_name>`` for a run, ``<sweep dir>/<job number>`` in a multirun."""
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path("outputs") / cfg.name / cfg.run_name


def cluster_choice() -> str:
    """The ``cluster`` option the config was composed with ("custom" outside a Hydra app)."""
    return HydraConfig.get().runtime.choices.get("cluster", "custom") if HydraConfig.initialized() else "custom"


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch (CPU and every CUDA device) from one seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
