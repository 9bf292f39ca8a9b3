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


def test_resume_sends_each_metric_of_each_step_once(mlflow_server, tmp_path, caplog):
    """A process killed after logging steps 1-3 (step 3 half: only its loss) that checkpointed step 1;
    the resumed process logs steps 2-4 again. MLflow holds each (metric, step) once, step 3 complete."""
    run_dir = tmp_path / "exp" / "run1"
    first = MlflowTracker(run_dir, _info("resume-once"), tracking_uri=mlflow_server.uri)
    for step in (1, 2):
        first.log_metrics({"train/loss": 1 / step, "timing/step_s": 10.0 + step}, step)
    first.log_metrics({"train/loss": 1 / 3}, 3)  # killed here: no finish()

    second = MlflowTracker(run_dir, _info("resume-once"), tracking_uri=mlflow_server.uri)
    second.resume_from(1)
    with caplog.at_level("WARNING"):
        for step in (2, 3, 4):
            second.log_metrics({"train/loss": 1 / step, "timing/step_s": 20.0 + step}, step)
    assert "keeps the first value" not in caplog.text  # recomputed identically: nothing to report
    second.finish("FINISHED")

    client = MlflowClient(mlflow_server.uri)
    assert second.run_id == first.run_id
    assert _history(client, second.run_id, "train/loss") == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 0.25)]
    # the kill cut step 3 short: the resumed run completes it; steps already there keep their first value
    assert _history(client, second.run_id, "timing/step_s") == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0)]


def test_resume_with_pending_entries_and_changed_values_warns(mlflow_server, tmp_path, caplog):
    """Entries an outage left in the journal count as logged (they are sent first); a recomputed value that
    differs (a changed config) is not sent twice, and a warning says MLflow keeps the first."""
    run_dir = tmp_path / "exp" / "run1"
    first = MlflowTracker(run_dir, _info("resume-pending"), tracking_uri=mlflow_server.uri)
    first.log_metrics({"train/loss": 1.0}, 1)
    first.client = MlflowClient("http://127.0.0.1:9")  # the store stops answering: step 2 stays pending
    first._retry_at = 0.0
    first.log_metrics({"train/loss": 0.5}, 2)
    assert first.pending

    second = MlflowTracker(run_dir, _info("resume-pending"), tracking_uri=mlflow_server.uri)
    assert not second.pending  # the journal was sent first
    second.resume_from(0)  # no checkpoint: everything again
    with caplog.at_level("WARNING"):
        second.log_metrics({"train/loss": 1.0}, 1)
        second.log_metrics({"train/loss": 0.7}, 2)
    assert "keeps the first value logged of train/loss at step 2 (0.5), not this run's 0.7" in caplog.text
    second.finish("FINISHED")
    client = MlflowClient(mlflow_server.uri)
    assert _history(client, second.run_id, "train/loss") == [(1, 1.0), (2, 0.5)]
