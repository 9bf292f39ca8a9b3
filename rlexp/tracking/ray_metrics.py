"""Training metrics on a Ray cluster's Prometheus endpoint, through Ray's own metrics API.

On Ray (``cluster.launcher=ray``) rank 0 adds this tracker to the run's others: each metric it logs
becomes a ``ray.util.metrics.Gauge`` named ``rlexp_<metric>`` (``eval/success_rate`` ->
``rlexp_eval_success_rate``; Prometheus adds Ray's ``ray_`` prefix), tagged with the run and the
experiment, beside Ray's own metrics on every node's metrics export port, where the cluster's
Prometheus (HyperPod's observability add-on) scrapes them. ``docs/grafana_rlexp.json`` charts them.
"""

import re
from typing import Any

#: the metrics the dashboard charts; every other numeric metric is exported too.
DASHBOARD_METRICS = (
    "step",
    "rollout/reward_mean",
    "rollout/success_rate",
    "eval/success_rate",
    "timing/generate_tokens_per_s",
    "timing/generate_s",
    "timing/train_s",
    "timing/sync_s",
    "system/gpu_peak_memory_gb",
)
TAG_KEYS = ("run", "experiment")


def gauge_name(metric: str) -> str:
    """``eval/success_rate`` -> ``rlexp_eval_success_rate`` (Prometheus names: letters, digits, ``_``)."""
    return "rlexp_" + re.sub(r"[^A-Za-z0-9_]", "_", metric)


class RayMetricsTracker:
    """Gauges of the latest value of each metric (and of ``step``), set by rank 0 inside a Ray job."""

    def __init__(self, run_name: str, experiment: str):
        self.tags = {"run": run_name, "experiment": experiment}
        self.gauges: dict[str, Any] = {}

    def _gauge(self, metric: str):
        if metric not in self.gauges:
            from ray.util.metrics import Gauge

            self.gauges[metric] = Gauge(gauge_name(metric), description=f"rlexp {metric}", tag_keys=TAG_KEYS)
        return self.gauges[metric]

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for metric, value in {"step": step, **metrics}.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._gauge(metric).set(float(value), tags=self.tags)

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        pass
