"""``task=report``: compare runs from the MLflow store — a table of swept params and eval success, and
a PNG of eval success (with its 95% Wilson band) against step for every run."""

import logging
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from mlflow import MlflowClient  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from rlexp.tracking.mlflow_tracker import resolve_tracking_uri  # noqa: E402
from rlexp.runtime import run_dir_of  # noqa: E402

log = logging.getLogger(__name__)

SUCCESS = "eval/success_rate"
#: params that identify a run rather than describe what was swept.
NOT_SWEPT = {"run_name", "task", "resume", "checkpoint", "report.experiment", "report.sweep", "report.tracking_uri"}


@dataclass
class RunSummary:
    name: str
    status: str
    swept: dict[str, str]
    #: (step, success, ci_low, ci_high) of every eval, by step.
    curve: list[tuple[int, float, float, float]]
    turn_limit: float | None
    hours: float
    gpu_hours: float
    cost: float | None

    @property
    def final(self) -> tuple[int, float, float, float] | None:
        return self.curve[-1] if self.curve else None

    @property
    def best(self) -> float | None:
        return max(point[1] for point in self.curve) if self.curve else None


def report(cfg: DictConfig) -> None:
    experiment = cfg.report.experiment or cfg.name
    client = MlflowClient(resolve_tracking_uri(cfg.report.tracking_uri))
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise FileNotFoundError(f"no MLflow experiment named {experiment!r} in {client.tracking_uri}; set report.experiment")
    query = f"tags.sweep = '{cfg.report.sweep}'" if cfg.report.sweep else ""
    runs = client.search_runs([found.experiment_id], filter_string=query, order_by=["attributes.start_time ASC"])
    if not runs:
        raise FileNotFoundError(f"no runs in experiment {experiment!r}" + (f" with sweep {cfg.report.sweep!r}" if query else ""))
    swept_keys = _swept_keys([run.data.params for run in runs])
    summaries = [_summarize(client, run, swept_keys) for run in runs]
    out_dir = run_dir_of(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = format_table(summaries, swept_keys)
    (out_dir / "report.md").write_text(table + "\n")
    plot = plot_success(summaries, out_dir / "report.png", title=f"{experiment}" + (f" · {cfg.report.sweep}" if cfg.report.sweep else ""))
    print(table)
    log.info("report of %d runs: %s and %s", len(summaries), out_dir / "report.md", plot)


def _swept_keys(params: list[dict[str, str]]) -> list[str]:
    keys = sorted({k for p in params for k in p} - NOT_SWEPT)
    return [k for k in keys if len({p.get(k) for p in params}) > 1]


def _summarize(client: MlflowClient, run, swept_keys: list[str]) -> RunSummary:
    history = {name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
               for name in (SUCCESS, "eval/success_ci_low", "eval/success_ci_high")}
    curve = [
        (step, value, history["eval/success_ci_low"].get(step, value), history["eval/success_ci_high"].get(step, value))
        for step, value in sorted(history[SUCCESS].items())
    ]
    params = run.data.params
    end = run.info.end_time or run.info.start_time
    hours = max(0.0, (end - run.info.start_time) / 3.6e6)
    nodes = float(params.get("cluster.nodes", 1))
    gpus = nodes * float(params.get("cluster.gpus_per_node", 0))
    price = params.get("cluster.price_per_hour")
    cost = hours * nodes * float(price) if price not in (None, "None", "null") else None
    turn_limit = run.data.metrics.get("eval/turn_limit")
    return RunSummary(
        name=run.info.run_name, status=run.info.status, swept={k: params.get(k, "") for k in swept_keys},
        curve=curve, turn_limit=turn_limit, hours=hours, gpu_hours=hours * gpus, cost=cost,
    )


def format_table(summaries: list[RunSummary], swept_keys: list[str]) -> str:
    """A Markdown table: run, swept params, final success with its interval, best, GPU-hours and cost."""
    show_cost = any(s.cost is not None for s in summaries)
    header = ["run", *swept_keys, "status", "final success [95% CI]", "best", "turns", "GPU-h"] + (["cost $"] if show_cost else [])
    rows = []
    for s in summaries:
        final = s.final
        final_text = f"{final[1]:.1%} [{final[2]:.1%}, {final[3]:.1%}] @ step {final[0]}" if final else "no eval"
        best = f"{s.best:.1%}" if s.best is not None else "-"
        turns = f"≤{s.turn_limit:.0f}" if s.turn_limit is not None else "-"
        row = [s.name, *(s.swept[k] for k in swept_keys), s.status, final_text, best, turns, f"{s.gpu_hours:.2f}"]
        rows.append(row + ([f"{s.cost:.2f}" if s.cost is not None else "-"] if show_cost else []))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def plot_success(summaries: list[RunSummary], path: Path, title: str) -> Path:
    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=120)
    for s in summaries:
        if not s.curve:
            continue
        steps, success, low, high = zip(*s.curve)
        label = s.name + (" (" + ", ".join(f"{k.split('.')[-1]}={v}" for k, v in s.swept.items()) + ")" if s.swept else "")
        (line,) = axes.plot(steps, success, marker="o", label=label)
        axes.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
    axes.set_xlabel("training step")
    axes.set_ylabel("eval success on the pinned mazes")
    axes.set_ylim(-0.02, 1.02)
    axes.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    axes.set_title(f"{title}: success (shaded: 95% Wilson interval)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="best")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path
