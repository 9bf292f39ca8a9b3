"""Atomic, verifiable checkpoints: ``<run_dir>/checkpoints/global_step_N/``.

Each is written to a temp dir and renamed into place, so a kill never leaves a half-written
``global_step_N``. ``manifest.json`` (written last) holds every file's SHA-256; a checkpoint whose
files do not match is skipped with a warning and the previous one is used.

Layout: ``policy/`` (the LoRA adapter, standard peft format), ``trainer_state.pt`` (optimizer,
scheduler, RNG states, step, maze-stream position), ``config.yaml`` (the resolved config, secrets redacted).

A save that dies leaves a ``.tmp-global_step_N-*`` dir; it is never listed as a checkpoint and is removed
at the next save and when a run starts (``resolve_resume``). A save that fails (a full disk) removes its
temp dir at once and raises ``CheckpointSaveError`` naming the path and the free space; the checkpoints
already there are untouched. Saving a step that already has a checkpoint moves the old one aside
(``.old-global_step_N``) before the new one takes its name, so a kill in between leaves one of the two,
and the next start puts the old one back.
"""

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from rlexp.tracking.secrets import redact

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PREFIX = "global_step_"
TMP_PREFIX = f".tmp-{PREFIX}"
OLD_PREFIX = f".old-{PREFIX}"
#: files every checkpoint has, and what they hold; a manifest that does not list them describes no usable checkpoint.
REQUIRED_FILES = {
    "trainer_state.pt": "optimizer, scheduler and RNG state",
    "policy/adapter_model.safetensors": "LoRA weights",
    "policy/adapter_config.json": "LoRA config",
}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def rng_states() -> dict[str, Any]:
    """Every generator a step draws from: Python, NumPy, torch's CPU and each CUDA device's."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class CheckpointSaveError(OSError):
    """A checkpoint could not be written (a full disk, say); the message names the path and the free space."""

    def __str__(self) -> str:
        return self.strerror


def save_checkpoint(
    ckpt_root: Path, step: int, model, trainer_state: dict[str, Any], config: DictConfig, keep_last: int
) -> Path:
    """Write checkpoint ``step`` atomically, then prune to the newest ``keep_last``."""
    return finish_checkpoint(begin_checkpoint(ckpt_root, step), ckpt_root, step, model, trainer_state, config, keep_last)


def begin_checkpoint(ckpt_root: Path, step: int) -> Path:
    """The temp dir checkpoint ``step`` is written into (every rank writes its shards there)."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    remove_temp_dirs(ckpt_root)
    return Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{step}-", dir=ckpt_root))


def finish_checkpoint(
    tmp: Path, ckpt_root: Path, step: int, model, trainer_state: dict[str, Any], config: DictConfig, keep_last: int,
    adapter: dict[str, torch.Tensor] | None = None,
) -> Path:
    """The policy (``adapter``: its consolidated state, where the model is sharded), trainer state, config
    and manifest into ``tmp``, then ``tmp`` renamed into place and older checkpoints pruned."""
    final = ckpt_root / f"{PREFIX}{step}"
    try:
        if adapter is None:
            model.save_pretrained(tmp / "policy")
        else:
            model.save_pretrained(tmp / "policy", state_dict=adapter)
        torch.save({**trainer_state, "step": step, "rng": rng_states()}, tmp / "trainer_state.pt")
        (tmp / "config.yaml").write_text(OmegaConf.to_yaml(redact(OmegaConf.to_container(config, resolve=True, enum_to_str=True))))
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {"step": step, "files": {str(p.relative_to(tmp)): _sha256(p) for p in files}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _fsync_tree(tmp)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(ckpt_root).free
        previous = list_checkpoints(ckpt_root)
        raise CheckpointSaveError(
            error.errno, f"saving checkpoint {final} failed ({error.strerror or error}); {free / 2**20:.1f} MiB free on "
            f"{ckpt_root}; nothing of it was kept, and {previous[-1].name if previous else 'no earlier checkpoint'} is intact"
        ) from error
    aside = ckpt_root / f"{OLD_PREFIX}{step}"
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)
    for old in list_checkpoints(ckpt_root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def remove_temp_dirs(ckpt_root: Path) -> list[Path]:
    """Delete what saves that died left behind (``.tmp-global_step_*``), and put back a checkpoint that a
    re-save had moved aside (``.old-global_step_N``) when the new one never took its place; the dirs removed."""
    if not ckpt_root.is_dir():
        return []
    for aside in [p for p in ckpt_root.iterdir() if p.name.startswith(OLD_PREFIX)]:
        final = ckpt_root / aside.name[len(".old-"):]
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            log.info("restoring %s, moved aside by a save of the same step that did not finish", final)
            os.replace(aside, final)
    leftovers = [p for p in ckpt_root.iterdir() if p.name.startswith(TMP_PREFIX)]
    for path in leftovers:
        log.info("removing %s, left by a checkpoint save that did not finish", path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return leftovers


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete-looking checkpoint dirs, oldest first (temp dirs are never listed)."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and _is_step(p.name[len(PREFIX):])]
    return sorted(found, key=_step_of)


def verify_checkpoint(path: Path) -> str | None:
    """None if the manifest is well formed, lists every required file and every file matches its
    checksum; else what is wrong, in a few words (never raises on a damaged checkpoint)."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "no manifest"
    try:
        manifest = json.loads(manifest_path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        return "manifest is not UTF-8 text"
    except (json.JSONDecodeError, RecursionError):
        return "manifest is not valid JSON"
    except OSError as error:
        return f"manifest unreadable ({error.strerror or error})"
    if not isinstance(manifest, dict):
        return f"manifest is a JSON {type(manifest).__name__}, not an object"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "manifest lists no files"
    if not all(isinstance(name, str) and isinstance(digest, str) for name, digest in files.items()):
        return "manifest file entries are not name: checksum strings"
    step = manifest.get("step")
    if path.name.startswith(PREFIX) and step != _step_of(path):
        return f"manifest is for step {step!r}, not {_step_of(path)}"
    if missing := [name for name in REQUIRED_FILES if name not in files]:
        return f"manifest does not list {', '.join(missing)}"
    root = path.resolve()
    for name, digest in files.items():
        file = path / name
        if not file.resolve().is_relative_to(root):
            return f"manifest names {name}, outside the checkpoint"
        what = f" ({REQUIRED_FILES[name]})" if name in REQUIRED_FILES else ""
        if not file.is_file():
            return f"missing {name}{what}"
        if _sha256(file) != digest:
            return f"{name}{what} does not match its checksum"
    return None


def _is_step(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _step_of(path: Path) -> int:
    return int(path.name[len(PREFIX):])


def latest_valid_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest checkpoint that verifies; broken newer ones are reported and skipped."""
    for path in reversed(list_checkpoints(ckpt_root)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        log.warning("checkpoint %s is corrupt (%s); falling back to the previous one", path, problem)
    return None


def load_trainer_state(path: Path) -> dict[str, Any]:
    return torch.load(path / "trainer_state.pt", weights_only=False)


class ResumeError(RuntimeError):
    """Resuming would lose or overwrite work; the message names the run dir and the ways on."""


def resolve_resume(ckpt_root: Path, resume: str) -> Path | None:
    """The checkpoint to continue from, or None to start fresh. Removes leftovers of failed saves first.

    ``latest``: the newest checkpoint that verifies (a fresh start when there is none at all), refused
    when checkpoints exist but none verifies; ``none``: a fresh start, refused where checkpoints exist
    (they would be overwritten); ``overwrite``: a fresh start that deletes this run dir's checkpoints;
    anything else: the path of a checkpoint, which must verify. Refusals raise ``ResumeError`` before
    anything in the run dir is changed.
    """
    remove_temp_dirs(ckpt_root)
    existing = list_checkpoints(ckpt_root)
    run_dir = ckpt_root.parent
    if resume == "overwrite":
        for path in existing:
            shutil.rmtree(path)
        if existing:
            log.warning("resume=overwrite: deleted %d checkpoints of %s; starting fresh", len(existing), run_dir)
        return None
    if resume == "none":
        if existing:
            raise ResumeError(
                f"resume=none but run dir {run_dir} holds checkpoints ({existing[-1].name} newest); starting fresh "
                "would overwrite them: use resume=latest to continue, resume=overwrite to discard them, or a new run_name"
            )
        return None
    if resume == "latest":
        found = latest_valid_checkpoint(ckpt_root)
        if found is None and existing:
            raise ResumeError(
                f"every checkpoint in run dir {run_dir} is corrupt ({', '.join(p.name for p in existing)}); refusing "
                "to start over them: use resume=overwrite to discard them, or a new run_name"
            )
        return found
    path = Path(resume)
    problem = verify_checkpoint(path) if path.is_dir() else "no such dir"
    if problem is not None:
        raise ResumeError(f"resume={resume}: not a usable checkpoint ({problem}); give a {PREFIX}N dir, or resume=latest")
    return path
