"""A real training run logging to a real MLflow server (and W&B offline) whose server dies mid-run."""

import json
import signal
import subprocess
import sys
import time

import pytest
from mlflow import MlflowClient

from conftest import REPO
from tracking_support import MlflowServer, isolate_wandb, wandb_history, wandb_records

pytestmark = pytest.mark.slow


def _train_steps_logged(run_dir) -> set[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return set()
    return {r["step"] for r in map(json.loads, path.read_text().splitlines()) if "train/loss" in r}


def _wait_for_step(process, run_dir, step: int, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while step not in _train_steps_logged(run_dir):
        assert process.poll() is None, "the run ended early"
        assert time.time() < deadline, f"step {step} never logged"
        time.sleep(0.1)


def test_server_outage_mid_run_loses_nothing(tmp_path, monkeypatch):
    isolate_wandb(monkeypatch, tmp_path)
    server = MlflowServer(tmp_path / "mlflow")
    server.start()
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "rlexp", f"hydra.run.dir={run_dir}", "logger=[mlflow,wandb]",
        f"logger.mlflow.tracking_uri={server.uri}", "logger.mlflow.retry_interval_s=1",
        "total_steps=6", "eval_interval=3", "ckpt_interval=6", "eval.num_mazes=2", "rollout.max_turns=2",
        "rollout.max_new_tokens_per_turn=6", "algorithm.train_batch_size=2", "algorithm.policy_mini_batch_size=1",
    ]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(process, run_dir, 2)
        server.stop(signal.SIGKILL)
        _wait_for_step(process, run_dir, 4)  # training goes on while the server is gone
        server.start()
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]

        client = MlflowClient(server.uri)
        (run,) = client.search_runs([client.get_experiment_by_name("tiny_cpu").experiment_id])
        assert run.info.status == "FINISHED"
        loss_steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
        assert sorted(loss_steps) == [1, 2, 3, 4, 5, 6]  # each step once: nothing lost, nothing doubled
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/success_rate")) == [0, 3, 6]

        local = {r["step"]: r["train/loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r}
        on_server = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
        assert on_server == pytest.approx(local)
        (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
        in_wandb = {row["_step"]: row["train/loss"] for row in wandb_history(wandb_records(log)) if "train/loss" in row}
        assert in_wandb == pytest.approx(local)
    finally:
        if process.poll() is None:
            process.kill()
        server.stop()
