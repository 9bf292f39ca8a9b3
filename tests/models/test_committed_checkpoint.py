"""The committed SFT warm start replays its recorded pinned-maze results through rlexp's own eval."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

CHECKPOINT = REPO / "checkpoints" / "maze_sft_warm_seed0"
#: the settings it was trained with (its README)
SETTINGS = [
    "env.cell_px=32", "env.history_window=1", "env.history_style=last_k", "env.image_format=png",
    "env.elicit_verbalization=false", "env.format_reward=0", "rollout.max_turns=20", "rollout.max_new_tokens_per_turn=2",
]
#: the first pinned mazes (the whole 64 take about 6 minutes on 2 cores)
MAZES = 8


def test_warm_start_replays_its_recorded_eval_on_the_first_pinned_mazes(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rlexp", "task=eval", "eval.policy=model", "logger=none", f"model.path={CHECKPOINT}",
         "model.dtype=float32", f"eval.num_mazes={MAZES}", f"hydra.run.dir={tmp_path}", *SETTINGS],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "eval" / "model.jsonl").read_text().splitlines()]
    recorded = [json.loads(line) for line in (CHECKPOINT / "pinned64_eval.jsonl").read_text().splitlines()][:MAZES]
    assert [(r["seed"], r["success"], r["replies"]) for r in rows] == [(r["seed"], r["success"], r["replies"]) for r in recorded]
    assert 0 < sum(r["success"] for r in rows) < MAZES  # a partly trained policy: some solved, some not
    summary = json.loads((CHECKPOINT / "pinned64_eval.summary.json").read_text())
    assert (summary["num_mazes"], round(summary["success_rate"] * 64), summary["turn_limit"]) == (64, 27, 20)


GRPO_ADAPTER = REPO / "checkpoints" / "maze_grpo_turn_batch_seed0"


def test_grpo_adapter_replays_its_recorded_eval_on_all_64(tmp_path):
    """The committed GRPO adapter (rollout=turn_batch, step 50, trained on an H100) evaluates on a CPU to
    the pinned-64 rows recorded on the GPU."""
    result = subprocess.run(
        [sys.executable, "-m", "rlexp", "task=eval", "experiment=tiny_maze_repro", "cluster=local_cpu", "logger=none",
         f"checkpoint={GRPO_ADAPTER}", f"model.path={CHECKPOINT}", f"hydra.run.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "eval" / "model.jsonl").read_text().splitlines()]
    recorded = [json.loads(line) for line in (GRPO_ADAPTER / "pinned64_eval.jsonl").read_text().splitlines()]
    assert [(r["seed"], r["success"], r["replies"]) for r in rows] == [(r["seed"], r["success"], r["replies"]) for r in recorded]
    assert sum(r["success"] for r in rows) == 44
