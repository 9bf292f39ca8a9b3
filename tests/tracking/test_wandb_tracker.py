"""WandbTracker, offline (no credentials): what its ``.wandb`` file in the run dir holds, and resume."""

import time
from pathlib import Path

from PIL import Image

from rlexp.tracking.wandb_tracker import WandbTracker, has_credentials
from tracking_support import isolate_wandb, wandb_history, wandb_records

INFO = {"run_name": "run1", "experiment": "exp", "group": "multirun-2026-01-01_00-00-00", "tags": {}}


def _logs(run_dir: Path, run_id: str) -> list[Path]:
    """The offline runs of ``run_id``, oldest first (a resume in the same second gets a ``-1`` suffix),
    once each is complete: ``finish`` can return before W&B's service has written the end of the file."""
    logs = sorted(run_dir.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb"), key=lambda p: p.parent.name)
    deadline = time.monotonic() + 30
    while not all(any(r.HasField("exit") for r in wandb_records(p)) for p in logs):
        assert time.monotonic() < deadline, "W&B never finished writing its offline files"
        time.sleep(0.1)
    return logs


def _records(run_dir: Path, run_id: str) -> list:
    """The newest offline run of ``run_id``."""
    return wandb_records(_logs(run_dir, run_id)[-1])


def _pictures(folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True)
    png, gif = folder / "maze_7.png", folder / "maze_7.gif"
    Image.new("RGB", (8, 8), "white").save(png)
    frames = [Image.new("RGB", (8, 8), (40 * i, 0, 0)) for i in range(3)]
    frames[0].save(gif, save_all=True, append_images=frames[1:])
    return png, gif


def test_offline_run_holds_metrics_config_group_tags_and_pictures(tmp_path, monkeypatch):
    isolate_wandb(monkeypatch, tmp_path)
    run_dir = tmp_path / "exp" / "run1"
    tracker = WandbTracker(run_dir, INFO, tags=["smoke"])
    assert tracker.run.offline
    tracker.log_params({"algorithm.lr": 1e-5, "model.lora.target_modules": ["q_proj", "v_proj"]})
    tracker.set_tags({"choice.model": "tiny", "git_commit": "0" * 40})
    for step in (1, 2, 3):
        tracker.log_metrics({"train/loss": 1 / step, "eval/success@1": step / 10}, step)
    png, gif = _pictures(run_dir / "eval" / "step_000003")
    tracker.log_artifact(png)
    tracker.log_artifact(gif)
    tracker.finish("FAILED")

    records = _records(run_dir, tracker.run.id)
    kinds = [r.WhichOneof("record_type") for r in records]
    rows = [r for r in wandb_history(records) if "train/loss" in r]
    assert [(r["_step"], r["train/loss"], r["eval/success@1"]) for r in rows] == [(1, 1.0, 0.1), (2, 0.5, 0.2), (3, 1 / 3, 0.3)]
    assert rows[-1]["eval/maze_7_png"]["_type"] == "image-file"
    assert rows[-1]["eval/maze_7_gif"]["_type"] == "video-file"
    config = {u.key: u.value_json for r in records if r.HasField("config") for u in r.config.update}
    assert config["algorithm.lr"] == "0.00001" and config["model.lora.target_modules"] == '["q_proj","v_proj"]'
    last_run = [r.run for r in records if r.HasField("run")][-1]
    assert last_run.run_group == INFO["group"] and last_run.display_name == "run1"
    assert set(last_run.tags) == {"smoke", "choice.model=tiny", f"git_commit={'0' * 40}"}
    assert records[kinds.index("exit")].exit.exit_code == 1


def test_resume_continues_the_same_run_id(tmp_path, monkeypatch):
    isolate_wandb(monkeypatch, tmp_path)
    run_dir = tmp_path / "exp" / "run1"
    first = WandbTracker(run_dir, INFO)
    first.log_metrics({"train/loss": 1.0}, 1)
    first.finish("FAILED")
    second = WandbTracker(run_dir, INFO)
    assert second.run.id == first.run.id
    second.log_metrics({"train/loss": 0.5}, 2)
    second.finish("FINISHED")
    assert len(list(run_dir.glob(f"wandb/offline-run-*-{first.run.id}*"))) == 2
    records = _records(run_dir, second.run.id)
    assert [r["train/loss"] for r in wandb_history(records)] == [0.5]
    assert [r.exit.exit_code for r in records if r.HasField("exit")] == [0]


def test_credentials_pick_online(tmp_path, monkeypatch):
    isolate_wandb(monkeypatch, tmp_path)
    assert not has_credentials()
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert has_credentials()
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    assert not has_credentials()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert has_credentials()


def test_resume_logs_each_key_of_each_step_once(tmp_path, monkeypatch):
    """Steps 1-3 logged, then a resume from checkpoint 1 logs 2-4 again: across the run's offline files
    every (key, step) appears once, and the step a kill cut short is completed."""
    isolate_wandb(monkeypatch, tmp_path)
    run_dir = tmp_path / "exp" / "run1"
    first = WandbTracker(run_dir, INFO)
    for step in (1, 2):
        first.log_metrics({"train/loss": 1 / step, "eval/success": 0.1}, step)
    first.log_metrics({"train/loss": 1 / 3}, 3)
    first.finish("FAILED")
    _logs(run_dir, first.run.id)  # a killed process's files are complete: it is gone

    second = WandbTracker(run_dir, INFO)
    second.resume_from(1)
    for step in (2, 3, 4):
        second.log_metrics({"train/loss": 1 / step, "eval/success": 0.2}, step)
    second.finish("FINISHED")

    logs = _logs(run_dir, first.run.id)
    assert len(logs) == 2
    rows = [row for path in logs for row in wandb_history(wandb_records(path))]
    pairs = sorted((row["_step"], key) for row in rows for key in row if not key.startswith("_"))
    assert pairs == sorted({(s, "train/loss") for s in (1, 2, 3, 4)} | {(s, "eval/success") for s in (1, 2, 3, 4)})
    assert {row["_step"]: row["eval/success"] for row in rows if "eval/success" in row} == {1: 0.1, 2: 0.1, 3: 0.2, 4: 0.2}


def test_resume_sends_again_steps_a_kill_lost_before_the_checkpoint(tmp_path, monkeypatch):
    """The killed process's W&B file ends at step 1, though the run checkpointed step 2: step 2 is not
    recomputed, so it is sent again from metrics.jsonl, once."""
    isolate_wandb(monkeypatch, tmp_path)
    run_dir = tmp_path / "exp" / "run1"
    first = WandbTracker(run_dir, INFO)
    first.log_metrics({"train/loss": 1.0}, 1)
    first.finish("FAILED")
    _logs(run_dir, first.run.id)
    (run_dir / "metrics.jsonl").write_text(
        '{"step": 1, "time": 0, "train/loss": 1.0}\n{"step": 2, "time": 0, "train/loss": 0.5}\n'
    )
    second = WandbTracker(run_dir, INFO)
    second.resume_from(2)
    second.log_metrics({"train/loss": 0.25}, 3)
    second.finish("FINISHED")
    rows = [row for path in _logs(run_dir, first.run.id) for row in wandb_history(wandb_records(path))]
    assert sorted((row["_step"], row["train/loss"]) for row in rows) == [(1, 1.0), (2, 0.5), (3, 0.25)]


def test_a_run_id_still_held_by_a_killed_process_is_waited_for(tmp_path, monkeypatch):
    """After a kill -9, the killed process's W&B service can hold the run id for a while."""
    from rlexp.tracking import wandb_tracker

    calls = []

    def held_twice(**kwargs):
        calls.append(kwargs["id"])
        if len(calls) < 3:
            raise RuntimeError(f"run ID {kwargs['id']} is in use")
        return "run"

    monkeypatch.setattr(wandb_tracker.wandb, "init", held_twice)
    monkeypatch.setattr(wandb_tracker.time, "sleep", lambda s: None)
    assert wandb_tracker._init_when_free(id="abc") == "run" and calls == ["abc"] * 3
    monkeypatch.setattr(wandb_tracker, "RUN_ID_RELEASE_S", -1)
    calls.clear()
    try:
        wandb_tracker._init_when_free(id="abc")
    except RuntimeError as error:
        assert "in use" in str(error) and calls == ["abc"]
    else:
        raise AssertionError("an id held past the deadline must fail")
