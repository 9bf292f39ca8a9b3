"""``task=eval checkpoint=…`` evaluates a checkpoint as it was trained, unless told otherwise."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def rlexp(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "rlexp", "logger=none", *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_eval_takes_the_checkpoints_settings_and_the_command_lines_overrides_of_them(tmp_path):
    run_dir = tmp_path / "run"
    rlexp(
        f"hydra.run.dir={run_dir}", "total_steps=1", "eval.num_mazes=2", "rollout.max_turns=3",
        "rollout.max_new_tokens_per_turn=5", "env.history_window=1",
    )
    checkpoint = run_dir / "checkpoints" / "global_step_1"
    as_trained = tmp_path / "as_trained"
    rlexp(f"hydra.run.dir={as_trained}", "task=eval", f"checkpoint={checkpoint}", "eval.num_mazes=2")
    summary = json.loads((as_trained / "eval" / "model.summary.json").read_text())
    assert summary["turn_limit"] == 3
    # the run's own final eval, replayed from the checkpoint's settings alone
    assert (as_trained / "eval" / "model.jsonl").read_text() == (run_dir / "eval" / "step_000001.jsonl").read_text()
    overridden = tmp_path / "overridden"
    rlexp(f"hydra.run.dir={overridden}", "task=eval", f"checkpoint={checkpoint}", "eval.num_mazes=2", "rollout.max_turns=2")
    assert json.loads((overridden / "eval" / "model.summary.json").read_text())["turn_limit"] == 2
