"""Process-level facts every task shares: where a run lives, who holds it, and seeding."""

import fcntl
import logging
import os
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf


def run_dir_of(cfg: DictConfig) -> Path:
    """Hydra's output dir: ``outputs/<name>/<run_name>`` for a run, ``<sweep dir>/<job number>`` in a multirun."""
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path("outputs") / cfg.name / cfg.run_name


def cluster_choice() -> str:
    """The ``cluster`` option the config was composed with ("custom" outside a Hydra app)."""
    return HydraConfig.get().runtime.choices.get("cluster", "custom") if HydraConfig.initialized() else "custom"


def hydra_context() -> dict | None:
    """What rlexp reads of Hydra's config, resolved: the mode, the output dir, the group choices, the sweep
    dir and the command line's overrides; None outside a Hydra app. A process without Hydra of its own (a
    rank, a Ray job) restores it with ``restore_hydra_context`` and then runs as the launching one."""
    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    multirun = hydra.mode == RunMode.MULTIRUN
    return {
        "mode": (hydra.mode or RunMode.RUN).name,
        "runtime": {"output_dir": OmegaConf.select(hydra, "runtime.output_dir", default=None), "choices": OmegaConf.to_container(hydra.runtime.choices)},
        "sweep": {"dir": str(hydra.sweep.dir) if multirun else None},
        "overrides": {"task": list(hydra.overrides.task)},
    }


def restore_hydra_context(context: dict, output_dir: str | None = None) -> None:
    """Make ``context`` (from ``hydra_context``) this process's Hydra config, optionally with another
    output dir (the run dir on a cluster's shared storage)."""
    node = OmegaConf.create({"hydra": {**context, "mode": RunMode[context["mode"]]}})
    if output_dir is not None:
        node.hydra.runtime.output_dir = output_dir
    OmegaConf.set_readonly(node, True)
    HydraConfig.instance().cfg = node  # set_config() wants Hydra's whole typed schema, of which rlexp reads this


def log_like_hydra() -> None:
    """INFO and up to stdout in Hydra's job-log format, for a process Hydra did not start (a Ray job's
    driver, a rank's Ray actor), so that its log reads as a local run's does."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s", stream=sys.stdout)


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch (CPU and every CUDA device) from one seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class RunDirBusy(RuntimeError):
    """Another live process holds the run dir."""


@contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold ``<run_dir>/.lock`` for the ``with`` block, or raise ``RunDirBusy`` naming the holder's pid.

    An exclusive ``flock``: the kernel drops it when its holder dies however it dies (kill -9 included),
    so a dead holder's lock file never blocks. The file stays (deleting it would let two processes lock
    two different files); the pid in it is only for the message. Python opens it non-inheritable, so
    the subprocesses a run starts (W&B's service) do not keep it held after the run is gone.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise RunDirBusy(
                f"run dir {run_dir} is in use by pid {holder} (lock {path}); wait for it to end, or pick another run_name"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
