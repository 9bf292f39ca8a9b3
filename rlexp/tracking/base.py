"""The tracker interface, the always-on JSON-lines record, and the fan-out to configured trackers."""

import json
import time
from pathlib import Path
from typing import Any, Protocol

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf


class Tracker(Protocol):
    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifact(self, path: Path) -> None: ...

    def finish(self, status: str = "FINISHED") -> None:
        """``FINISHED`` or ``FAILED``; always called, from a ``finally``."""


class JsonlTracker:
    """``metrics.jsonl`` (one line per log call) and ``params.json`` in the run dir."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"

    def log_params(self, params: dict[str, Any]) -> None:
        (self.run_dir / "params.json").write_text(json.dumps(params, indent=2, default=str) + "\n")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def log_artifact(self, path: Path) -> None:
        """Artifacts already live in the run dir."""

    def finish(self, status: str = "FINISHED") -> None:
        (self.run_dir / "status").write_text(status + "\n")


class Trackers:
    """Sends every call to each tracker."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log_params(self, params: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log_params(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.log_metrics(metrics, step)

    def log_artifact(self, path: Path) -> None:
        for tracker in self.trackers:
            tracker.log_artifact(path)

    def finish(self, status: str = "FINISHED") -> None:
        for tracker in self.trackers:
            tracker.finish(status)


def build_trackers(logger_cfg: DictConfig, run_dir: Path, config: DictConfig) -> Trackers:
    """The JSON-lines record plus every tracker in the ``logger`` group, built from its ``_target_``."""
    trackers: list[Tracker] = [JsonlTracker(run_dir)]
    for spec in (logger_cfg or {}).values():
        trackers.append(instantiate(spec, run_dir=str(run_dir), _convert_="all"))
    result = Trackers(trackers)
    result.log_params(flatten(OmegaConf.to_container(config, resolve=True, enum_to_str=True)))
    return result


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}{key}."))
    return flat
