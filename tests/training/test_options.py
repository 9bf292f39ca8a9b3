"""One real tiny run for each option that changes the training path, each checked for what it promises."""

import json

import pytest

from conftest import compose_config
from rlexp.tasks.train import train

pytestmark = pytest.mark.slow

QUICK = (
    "name=tiny_cpu", "logger=none", "run_name=run", "total_steps=2", "eval_interval=2", "ckpt_interval=2", "eval.num_mazes=2",
    "rollout.max_turns=3", "rollout.max_new_tokens_per_turn=8", "algorithm.lr=0.05",
)


def _run(tmp_path, monkeypatch, *overrides) -> tuple[list[dict], dict]:
    """Train in-process in ``tmp_path``; returns the training-step records and the final eval summary."""
    monkeypatch.chdir(tmp_path)
    cfg = compose_config(*QUICK, *overrides)
    success = train(cfg)
    run_dir = tmp_path / "outputs" / cfg.name / "run"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "eval" / "step_000002.summary.json").read_text())
    assert summary["success_rate"] == success
    return [r for r in records if "rollout/reward_mean" in r], summary


def _finite(steps: list[dict]) -> None:
    for record in steps:
        for key, value in record.items():
            assert value == value and abs(value) != float("inf"), (key, value)


def test_kl_to_the_reference(tmp_path, monkeypatch):
    steps, _ = _run(tmp_path, monkeypatch, "algorithm.kl_coef=0.1")
    _finite(steps)
    assert all("train/kl" in s for s in steps if "train/loss" in s)
    # the reference is the adapter-free model: KL is 0 before the first update and positive after it
    assert steps[0]["train/kl"] == pytest.approx(0.0, abs=1e-6)
    assert steps[1]["train/kl"] > 0


def test_dr_grpo_with_a_history_window(tmp_path, monkeypatch):
    steps, _ = _run(tmp_path, monkeypatch, "algorithm=dr_grpo", "env.history_window=1")
    _finite(steps)
    assert all(s["train/samples"] > s["rollout/mean_turns"] for s in steps)  # one sequence per turn


def test_drop_zero_variance_groups(tmp_path, monkeypatch):
    # without a format share the untrained toy policy never earns a reward: every group is dropped
    steps, _ = _run(tmp_path, monkeypatch, "algorithm.drop_zero_variance_groups=true", "env.format_reward=0.0")
    assert [s["train/samples"] for s in steps] == [0.0, 0.0]
    assert all("train/loss" not in s for s in steps)


def test_several_epochs_per_step(tmp_path, monkeypatch):
    steps, _ = _run(tmp_path, monkeypatch, "algorithm.epochs_per_step=3")
    _finite(steps)
    # tiny_cpu: 4 mazes a step in mini-batches of 2 -> 2 optimizer steps an epoch
    assert [s["train/optimizer_steps"] for s in steps] == [6.0, 6.0]
    # later epochs train off-policy: the ratio moves away from 1
    assert any(s["train/ratio_max"] > 1.0 for s in steps)


def test_lr_warmup(tmp_path, monkeypatch):
    steps, _ = _run(tmp_path, monkeypatch, "algorithm.lr_warmup_steps=4")
    # 2 optimizer steps a training step: factors 1/5, 2/5 then 3/5, 4/5
    assert [s["train/lr"] for s in steps] == pytest.approx([0.05 * 1.5 / 5, 0.05 * 3.5 / 5])


def test_action_tags_through_the_engine(tmp_path, monkeypatch):
    steps, summary = _run(tmp_path, monkeypatch, "env.action_format=action_tag", "env.prompt=skyrl_instruct")
    _finite(steps)
    rows = [json.loads(line) for line in (tmp_path / "outputs" / "tiny_cpu" / "run" / "eval" / "step_000002.jsonl").read_text().splitlines()]
    assert summary["num_mazes"] == 2 and all(len(r["replies"]) == r["turns"] for r in rows)


def test_sampled_eval(tmp_path, monkeypatch):
    _, summary = _run(tmp_path, monkeypatch, "eval.greedy=false", "eval.samples_per_maze=3")
    assert summary["samples_per_maze"] == 3 and len(summary) > 0
    rows = (tmp_path / "outputs" / "tiny_cpu" / "run" / "eval" / "step_000002.jsonl").read_text().splitlines()
    assert len(rows) == 6
    assert 0.0 <= summary["success_rate"] <= summary["pass_at_k"] or summary["success_rate"] == 0.0


def test_full_history_training(tmp_path, monkeypatch):
    steps, _ = _run(tmp_path, monkeypatch, "env.history_window=null")
    _finite(steps)
    # one sequence per trajectory: 4 mazes x 4 samples
    assert all(s["train/samples"] == 16.0 for s in steps)
