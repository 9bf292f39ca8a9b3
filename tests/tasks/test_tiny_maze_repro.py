"""experiment=tiny_maze_repro (issue 8): GRPO starts from the committed SFT warm start, on a CPU too."""

import json
from pathlib import Path

import pytest

from conftest import compose_config
from rlexp.tasks.train import train

pytestmark = pytest.mark.slow

WARM_START = Path(__file__).resolve().parents[2] / "checkpoints" / "maze_sft_warm_seed0"


def test_first_steps_start_from_the_warm_start(tmp_path, monkeypatch):
    """Step 0's eval is the warm start's own (its committed per-maze rows: a fresh LoRA adapter changes
    nothing), and a GRPO step from there trains with finite numbers."""
    monkeypatch.chdir(tmp_path)
    cfg = compose_config(
        "experiment=tiny_maze_repro", "name=tiny_maze_repro", "cluster=local_cpu", "logger=none", "run_name=run",
        f"model.path={WARM_START}", "total_steps=1", "eval_interval=1", "ckpt_interval=1", "eval.num_mazes=2",
        "algorithm.train_batch_size=2", "algorithm.n_samples_per_prompt=2", "algorithm.policy_mini_batch_size=2",
    )
    train(cfg)
    run_dir = tmp_path / "outputs" / "tiny_maze_repro" / "run"
    at_start = [json.loads(line) for line in (run_dir / "eval" / "step_000000.jsonl").read_text().splitlines()]
    committed = [json.loads(line) for line in (WARM_START / "pinned64_eval.jsonl").read_text().splitlines()][:2]
    assert [(r["maze"], r["success"], r["replies"]) for r in at_start] == [
        (r["maze"], r["success"], r["replies"]) for r in committed
    ]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (step,) = [s for s in steps if "train/loss" in s]
    assert step["rollout/mean_turns"] > 1 and step["rollout/invalid_action_rate"] < 0.5
    assert all(v == v and abs(v) != float("inf") for v in step.values())
    assert (run_dir / "checkpoints" / "global_step_1" / "policy" / "adapter_model.safetensors").exists()
