"""Atomic, verifiable checkpoints: ``<run_dir>/checkpoints/global_step_N/``.

Each is written to a temp dir and renamed into place, so a kill never leaves a half-written
``global_step_N``. ``manifest.json`` (written last) holds every file's SHA-256; a checkpoint whose
files do not match is skipped with a warning and the previous one is used.

Layout: ``policy/`` (the LoRA adapter, standard peft format), ``trainer_state.pt`` (optimizer,
scheduler, RNG states, step, maze-stream position), ``config.yaml`` (the resolved config).
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

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PREFIX = "global_step_"


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


def save_checkpoint(
    ckpt_root: Path, step: int, model, trainer_state: dict[str, Any], config: DictConfig, keep_last: int
) -> Path:
    """Write checkpoint ``step`` atomically, then prune to the newest ``keep_last``."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"{PREFIX}{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{PREFIX}{step}-", dir=ckpt_root))
    model.save_pretrained(tmp / "policy")
    torch.save({**trainer_state, "step": step, "rng": rng_states()}, tmp / "trainer_state.pt")
    (tmp / "config.yaml").write_text(OmegaConf.to_yaml(config, resolve=True))
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {"step": step, "files": {str(p.relative_to(tmp)): _sha256(p) for p in files}}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(ckpt_root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete-looking checkpoint dirs, oldest first (temp dirs are never listed)."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def verify_checkpoint(path: Path) -> str | None:
    """None if every file matches the manifest, else what is wrong."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "no manifest"
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError:
        return "unreadable manifest"
    for name, digest in manifest["files"].items():
        file = path / name
        if not file.is_file():
            return f"missing {name}"
        if _sha256(file) != digest:
            return f"{name} does not match its checksum"
    return None


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
    """The checkpoint to continue from, or None to start fresh.

    ``latest``: the newest checkpoint that verifies (a fresh start when there is none at all);
    ``none``: a fresh start, refused where checkpoints exist (they would be overwritten);
    ``overwrite``: a fresh start that deletes this run dir's checkpoints; anything else: a checkpoint path.
    """
    existing = list_checkpoints(ckpt_root)
    if resume == "overwrite":
        for path in existing:
            shutil.rmtree(path)
        return None
    if resume == "none":
        if existing:
            raise ResumeError(
                f"resume=none but {ckpt_root} holds checkpoints ({existing[-1].name} newest); starting fresh would "
                "overwrite them: use resume=latest to continue, resume=overwrite to discard them, or a new run_name"
            )
        return None
    if resume == "latest":
        found = latest_valid_checkpoint(ckpt_root)
        if found is None and existing:
            raise ResumeError(
                f"every checkpoint in {ckpt_root} is corrupt ({', '.join(p.name for p in existing)}); refusing to start "
                "over them: use resume=overwrite to discard them, or a new run_name"
            )
        return found
    path = Path(resume)
    if not (path / "trainer_state.pt").is_file():
        raise FileNotFoundError(f"resume={resume}: no trainer_state.pt there; give a global_step_N dir")
    return path
