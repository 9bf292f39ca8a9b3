"""The ``logger`` group: every option composes (also combined), ``build_trackers`` builds what it names,
and a real ``rlexp -m`` sweep reaches MLflow and W&B with its group, tags, metrics and pictures."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from conftest import REPO, compose_config
from rlexp.tracking import JsonlTracker, build_trackers, discard_records
from rlexp.tracking.base import git_commit, run_info
from rlexp.tracking.mlflow_tracker import MlflowTracker
from rlexp.tracking.wandb_tracker import WandbTracker
from tracking_support import isolate_wandb, wandb_history, wandb_records

TARGETS = {
    "mlflow": "rlexp.tracking.mlflow_tracker.MlflowTracker",
    "wandb": "rlexp.tracking.wandb_tracker.WandbTracker",
}


@pytest.mark.parametrize(
    "override,names",
    [("logger=none", []), ("logger=mlflow", ["mlflow"]), ("logger=wandb", ["wandb"]), ("logger=[mlflow,wandb]", ["mlflow", "wandb"])],
)
def test_logger_options_compose(override, names):
    logger = compose_config(override).logger
    assert {name: spec["_target_"] for name, spec in logger.items() if spec is not None} == {n: TARGETS[n] for n in names}


def test_cli_composes_both_loggers():
    result = subprocess.run(
        [sys.executable, "-m", "rlexp", "logger=[mlflow,wandb]", "logger.mlflow.tracking_uri=http://127.0.0.1:5000", "--cfg", "job"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert all(target in result.stdout for target in TARGETS.values())
    assert "tracking_uri: http://127.0.0.1:5000" in result.stdout


def test_run_info_outside_hydra(tmp_path):
    info = run_info(tmp_path / "tiny_cpu" / "try1", compose_config("name=test"))
    assert info["run_name"] == "try1" and info["experiment"] == "test" and info["group"] is None
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert git_commit() == commit and info["tags"] == {"git_commit": commit}


def test_build_trackers_with_mlflow_and_wandb(tmp_path, monkeypatch):
    isolate_wandb(monkeypatch, tmp_path)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = compose_config("name=test", "logger=[mlflow,wandb]", f"logger.mlflow.tracking_uri={store}")
    run_dir = tmp_path / "test" / "try1"
    trackers = build_trackers(cfg.logger, run_dir, cfg)
    assert [type(t) for t in trackers.trackers] == [JsonlTracker, MlflowTracker, WandbTracker]
    trackers.log_metrics({"eval/success@1": 0.25}, 0)
    trackers.finish("FINISHED")

    mlflow_tracker, wandb_tracker = trackers.trackers[1:]
    run = MlflowClient(store).get_run(mlflow_tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "try1"
    assert run.data.params["algorithm.lr"] == str(cfg.algorithm.lr) and run.data.metrics == {"eval/success_at_1": 0.25}
    assert run.data.tags["git_commit"] == git_commit()
    assert run.info.artifact_uri.startswith(str(tmp_path / "mlartifacts"))  # beside a sqlite store
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    records = wandb_records(log)
    config = {u.key for r in records if r.HasField("config") for u in r.config.update}
    assert {"algorithm.lr", "model.lora.rank", "logger.mlflow.tracking_uri"} <= config
    assert [row["eval/success@1"] for row in wandb_history(records)] == [0.25]
    assert json.loads((run_dir / "params.json").read_text())["name"] == "test"
    assert (run_dir / "status").read_text() == "FINISHED\n"


@pytest.mark.slow
def test_multirun_sweep_reaches_both_trackers(tmp_path, monkeypatch):
    """``rlexp -m`` with two scripted-policy evals: one MLflow run and one W&B run per job, grouped by sweep."""
    isolate_wandb(monkeypatch, tmp_path)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep = tmp_path / "multirun-test"
    command = [
        sys.executable, "-m", "rlexp", "-m", "task=eval", "eval.policy=expert,random", "eval.num_mazes=2",
        "logger=[mlflow,wandb]", f"logger.mlflow.tracking_uri={store}", f"hydra.sweep.dir={sweep}",
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("tiny_cpu").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["multirun-test/0", "multirun-test/1"]
    for run, policy in zip(sorted(runs, key=lambda r: r.info.run_name), ["expert", "random"]):
        assert run.info.status == "FINISHED"
        assert {k: run.data.tags[k] for k in ("sweep", "choice.env", "choice.experiment", "choice.model")} == {
            "sweep": "multirun-test", "choice.env": "maze_easy", "choice.experiment": "tiny_cpu", "choice.model": "tiny",
        }
        assert run.data.params["eval.policy"] == policy and "eval/success_rate" in run.data.metrics
        pictures = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, f"eval/{policy}")}
        assert {"maze_0.png", "maze_0.gif", "maze_1.png", "maze_1.gif"} <= pictures
        (log,) = (sweep / run.info.run_name.split("/")[-1]).glob("wandb/offline-run-*/run-*.wandb")
        wandb_run = [r.run for r in wandb_records(log) if r.HasField("run")][-1]
        assert wandb_run.run_group == "multirun-test" and "sweep=multirun-test" in wandb_run.tags


def test_jsonl_resume_keeps_steps_up_to_the_checkpoint_and_drops_torn_lines(tmp_path):
    tracker = JsonlTracker(tmp_path)
    for step in (0, 1, 2, 3):
        tracker.log_metrics({"train/loss": float(step)}, step)
    with tracker.metrics_path.open("a") as f:
        f.write('{"step": 4, "train/lo')  # a kill mid-line
    tracker.resume_from(2)
    assert [json.loads(line)["step"] for line in tracker.metrics_path.read_text().splitlines()] == [0, 1, 2]
    tracker.resume_from(0)  # a fresh start logs everything again, the step-0 eval too
    assert tracker.metrics_path.read_text() == ""


def test_overwrite_discards_the_old_runs_records(tmp_path):
    for name in ("metrics.jsonl", "params.json", "status", "tracking/mlflow.json", "eval/step_000000.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    discard_records(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["eval", "eval/step_000000.jsonl"]


def test_jsonl_tags_accumulate(tmp_path):
    tracker = JsonlTracker(tmp_path)
    tracker.set_tags({"choice.model": "tiny"})
    tracker.set_tags({"checkpoint": "/x/global_step_1"})
    assert json.loads((tmp_path / "tags.json").read_text()) == {"choice.model": "tiny", "checkpoint": "/x/global_step_1"}
