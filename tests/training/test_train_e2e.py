"""End-to-end runs of ``rlexp`` as a subprocess: a 2-step run, kill -9 and resume, corrupt checkpoints."""

import json
import os
import signal
import subprocess
import time

import pytest
from mlflow import MlflowClient

from conftest import REPO
from e2e_support import adapter, logged_steps, metrics_by_step, own_env, rlexp_command, run_rlexp
from tracking_support import isolate_wandb, wandb_history, wandb_records

pytestmark = pytest.mark.slow

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


def test_kill_9_past_a_checkpoint_then_resume_logs_each_step_once(tmp_path, monkeypatch, mlflow_server):
    """Killed after step 3 was logged (checkpoint at 2), resumed: the run equals an uninterrupted one, and
    metrics.jsonl, the MLflow run and W&B's offline history hold each step once. Run again once finished,
    it neither evaluates nor logs anything more, and reports the final success."""
    isolate_wandb(monkeypatch, tmp_path)
    overrides = [
        "total_steps=4", "ckpt_interval=2", "keep_last_ckpts=4", "eval_interval=4", "algorithm.lr=0.05",
        "algorithm.train_batch_size=2", "algorithm.policy_mini_batch_size=1",  # 4 steps, twice, on 2 shared cores
    ]
    straight = tmp_path / "straight"
    run_rlexp(straight, *overrides)

    killed = tmp_path / "killed"
    tracked = [*overrides, "logger=[mlflow,wandb]", f"logger.mlflow.tracking_uri={mlflow_server.uri}"]
    # its own process group, killed whole as a preempted pod or a failed node is (W&B's service with it)
    process = subprocess.Popen(
        rlexp_command(killed, *tracked), cwd=REPO, env=own_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    client = MlflowClient(mlflow_server.uri)

    def step_3_on_the_server() -> bool:  # logged and sent: a resume that sent it again would double it
        state = killed / "tracking" / "mlflow.json"
        run_id = state.is_file() and json.loads(state.read_text()).get("run_id")
        return bool(run_id) and 3 in [m.step for m in client.get_metric_history(run_id, "train/loss")]

    deadline = time.time() + 600
    while not step_3_on_the_server():
        assert process.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (killed / "checkpoints" / "global_step_4").exists()
    assert 3 in logged_steps(killed)

    output = run_rlexp(killed, *tracked)
    assert "resumed from" in output and "global_step_2" in output
    assert logged_steps(killed) == [1, 2, 3, 4]
    assert metrics_by_step(killed) == metrics_by_step(straight)  # the resumed run's values, equal to a straight run
    final_straight, final_resumed = adapter(straight, 4), adapter(killed, 4)
    assert final_straight.keys() == final_resumed.keys()
    for name in final_straight:
        assert (final_straight[name] == final_resumed[name]).all(), name
    initial = adapter(straight, 2)
    assert any((initial[n] != final_straight[n]).any() for n in initial), "training never changed the adapter"

    (run,) = client.search_runs([client.get_experiment_by_name("tiny_cpu").experiment_id])
    assert run.info.status == "FINISHED"
    local = metrics_by_step(killed)
    for key in ("train/loss", "rollout/reward_mean", "train/grad_norm"):
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in history) == [1, 2, 3, 4], key
        assert {m.step: m.value for m in history} == pytest.approx({s: local[s][key] for s in local}), key
    eval_steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/success_rate"))
    assert eval_steps == [0, 4]
    logs = sorted(killed.glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)
    assert len(logs) == 2
    in_wandb = [(row["_step"], row["train/loss"]) for p in logs for row in wandb_history(wandb_records(p)) if "train/loss" in row]
    assert sorted(step for step, _ in in_wandb) == [1, 2, 3, 4]
    assert dict(in_wandb) == pytest.approx({s: local[s]["train/loss"] for s in local})

    # the same command once more: the run is finished; nothing is evaluated or logged again
    lines_before = (killed / "metrics.jsonl").read_text()
    histories = {k: client.get_metric_history(run.info.run_id, k) for k in ("eval/success_rate", "train/loss", "timing/eval_s")}
    summary = json.loads((killed / "eval" / "step_000004.summary.json").read_text())
    output = run_rlexp(killed, *tracked)
    assert "run already finished at step 4" in output
    assert f"success {summary['success_rate']:.1%}" in output
    assert "eval at step" not in output
    assert (killed / "metrics.jsonl").read_text() == lines_before
    for key, history in histories.items():
        assert len(client.get_metric_history(run.info.run_id, key)) == len(history), key
    assert client.get_run(run.info.run_id).info.status == "FINISHED"


def test_resume_overwrite_starts_fresh(tmp_path):
    run_dir = tmp_path / "run"
    run_rlexp(run_dir, "total_steps=2", "ckpt_interval=1", "eval_interval=10")
    output = run_rlexp(run_dir, "total_steps=1", "ckpt_interval=1", "eval_interval=10", "resume=overwrite")
    assert "resumed from" not in output
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["global_step_1"]
    assert logged_steps(run_dir) == [1]
    evals = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "eval/success_rate" in r]
    assert evals == [0, 1]


def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path):
    run_dir = tmp_path / "run"
    run_rlexp(run_dir, "total_steps=2", "ckpt_interval=1", "eval_interval=10")
    state = run_dir / "checkpoints" / "global_step_2" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # truncated, as by a crash mid-copy
    output = run_rlexp(run_dir, "total_steps=3", "ckpt_interval=1", "eval_interval=10")
    assert "global_step_2 is corrupt" in output
    assert "resumed from" in output and "global_step_1" in output
    assert (run_dir / "checkpoints" / "global_step_3" / "manifest.json").is_file()
