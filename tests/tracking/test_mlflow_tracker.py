"""MlflowTracker against a real ``mlflow server``: what lands on it, FINISHED/FAILED, resume, and an
outage (server down at start, killed mid-run, down at finish) that loses and duplicates nothing."""

import json
import signal
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from PIL import Image

from rlexp.tracking.mlflow_tracker import MlflowTracker, sanitize_name
from tracking_support import MlflowServer


def _info(experiment: str, run_name: str = "run1") -> dict:
    return {"run_name": run_name, "experiment": experiment, "group": None, "tags": {}}


def _png(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), "orange").save(path)
    return path


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.mark.parametrize(
    "name,sanitized",
    [
        ("train/loss", "train/loss"),
        ("eval/success@1", "eval/success_at_1"),
        ("timing/generate(s)", "timing/generate_s"),
        ("eval/rate (%)", "eval/rate"),
        ("/a//b/", "a/b"),
        ("a/../b", "a/b"),
        ("loss[0]", "loss_0"),
    ],
)
def test_sanitize_name(name, sanitized):
    assert sanitize_name(name) == sanitized


def test_params_tags_metrics_artifacts(mlflow_server, tmp_path):
    run_dir = tmp_path / "tiny_cpu" / "run1"
    tracker = MlflowTracker(run_dir, _info("basic"), tracking_uri=mlflow_server.uri, tags={"owner": "tests"})
    tracker.log_params({"algorithm.lr": 1e-5, "model.lora.target_modules": ["q_proj"], "long": "x" * 7000, "k" * 300: 1})
    tracker.set_tags({"choice.model": "tiny", "git_commit": "0" * 40})
    for step in (1, 2, 3):
        tracker.log_metrics({"train/loss": 1 / step, "eval/success@1": step / 10, "timing/generate(s)": 0.5}, step)
    picture = _png(run_dir / "eval" / "step_000003" / "maze_7.png")
    tracker.log_artifact(picture)
    tracker.finish("FINISHED")

    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(tracker.run_id)
    assert (run.info.status, run.info.run_name) == ("FINISHED", "run1")
    assert client.get_experiment(run.info.experiment_id).name == "basic"
    params = run.data.params
    assert params["algorithm.lr"] == "1e-05" and params["model.lora.target_modules"] == "['q_proj']"
    assert params["long"] == "x" * 5997 + "..." and params["k" * 250] == "1"
    assert {k: run.data.tags[k] for k in ("owner", "choice.model", "git_commit", "mlflow.source.git.commit")} == {
        "owner": "tests", "choice.model": "tiny", "git_commit": "0" * 40, "mlflow.source.git.commit": "0" * 40,
    }
    assert _history(client, tracker.run_id, "eval/success_at_1") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert _history(client, tracker.run_id, "timing/generate_s") == [(1, 0.5), (2, 0.5), (3, 0.5)]
    assert [a.path for a in client.list_artifacts(tracker.run_id, "eval/step_000003")] == ["eval/step_000003/maze_7.png"]
    copy = client.download_artifacts(tracker.run_id, "eval/step_000003/maze_7.png", str(tmp_path / "download"))
    assert Path(copy).read_bytes() == picture.read_bytes()
    assert not tracker.pending


def test_failed_then_resumed_continues_the_same_run(mlflow_server, tmp_path, caplog):
    run_dir = tmp_path / "tiny_cpu" / "run1"
    client = MlflowClient(mlflow_server.uri)
    first = MlflowTracker(run_dir, _info("resume"), tracking_uri=mlflow_server.uri)
    first.log_params({"algorithm.lr": 1e-5, "total_steps": 2})
    first.log_metrics({"train/loss": 1.0}, 1)
    first.finish("FAILED")
    assert client.get_run(first.run_id).info.status == "FAILED"

    second = MlflowTracker(run_dir, _info("resume"), tracking_uri=mlflow_server.uri)
    assert second.run_id == first.run_id
    assert client.get_run(first.run_id).info.status == "RUNNING"
    second.log_params({"algorithm.lr": 1e-5, "total_steps": 4, "resume": "latest"})  # one changed, one new
    assert "total_steps" in caplog.text
    second.log_metrics({"train/loss": 0.5}, 2)
    second.finish("FINISHED")

    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"algorithm.lr": "1e-05", "total_steps": "2", "resume": "latest"}
    assert _history(client, first.run_id, "train/loss") == [(1, 1.0), (2, 0.5)]
    assert len(client.search_runs([run.info.experiment_id])) == 1


@pytest.mark.slow
def test_outage_loses_and_duplicates_nothing(tmp_path):
    """Down at start, killed mid-run, down at finish; every step ends on the server once."""
    server = MlflowServer(tmp_path / "server")
    run_dir = tmp_path / "tiny_cpu" / "run1"
    info = _info("outage")

    def log(tracker: MlflowTracker, step: int) -> None:
        start = time.monotonic()
        tracker.log_metrics({"train/loss": 1 / step, "eval/success@1": step / 100}, step)
        assert time.monotonic() - start < 5, f"step {step} stalled"

    try:
        start = time.monotonic()
        tracker = MlflowTracker(run_dir, info, tracking_uri=server.uri, flush_timeout_s=2, retry_interval_s=0.5)
        assert time.monotonic() - start < 5
        tracker.log_params({"algorithm.lr": 1e-5})
        for step in (1, 2, 3):
            log(tracker, step)
        assert tracker.run_id is None and len(tracker.pending) == 5

        server.start()
        for step in (4, 5, 6):
            log(tracker, step)
        assert tracker.run_id is not None and not tracker.pending

        server.stop(signal.SIGKILL)
        for step in (7, 8, 9):
            log(tracker, step)
        tracker.log_artifact(_png(run_dir / "eval" / "step_000009" / "maze_1.png"))
        assert len(tracker.pending) == 4

        server.start()
        for step in (10, 11):
            log(tracker, step)
        assert not tracker.pending

        server.stop(signal.SIGKILL)
        log(tracker, 12)
        start = time.monotonic()
        tracker.finish("FINISHED")
        assert time.monotonic() - start < 2 + 5
        assert [e["op"] for e in tracker.pending] == ["metrics", "status"]
        assert json.loads((run_dir / "tracking" / "mlflow.json").read_text())["sent"] == tracker.pending[0]["seq"] - 1

        server.start()
        resumed = MlflowTracker(run_dir, info, tracking_uri=server.uri)
        assert resumed.run_id == tracker.run_id and not resumed.pending
        log(resumed, 13)
        resumed.finish("FINISHED")

        client = MlflowClient(server.uri)
        run = client.get_run(tracker.run_id)
        expected = list(range(1, 14))
        assert _history(client, run.info.run_id, "train/loss") == [(s, 1 / s) for s in expected]
        assert _history(client, run.info.run_id, "eval/success_at_1") == [(s, s / 100) for s in expected]
        assert run.data.params == {"algorithm.lr": "1e-05"}
        assert run.info.status == "FINISHED"
        assert [a.path for a in client.list_artifacts(run.info.run_id, "eval/step_000009")] == ["eval/step_000009/maze_1.png"]
        assert len(client.search_runs([run.info.experiment_id])) == 1
    finally:
        server.stop()
