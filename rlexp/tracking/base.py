"""The tracker interface, the always-on JSON-lines record, and the fan-out to configured trackers."""

import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Literal, Protocol

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from rlexp.tracking.secrets import redact

log = logging.getLogger(__name__)

#: how a run ended; KILLED: preempted (SIGTERM/SIGINT) after checkpointing, to be resumed.
Status = Literal["FINISHED", "FAILED", "KILLED"]

#: config groups whose chosen option becomes a ``choice.<group>`` tag.
TAGGED_CHOICES = ("model", "cluster", "env", "algorithm", "rollout", "experiment")


class Tracker(Protocol):
    """What every tracker implements. Implementations are built by ``build_trackers`` with
    ``run_dir`` and ``run_info`` (see ``run_info``) plus the options of their ``logger`` entry."""

    def log_params(self, params: dict[str, Any]) -> None:
        """The flattened config (``{"algorithm.lr": 1e-5, …}``), once per run (again on resume)."""

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """A file; ``artifact_path`` is the folder it goes under, by default its folder relative to the
        run dir (``eval/step_000002``). PNG and GIF files are shown as images where the tracker can."""

    def finish(self, status: Status = "FINISHED") -> None:
        """Always called, from a ``finally``."""

    # Optional: ``resume_from(step: int) -> None``, called once before the first metric of a process
    # (see ``Trackers.resume_from``). A tracker without it receives the recomputed steps again.


class JsonlTracker:
    """``metrics.jsonl`` (one line per log call), ``params.json``, ``tags.json`` and ``status`` in the run dir."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"

    def log_params(self, params: dict[str, Any]) -> None:
        (self.run_dir / "params.json").write_text(json.dumps(params, indent=2, default=str) + "\n")

    def set_tags(self, tags: dict[str, str]) -> None:
        """Added to those already set (a later ``checkpoint`` tag does not drop the run's ``choice.*``)."""
        path = self.run_dir / "tags.json"
        try:
            existing = json.loads(path.read_text()) if path.is_file() else {}
        except json.JSONDecodeError:
            existing = {}
        path.write_text(json.dumps({**existing, **tags}, indent=2) + "\n")

    def resume_from(self, step: int) -> None:
        """Keep only the lines logged before checkpoint ``step`` was saved (steps ``<= step``; none at a
        fresh start, ``step`` 0, whose step-0 eval runs again): the resumed run logs the later steps
        again, so the file holds each step once, with the resumed run's values. A line torn by a kill
        is dropped too."""
        if not self.metrics_path.is_file():
            return
        lines = self.metrics_path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if step > 0 and _logged_step(line) is not None and _logged_step(line) <= step]
        if len(kept) != len(lines):
            log.info("metrics.jsonl: dropping %d lines logged after step %d, which this run logs again", len(lines) - len(kept), step)
            tmp = self.metrics_path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, self.metrics_path)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Artifacts already live in the run dir."""

    def finish(self, status: Status = "FINISHED") -> None:
        (self.run_dir / "status").write_text(status + "\n")


class Trackers:
    """Sends every call to each tracker. A tracker that raises is reported and skipped for that call, so
    that a tracking problem never ends a training run. Params and tags go out with secrets redacted
    (``rlexp.tracking.secrets``)."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def add(self, tracker: Tracker) -> None:
        """One more tracker, from now on (it gets no earlier calls)."""
        self.trackers.append(tracker)

    def _each(self, method: str, *args) -> None:
        for tracker in self.trackers:
            self._call(tracker, method, *args)

    @staticmethod
    def _call(tracker, method: str, *args) -> None:
        try:
            getattr(tracker, method)(*args)
        except Exception:
            log.warning("%s.%s failed; continuing without it", type(tracker).__name__, method, exc_info=True)

    def log_params(self, params: dict[str, Any]) -> None:
        self._each("log_params", redact(params))

    def set_tags(self, tags: dict[str, str]) -> None:
        self._each("set_tags", redact(tags))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._each("log_metrics", metrics, step)

    def resume_from(self, step: int) -> None:
        """The run continues from its checkpoint at ``step`` (0: starts fresh), so every step after it
        (at a fresh start, step 0 too) is computed and logged again; each tracker that has
        ``resume_from`` makes sure it keeps each step once (how is each one's choice: see theirs)."""
        for tracker in self.trackers:
            if hasattr(tracker, "resume_from"):
                self._call(tracker, "resume_from", step)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self._each("log_artifact", Path(path), artifact_path)

    def finish(self, status: Status = "FINISHED") -> None:
        self._each("finish", status)


def _logged_step(line: str) -> int | None:
    """The step of one metrics.jsonl line; None for a blank or torn one."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record.get("step") if isinstance(record, dict) and isinstance(record.get("step"), int) else None


#: what the trackers keep in a run dir about its run (``resume=overwrite`` discards them).
RECORDS = ("metrics.jsonl", "params.json", "tags.json", "status", "tracking")


def discard_records(run_dir: Path) -> None:
    """Forget a run dir's tracked run, for a fresh start over it (``resume=overwrite``): metrics.jsonl
    and the trackers' state (``tracking/``: run ids, the MLflow journal) go, so MLflow and W&B start new
    runs instead of mixing two runs' steps in one. The old tracked runs stay on their servers as they
    are; journal entries never sent to them are discarded with the rest."""
    run_dir = Path(run_dir)
    found = [run_dir / name for name in RECORDS if (run_dir / name).exists()]
    if found:
        log.warning("resume=overwrite: discarding the old run's records in %s: %s", run_dir, ", ".join(p.name for p in found))
    for path in found:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def build_trackers(logger_cfg: DictConfig, run_dir: Path, config: DictConfig) -> Trackers:
    """The JSON-lines record plus every tracker in the ``logger`` group, built from its ``_target_``;
    then the resolved config as params and the run's tags (see ``run_info``) go to all of them."""
    run_dir = Path(run_dir)
    info = run_info(run_dir, config)
    trackers: list[Tracker] = [JsonlTracker(run_dir)]
    for spec in (logger_cfg or {}).values():
        if spec is None:  # a tracker the ``logger`` group did not select
            continue
        trackers.append(instantiate(spec, run_dir=str(run_dir), run_info=info, _convert_="all"))
    result = Trackers(trackers)
    result.log_params(flatten(OmegaConf.to_container(config, resolve=True, enum_to_str=True)))
    result.set_tags(info["tags"])
    return result


def run_info(run_dir: Path, config: DictConfig) -> dict[str, Any]:
    """What trackers name and group runs by.

    ``run_name`` (the run dir's name, after the sweep's in a multirun), ``experiment`` (``cfg.name``), ``group`` (a multirun's sweep dir
    name, else None) and ``tags``: ``choice.<group>`` for the chosen model/cluster/env/algorithm/rollout/
    experiment options, ``git_commit`` and ``sweep`` where known. Outside a Hydra app there are no choices
    and no group, and the experiment falls back to the run dir's parent's name.
    """
    run_dir = Path(run_dir)
    group, tags = None, {}
    if HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode == RunMode.MULTIRUN:
            group = Path(hydra_cfg.sweep.dir).name
        choices = hydra_cfg.runtime.choices
        tags = {f"choice.{g}": str(choices[g]) for g in TAGGED_CHOICES if choices.get(g) is not None}
    if commit := git_commit():
        tags["git_commit"] = commit
    if group:
        tags["sweep"] = group
    experiment = OmegaConf.select(config, "name", default=None, throw_on_resolution_failure=False)
    # a multirun's job dirs are numbered; prefix the sweep so that names stay unique across sweeps
    run_name = f"{group}/{run_dir.name}" if group else run_dir.name
    return {"run_name": run_name, "experiment": experiment or run_dir.parent.name, "group": group, "tags": tags}


#: the commit of the checkout that submitted this process's code, where that code is a copy without ``.git``
#: (a Ray job's working dir): set by ``rlexp.cluster.ray_jobs`` in the job's environment.
GIT_COMMIT_ENV = "RLEXP_GIT_COMMIT"


def git_commit() -> str | None:
    """The submitting checkout's commit (``$RLEXP_GIT_COMMIT``), else HEAD of the repository this package is
    imported from, or None (not a checkout, no git)."""
    if commit := os.environ.get(GIT_COMMIT_ENV):
        return commit
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None


def default_artifact_path(path: Path, run_dir: Path) -> str | None:
    """The folder of ``path`` relative to the run dir (``eval/step_000002``); None at its top or outside it."""
    try:
        folder = Path(path).resolve().parent.relative_to(Path(run_dir).resolve())
    except ValueError:
        return None
    return folder.as_posix() if folder.parts else None


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}{key}."))
    return flat
