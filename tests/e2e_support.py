"""Running ``rlexp`` as a subprocess on the tiny model and reading what a run left: shared by the end-to-end
tests and ``bench/faults.py``."""

import json
import os
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent

#: small enough for a 2-core CPU; every override is an ordinary Hydra override a user could type.
QUICK = ["eval.num_mazes=4", "rollout.max_turns=3", "rollout.max_new_tokens_per_turn=8"]


def rlexp_command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "rlexp", f"hydra.run.dir={run_dir}", *QUICK, *overrides]


def own_env() -> dict[str, str]:
    """This process's environment without ``WANDB_SERVICE``: W&B puts its service's address there when an
    in-process test starts it, and a child that inherits it would register its run with this process's
    service, where a killed child's run stays open ("run ID … is in use") however long one waits."""
    return {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}


def run_rlexp(run_dir: Path, *overrides: str, timeout: float = 600) -> str:
    """Run to completion; returns everything it printed (logs go to stdout, progress bars to stderr)."""
    result = subprocess.run(
        rlexp_command(run_dir, *overrides), cwd=REPO, env=own_env(), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """Training-step metrics (the last record of each step), without wall-clock figures."""
    steps: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "train/loss" in record:
            steps[record["step"]] = {k: v for k, v in record.items() if not k.startswith(("timing/", "time"))}
    return steps


def adapter(run_dir: Path, step: int) -> dict:
    return load_file(run_dir / "checkpoints" / f"global_step_{step}" / "policy" / "adapter_model.safetensors")


def logged_steps(run_dir: Path) -> list[int]:
    """The step of every metrics.jsonl line that carries a training step's metrics."""
    return [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]
