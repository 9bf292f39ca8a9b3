"""Checkpoints without a model: what verifies, what is corrupt (and why), leftovers of failed saves,
resume choices, RNG states; then the refusals through the real CLI (they stop before any model loads)."""

import errno
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO
from rlexp.training import checkpoint as ckpt
from rlexp.training.checkpoint import (
    ResumeError,
    latest_valid_checkpoint,
    list_checkpoints,
    resolve_resume,
    rng_states,
    save_checkpoint,
    verify_checkpoint,
)


class _Adapter:
    """Writes what peft's ``save_pretrained`` writes for a LoRA adapter."""

    def save_pretrained(self, path: Path) -> None:
        path.mkdir(parents=True)
        (path / "adapter_config.json").write_text('{"r": 8}\n')
        (path / "adapter_model.safetensors").write_bytes(b"weights" * 10)


def _save(root: Path, step: int, keep_last: int = 10) -> Path:
    return save_checkpoint(root, step, _Adapter(), {"optimizer": {}}, OmegaConf.create({"seed": 0}), keep_last)


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_saved_checkpoint_verifies_and_lists_every_file(tmp_path):
    path = _save(tmp_path, 3)
    assert path.name == "global_step_3" and verify_checkpoint(path) is None
    assert set(_manifest(path)["files"]) == {
        "trainer_state.pt", "config.yaml", "policy/adapter_config.json", "policy/adapter_model.safetensors",
    }


@pytest.mark.parametrize(
    "content,problem",
    [
        (b"{}", "manifest lists no files"),
        (b"[]", "manifest is a JSON list, not an object"),
        (b'"global_step_1"', "manifest is a JSON str, not an object"),
        (b"null", "manifest is a JSON NoneType, not an object"),
        (b"\xff\xfe\x00garbage", "manifest is not UTF-8 text"),
        (b'{"files": {"trainer_state.pt": "ab', "manifest is not valid JSON"),
        (b'{"step": 1, "files": {}}', "manifest lists no files"),
        (b'{"step": 1, "files": ["trainer_state.pt"]}', "manifest lists no files"),
        (b'{"step": 1, "files": {"trainer_state.pt": 5}}', "manifest file entries are not name: checksum strings"),
        (b'{"step": 2, "files": {"config.yaml": "00"}}', "manifest is for step 2, not 1"),
    ],
)
def test_malformed_manifest_is_corrupt_not_a_crash(tmp_path, content, problem):
    path = _save(tmp_path, 1)
    (path / "manifest.json").write_bytes(content)
    assert verify_checkpoint(path) == problem


@pytest.mark.parametrize("required", ["trainer_state.pt", "policy/adapter_model.safetensors", "policy/adapter_config.json"])
def test_manifest_must_list_the_files_a_checkpoint_needs(tmp_path, required):
    """A manifest that verifies what is there but omits a required file (a save that lost it) is corrupt."""
    path = _save(tmp_path, 1)
    manifest = _manifest(path)
    del manifest["files"][required]
    (path / required).unlink()
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert verify_checkpoint(path) == f"manifest does not list {required}"


def test_missing_or_changed_or_escaping_file_is_corrupt(tmp_path):
    path = _save(tmp_path, 1)
    (path / "policy" / "adapter_model.safetensors").write_bytes(b"other")
    assert verify_checkpoint(path) == "policy/adapter_model.safetensors (LoRA weights) does not match its checksum"
    (_save(tmp_path, 2) / "trainer_state.pt").unlink()
    assert verify_checkpoint(tmp_path / "global_step_2") == "missing trainer_state.pt (optimizer, scheduler and RNG state)"
    manifest = _manifest(_save(tmp_path, 3))
    manifest["files"]["../global_step_1/config.yaml"] = "0" * 64
    (tmp_path / "global_step_3" / "manifest.json").write_text(json.dumps(manifest))
    assert "outside the checkpoint" in verify_checkpoint(tmp_path / "global_step_3")


@pytest.mark.parametrize("content", [b"{}", b"[]", b'"x"', b"\xff\xfe"])
def test_corrupt_newest_falls_back_with_a_warning_naming_the_problem(tmp_path, caplog, content):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    (newest / "manifest.json").write_bytes(content)
    with caplog.at_level(logging.WARNING):
        assert latest_valid_checkpoint(tmp_path) == tmp_path / "global_step_1"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "global_step_2 is corrupt" in warning and verify_checkpoint(newest) in warning


def test_temp_dirs_of_failed_saves_are_never_listed_and_are_removed(tmp_path):
    _save(tmp_path, 1)
    leftover = tmp_path / ".tmp-global_step_2-abc123"
    (leftover / "policy").mkdir(parents=True)
    (leftover / "trainer_state.pt").write_bytes(b"half")
    odd = [tmp_path / "global_step_x", tmp_path / "global_step_²"]  # not a step: never listed
    for path in odd:
        path.mkdir()
    assert list_checkpoints(tmp_path) == [tmp_path / "global_step_1"]

    _save(tmp_path, 2)  # the next save clears what the failed one left
    assert not leftover.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")) == []

    (tmp_path / ".tmp-global_step_3-def456").mkdir()
    assert resolve_resume(tmp_path, "latest") == tmp_path / "global_step_2"  # so does a start
    assert not (tmp_path / ".tmp-global_step_3-def456").exists()


class _FullDisk:
    """``open`` whose files raise ENOSPC once ``budget`` bytes have been written to them in all, as a disk
    that fills up during a save does (the file layer both ``torch.save`` and ``Path.write_text`` use)."""

    def __init__(self, real_open, budget: int):
        self.real_open, self.budget = real_open, budget

    def __call__(self, file, mode="r", *args, **kwargs):
        handle = self.real_open(file, mode, *args, **kwargs)
        if not any(c in mode for c in "wax+"):
            return handle
        disk, write = self, handle.write

        def limited(data):
            if len(data) > disk.budget:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
            disk.budget -= len(data)
            return write(data)

        handle.write = limited
        return handle


@pytest.mark.parametrize("budget", [0, 60, 500])
def test_disk_full_during_save_keeps_the_previous_and_leaves_nothing(tmp_path, monkeypatch, budget):
    import builtins
    import io

    _save(tmp_path, 1)
    full = _FullDisk(builtins.open, budget)
    monkeypatch.setattr(builtins, "open", full)
    monkeypatch.setattr(io, "open", full)
    with pytest.raises(ckpt.CheckpointSaveError) as raised:
        _save(tmp_path, 2)
    message = str(raised.value)
    assert str(tmp_path / "global_step_2") in message and "No space left on device" in message
    assert re.search(r"\d+\.\d MiB free on ", message) and "global_step_1 is intact" in message
    assert raised.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1"]  # no partial folder to pick up
    monkeypatch.undo()
    assert verify_checkpoint(tmp_path / "global_step_1") is None
    assert resolve_resume(tmp_path, "latest") == tmp_path / "global_step_1"


def test_saving_a_step_again_replaces_it_and_a_kill_in_between_keeps_the_old(tmp_path, monkeypatch):
    first = _save(tmp_path, 1)
    old_state = (first / "trainer_state.pt").read_bytes()
    second = save_checkpoint(tmp_path, 1, _Adapter(), {"optimizer": {"changed": 1}}, OmegaConf.create({"seed": 0}), 10)
    assert second == first and verify_checkpoint(second) is None
    assert (second / "trainer_state.pt").read_bytes() != old_state
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1"]

    # killed after the old one was moved aside, before the new one took its name
    (tmp_path / ".tmp-global_step_1-x").mkdir()
    os.replace(first, tmp_path / ".old-global_step_1")
    assert resolve_resume(tmp_path, "latest") == tmp_path / "global_step_1"
    assert verify_checkpoint(tmp_path / "global_step_1") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1"]


def test_keep_last_prunes_oldest(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["global_step_2", "global_step_3"]


def test_resolve_resume_choices(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    assert resolve_resume(root, "latest") is None and resolve_resume(root, "none") is None  # nothing yet
    first, second = _save(root, 1), _save(root, 2)
    assert resolve_resume(root, "latest") == second
    assert resolve_resume(root, str(first)) == first
    with pytest.raises(ResumeError, match=r"resume=none but run dir .*run holds checkpoints.*resume=overwrite.*run_name"):
        resolve_resume(root, "none")
    assert list_checkpoints(root) == [first, second]  # refused: untouched

    (second / "trainer_state.pt").write_bytes(b"x")
    with pytest.raises(ResumeError, match=r"not a usable checkpoint .trainer_state.pt \(optimizer, scheduler and RNG state\) does not match"):
        resolve_resume(root, str(second))
    with pytest.raises(ResumeError, match="no such dir"):
        resolve_resume(root, str(root / "global_step_9"))
    (first / "manifest.json").write_text("[]")
    with pytest.raises(ResumeError, match=r"every checkpoint in run dir .* is corrupt \(global_step_1, global_step_2\)"):
        resolve_resume(root, "latest")
    assert list_checkpoints(root) == [first, second]

    assert resolve_resume(root, "overwrite") is None
    assert list_checkpoints(root) == []


def test_rng_states_hold_every_generator():
    states = rng_states()
    assert {"python", "numpy", "torch"} <= set(states)
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the per-device CUDA states cannot be saved (CPU-only machine)")
    assert len(states["cuda"]) == torch.cuda.device_count()
    before = torch.rand(3, device="cuda")
    ckpt.restore_rng_states(states)
    assert torch.equal(torch.rand(3, device="cuda"), before)


def test_rng_states_include_cuda_when_available(monkeypatch):
    """On this CPU machine, with CUDA faked available: the states of every device are saved and restored."""
    saved = [torch.ByteTensor([1, 2]), torch.ByteTensor([3, 4])]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: saved)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    states = rng_states()
    assert states["cuda"] is saved
    ckpt.restore_rng_states(states)
    assert restored == [saved]


# -- through the CLI: refusals end with one line, before any model loads, touching nothing ---------------


def _rlexp(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "rlexp", f"hydra.run.dir={run_dir}", "eval.num_mazes=2", *overrides]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file of the run dir but Hydra's own (``.hydra/``, the job's ``.log``), written before any task runs,
    and the run dir's lock (``.lock``, taken before the resume is checked)."""
    files = (
        p for p in sorted(root.rglob("*"))
        if p.is_file() and ".hydra" not in p.parts and p.suffix != ".log" and p.name != ".lock"
    )
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


def test_cli_refuses_resume_none_over_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    _save(run_dir / "checkpoints", 1)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "train/loss": 0.5}\n')
    before = _snapshot(run_dir)
    result = _rlexp(run_dir, "resume=none")
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("rlexp: resume=none but run dir") and str(run_dir) in line
    assert "resume=overwrite" in line and "run_name" in line
    assert "Loading" not in result.stdout and "model" not in result.stdout.lower()
    assert _snapshot(run_dir) == before  # not a byte changed, no tracker started


def test_cli_refuses_when_every_checkpoint_is_corrupt(tmp_path):
    run_dir = tmp_path / "run"
    for step, manifest in ((1, b"{}"), (2, b"\xff\xfe")):
        _save(run_dir / "checkpoints", step)
        (run_dir / "checkpoints" / f"global_step_{step}" / "manifest.json").write_bytes(manifest)
    before = _snapshot(run_dir)
    result = _rlexp(run_dir)
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"rlexp: every checkpoint in run dir {run_dir} is corrupt (global_step_1, global_step_2)")
    assert "resume=overwrite" in line and "run_name" in line
    assert "global_step_2 is corrupt" in result.stdout  # each fallback was reported, with its reason
    assert _snapshot(run_dir) == before
