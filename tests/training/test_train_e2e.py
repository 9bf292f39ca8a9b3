"""End-to-end runs of ``rlexp`` as a subprocess: a 2-step run, kill -9 and resume, corrupt checkpoints."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import REPO

pytestmark = pytest.mark.slow

#: small enough for a 2-core CPU; every override is an ordinary Hydra override a user could type.
QUICK = ["eval.num_mazes=4", "rollout.max_turns=3", "rollout.max_new_tokens_per_turn=8"]


def rlexp_command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "rlexp", f"hydra.run.dir={run_dir}", *QUICK, *overrides]


def run_rlexp(run_dir: Path, *overrides: str, timeout: float = 600) -> str:
    """Run to completion; returns everything it printed (logs go to stdout, progress bars to stderr)."""
    result = subprocess.run(rlexp_command(run_dir, *overrides), cwd=REPO, capture_output=True, text=True, timeout=timeout)
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


def test_two_step_run_leaves_metrics_evals_and_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    output = run_rlexp(run_dir, "total_steps=2", "ckpt_interval=2", "eval_interval=2")
    steps = metrics_by_step(run_dir)
    assert sorted(steps) == [1, 2]
    assert steps[1]["rollout/invalid_action_rate"] > 0  # an untrained policy's garbage is counted, not fatal
    for step in (0, 2):
        summary = json.loads((run_dir / "eval" / f"step_{step:06d}.summary.json").read_text())
        assert summary["num_mazes"] == 4 and summary["turn_limit"] == 3
        assert 0.0 <= summary["success_ci_low"] <= summary["success_rate"] <= summary["success_ci_high"]
        rows = (run_dir / "eval" / f"step_{step:06d}.jsonl").read_text().splitlines()
        assert len(rows) == 4
    checkpoint = run_dir / "checkpoints" / "global_step_2"
    assert (checkpoint / "policy" / "adapter_config.json").is_file()
    assert (checkpoint / "trainer_state.pt").is_file() and (checkpoint / "config.yaml").is_file()
    assert (run_dir / "status").read_text().strip() == "FINISHED"
    assert str(run_dir) in output  # tells the user where things went
    assert (run_dir / "eval" / "step_000002" / "maze_0.gif").is_file()

    eval_dir = tmp_path / "eval"
    output = run_rlexp(eval_dir, "task=eval", f"checkpoint={checkpoint}")
    summary = json.loads((eval_dir / "eval" / "model.summary.json").read_text())
    assert summary["num_mazes"] == 4 and summary["turn_limit"] == 3
    assert "eval (model)" in output
    # the saved adapter, evaluated afresh, replays the run's final greedy eval exactly
    final_rows = (run_dir / "eval" / "step_000002.jsonl").read_text().splitlines()
    assert (eval_dir / "eval" / "model.jsonl").read_text().splitlines() == final_rows


def test_kill_9_and_resume_equals_uninterrupted_run(tmp_path):
    overrides = ["total_steps=4", "ckpt_interval=1", "keep_last_ckpts=4", "eval_interval=4", "algorithm.lr=0.05"]
    straight = tmp_path / "straight"
    run_rlexp(straight, *overrides)

    killed = tmp_path / "killed"
    process = subprocess.Popen(rlexp_command(killed, *overrides), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not (killed / "checkpoints" / "global_step_2").is_dir():
        assert process.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not (killed / "checkpoints" / "global_step_4").exists()

    output = run_rlexp(killed, *overrides)
    assert "resumed from" in output
    assert metrics_by_step(killed) == metrics_by_step(straight)
    final_straight, final_resumed = adapter(straight, 4), adapter(killed, 4)
    assert final_straight.keys() == final_resumed.keys()
    for name in final_straight:
        assert (final_straight[name] == final_resumed[name]).all(), name
    initial = adapter(straight, 1)
    assert any((initial[n] != final_straight[n]).any() for n in initial), "training never changed the adapter"


def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path):
    run_dir = tmp_path / "run"
    run_rlexp(run_dir, "total_steps=2", "ckpt_interval=1", "eval_interval=10")
    state = run_dir / "checkpoints" / "global_step_2" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # truncated, as by a crash mid-copy
    output = run_rlexp(run_dir, "total_steps=3", "ckpt_interval=1", "eval_interval=10")
    assert "global_step_2 is corrupt" in output
    assert "resumed from" in output and "global_step_1" in output
    assert (run_dir / "checkpoints" / "global_step_3" / "manifest.json").is_file()
