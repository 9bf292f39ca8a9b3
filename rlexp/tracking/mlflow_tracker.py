"""MLflow tracking that a server outage neither crashes, stalls nor loses data from.

Every call is first appended to a journal in the run dir, ``tracking/mlflow_pending.jsonl``, then the
journal is sent in order. ``tracking/mlflow.json`` beside it holds the store, the MLflow run id and
``sent``, the sequence number of the last entry the store has. When the store does not answer, the
entries wait: the next try comes after ``retry_interval_s``, doubling up to a minute, so a training
step pays at most one short HTTP timeout per try (MLflow's own retries are off for our calls).
``finish`` tries for at most ``flush_timeout_s`` and leaves the rest in the journal; the next process
with this run dir (``resume=latest``) sends it first and continues the same MLflow run.

Replaying is idempotent, so an entry sent twice (its answer lost) is stored once: metrics carry their
own step and timestamp and MLflow drops exact duplicates, params and tags are set to the same values,
artifacts overwrite themselves, and a run whose creation answer was lost is found by its start id tag.

A resumed run logs the steps after its checkpoint again; ``resume_from`` keeps MLflow at one value per
metric and step (see there).
"""

import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH

from rlexp.tracking.base import Status, default_artifact_path
from rlexp.tracking.secrets import redact

log = logging.getLogger(__name__)

#: tag that finds a run again when the answer to its creation was lost.
START_ID_TAG = "rlexp.start_id"
#: longest wait between tries while the store does not answer.
MAX_RETRY_INTERVAL_S = 60.0


class MlflowTracker:
    def __init__(
        self,
        run_dir: str | Path,
        run_info: dict[str, Any],
        tracking_uri: str | None = None,
        experiment_name: str | None = None,
        artifact_location: str | None = None,
        tags: dict[str, str] | None = None,
        flush_timeout_s: float = 30.0,
        http_timeout_s: int = 5,
        retry_interval_s: float = 5.0,
    ):
        """``tracking_uri``: else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<abs outputs/>/mlflow.db``.
        ``artifact_location`` is used only when this creates the experiment; for a sqlite store it
        defaults to ``mlartifacts/`` beside the database. ``tags`` are added to the run's tags."""
        self.run_dir = Path(run_dir)
        self.run_name = run_info.get("run_name") or self.run_dir.name
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self.experiment_name = experiment_name or run_info.get("experiment") or "rlexp"
        self.artifact_location = artifact_location or artifacts_beside(self.tracking_uri)
        self.flush_timeout_s, self.http_timeout_s, self.retry_interval_s = flush_timeout_s, http_timeout_s, retry_interval_s
        self.client = MlflowClient(self.tracking_uri)

        state_dir = self.run_dir / "tracking"
        state_dir.mkdir(parents=True, exist_ok=True)
        self.state_path, self.journal_path = state_dir / "mlflow.json", state_dir / "mlflow_pending.jsonl"
        state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        self.run_id: str | None = state.get("run_id")
        if self.run_id and state.get("tracking_uri") != self.tracking_uri:
            log.warning(
                "MLflow run %s of this run dir is on %s; starting a new run on %s",
                self.run_id, state.get("tracking_uri"), self.tracking_uri,
            )
            self.run_id = None
        self.sent: int = state.get("sent", 0)
        self.pending, self.next_seq, journaled = self._read_journal()
        if self.run_id is None and state.get("run_id"):  # a new run on another store gets what is pending only
            journaled = _metric_values(self.pending)
        #: (metric, step) -> value of what earlier processes of this run dir logged; see ``resume_from``.
        self._journaled: dict[tuple[str, int], float] = journaled
        self._skip: dict[tuple[str, int], float] = {}
        self._differing: list[str] = []
        self._failures, self._retry_at, self._refused = 0, 0.0, False

        self._append({"op": "start", "start_id": uuid.uuid4().hex, "time": _now_ms()})
        if tags:
            self.set_tags(redact(tags))
        self._flush()

    # -- the Tracker interface: journal, then send ----------------------------------------------------

    def log_params(self, params: dict[str, Any]) -> None:
        values = {sanitize_name(k): _truncate(str(v), MAX_PARAM_VAL_LENGTH) for k, v in params.items()}
        self._record({"op": "params", "params": values})

    def set_tags(self, tags: dict[str, str]) -> None:
        tags = {sanitize_name(k): _truncate(str(v), MAX_TAG_VAL_LENGTH) for k, v in tags.items()}
        if "git_commit" in tags:
            tags["mlflow.source.git.commit"] = tags["git_commit"]  # shown by the MLflow UI
        self._record({"op": "tags", "tags": tags})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        values = {sanitize_name(k): float(v) for k, v in metrics.items()}
        if self._skip:
            values = {k: v for k, v in values.items() if not self._already_logged(k, int(step), v)}
            if not values:
                return
        self._record({"op": "metrics", "step": int(step), "time": _now_ms(), "metrics": values})

    def resume_from(self, step: int) -> None:
        """The run continues after checkpoint ``step`` and logs the later steps again; MLflow must keep
        each (metric, step) once.

        MLflow cannot delete logged points (there is no API for it), and it keeps every distinct (value,
        timestamp) of a step, so sending a recomputed step again stores it twice. Starting a new MLflow
        run per resume would split one run's history. So this tracker does not send again what the run
        already has: every metric of an earlier process of this run dir is in the journal (sent, or
        pending and sent first), and a metric at a step the journal already holds is skipped. This is
        per metric, not per step, so a step that a kill cut short is completed by the resumed run.

        The points kept are the first process's. A resume is deterministic (RNG states, maze stream and
        optimizer are restored), so ``train/*``, ``rollout/*`` and ``eval/*`` are recomputed bit-identical
        and nothing is lost; wall-clock ``timing/*`` values differ and keep the first ones, while
        ``metrics.jsonl`` holds the resumed run's. Where a non-timing value differs (a resume with a
        changed config, non-deterministic GPU kernels), a warning says that MLflow keeps the first.
        """
        self._skip = dict(self._journaled)  # steps up to ``step`` are not logged again anyway
        if self._skip:
            steps = sorted({s for _, s in self._skip})
            log.info("MLflow run %s already has steps %s; they are not sent again", self.run_id, _span(steps))

    def _already_logged(self, key: str, step: int, value: float) -> bool:
        first = self._skip.pop((key, step), None)
        if first is None:
            return False
        if first != value and not (first != first and value != value) and not key.startswith("timing/"):
            if not self._differing:
                log.warning(
                    "MLflow keeps the first value logged of %s at step %d (%g), not this run's %g: the resumed run "
                    "computes it differently (changed config?); metrics.jsonl has this run's", key, step, first, value,
                )
            self._differing.append(key)
        return True

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        path = Path(path).resolve()
        if artifact_path is None:
            artifact_path = default_artifact_path(path, self.run_dir)
        self._record({"op": "artifact", "path": str(path), "artifact_path": artifact_path})

    def finish(self, status: Status = "FINISHED") -> None:
        """Ends the run as FINISHED, FAILED or KILLED, waiting at most ``flush_timeout_s`` for the store."""
        self._append({"op": "status", "status": status, "time": _now_ms()})
        deadline = time.monotonic() + self.flush_timeout_s
        while not self._flush(force=True) and not self._refused and time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        if self.pending:
            log.warning(
                "MLflow: %d entries not sent to %s; they stay in %s and are sent when this run dir is used again",
                len(self.pending), self.tracking_uri, self.journal_path,
            )

    # -- journal ---------------------------------------------------------------------------------------

    def _read_journal(self) -> tuple[list[dict], int, dict[tuple[str, int], float]]:
        """Unsent entries of earlier processes with this run dir, the next sequence number, and every
        metric the journal holds, by (name, step)."""
        if not self.journal_path.exists():
            return [], 1, {}
        text = self.journal_path.read_text()
        if text and not text.endswith("\n"):  # a crash mid-line: keep the next entry on its own line
            with self.journal_path.open("a") as f:
                f.write("\n")
        entries = []
        for line in text.splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("MLflow journal %s: skipping a torn line", self.journal_path)
        last = max((e["seq"] for e in entries), default=0)
        return [e for e in entries if e["seq"] > self.sent], last + 1, _metric_values(entries)

    def _append(self, entry: dict) -> None:
        entry = {"seq": self.next_seq, **entry}
        self.next_seq += 1
        with self.journal_path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        self.pending.append(entry)

    def _record(self, entry: dict) -> None:
        self._append(entry)
        self._flush()

    def _save_state(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"tracking_uri": self.tracking_uri, "run_id": self.run_id, "sent": self.sent}) + "\n")
        os.replace(tmp, self.state_path)

    # -- sending ---------------------------------------------------------------------------------------

    def _flush(self, force: bool = False) -> bool:
        """Send pending entries in order; True when none are left. Unless ``force``d, does nothing while
        waiting to retry after a failure."""
        if self._refused or (not force and time.monotonic() < self._retry_at):
            return not self.pending
        with _short_http_requests(self.http_timeout_s):
            while self.pending:
                batch = self._next_batch()
                try:
                    self._send(batch)
                except Exception as error:
                    if _worth_retrying(error):
                        self._wait_after(error)
                        return False
                    if batch[0]["op"] == "start":
                        self._refused = True
                        log.error("MLflow refused the run (%s); nothing more is sent, %s keeps it all",
                                  error, self.journal_path)
                        return False
                    log.warning("MLflow rejected journal entry %d (%s): %s; skipped", batch[0]["seq"], batch[0]["op"], error)
                if self._failures:
                    log.info("MLflow at %s answers again; sending %d journal entries", self.tracking_uri, len(self.pending))
                    self._failures = 0
                del self.pending[: len(batch)]
                self.sent = batch[-1]["seq"]
                self._save_state()
        return True

    def _wait_after(self, error: Exception) -> None:
        self._failures += 1
        wait = min(self.retry_interval_s * 2 ** (self._failures - 1), MAX_RETRY_INTERVAL_S)
        self._retry_at = time.monotonic() + wait
        report = log.warning if self._failures == 1 else log.debug
        report("MLflow at %s unreachable (%s); %d entries wait in %s, next try in %.1f s",
               self.tracking_uri, _first_line(error), len(self.pending), self.journal_path, wait)

    def _next_batch(self) -> list[dict]:
        """The first pending entry; a metrics entry with the metrics entries right after it (one request)."""
        batch = self.pending[:1]
        if batch[0]["op"] == "metrics":
            count = len(batch[0]["metrics"])
            for entry in self.pending[1:]:
                count += len(entry.get("metrics", ()))
                if entry["op"] != "metrics" or count > MAX_METRICS_PER_BATCH:
                    break
                batch.append(entry)
        return batch

    def _send(self, batch: list[dict]) -> None:
        entry = batch[0]
        match entry["op"]:
            case "start":
                self._start(entry)
            case "metrics":
                metrics = [Metric(k, v, e["time"], e["step"]) for e in batch for k, v in e["metrics"].items()]
                self.client.log_batch(self.run_id, metrics=metrics)
            case "params":
                self._log_params(entry["params"])
            case "tags":
                self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in entry["tags"].items()])
            case "artifact":
                self.client.log_artifact(self.run_id, entry["path"], entry["artifact_path"])
            case "status":
                self.client.set_terminated(self.run_id, entry["status"], end_time=entry["time"])

    def _start(self, entry: dict) -> None:
        """Continue this run dir's MLflow run (status back to RUNNING), or create one."""
        if self.run_id:
            try:
                self.client.update_run(self.run_id, status="RUNNING")
                return
            except MlflowException as error:
                if _worth_retrying(error):
                    raise
                log.warning("MLflow run %s cannot be continued (%s); starting a new one", self.run_id, _first_line(error))
        experiment_id = self._experiment_id()
        found = self.client.search_runs([experiment_id], f"tags.`{START_ID_TAG}` = '{entry['start_id']}'", max_results=1)
        run = found[0] if found else self.client.create_run(
            experiment_id, start_time=entry["time"], tags={START_ID_TAG: entry["start_id"]}, run_name=self.run_name
        )
        self.run_id = run.info.run_id
        self._save_state()
        log.info("MLflow run %s in experiment %s at %s", self.run_id, self.experiment_name, self.tracking_uri)

    def _experiment_id(self) -> str:
        experiment = self.client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self.client.create_experiment(self.experiment_name, artifact_location=self.artifact_location)
        except MlflowException:
            experiment = self.client.get_experiment_by_name(self.experiment_name)  # a parallel job made it
            if experiment is None:
                raise
            return experiment.experiment_id

    def _log_params(self, params: dict[str, str]) -> None:
        """MLflow keeps a param's first value: on resume, send only new ones and report changed ones."""
        existing = self.client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
        if changed:
            log.warning("MLflow keeps the first value of params changed since this run started: %s", ", ".join(changed))
        self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items() if k not in existing])


def resolve_tracking_uri(tracking_uri: str | None = None) -> str:
    """``tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else a sqlite store at the root of all run dirs
    (Hydra does not chdir, so the cwd's ``outputs/``)."""
    if tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"):
        return tracking_uri or os.environ["MLFLOW_TRACKING_URI"]
    outputs = Path("outputs").resolve()
    outputs.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{outputs / 'mlflow.db'}"


def artifacts_beside(tracking_uri: str) -> str | None:
    """``mlartifacts/`` next to a sqlite database; None (the server's choice) for other stores."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    return str(Path(tracking_uri[len(prefix):]).resolve().parent / "mlartifacts")


def sanitize_name(name: str) -> str:
    """A metric, param or tag name MLflow accepts, keeping ``/`` namespaces: ``eval/success@1`` ->
    ``eval/success_at_1``, ``timing/gen(s)`` -> ``timing/gen_s``; no empty, ``.`` or ``..`` path parts."""
    parts = []
    for part in name.replace("@", "_at_").split("/"):
        part = re.sub(r"[^\w\-. :]+", "_", re.sub(r"[^\w\-. :]+$", "", part)).strip()
        if part not in ("", ".", ".."):
            parts.append(part)
    return "/".join(parts)[:MAX_ENTITY_KEY_LENGTH] or "_"


def _truncate(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."


def _worth_retrying(error: Exception) -> bool:
    """True for failures of the store or the network (try again later), False for a refused request."""
    if isinstance(error, MlflowException):
        status = error.get_http_status_code()
    elif isinstance(error, requests.HTTPError) and error.response is not None:
        status = error.response.status_code
    else:
        return not isinstance(error, (FileNotFoundError, ValueError, TypeError))
    return status >= 500 or status in (408, 429)


@contextmanager
def _short_http_requests(timeout_s: int) -> Iterator[None]:
    """MLflow reads its HTTP timeout and retry count from the environment at each request; set them for
    our calls only (retries are ours: later, not inside a training step)."""
    values = {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(timeout_s), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _metric_values(entries: list[dict]) -> dict[tuple[str, int], float]:
    """(name, step) -> value of the metrics entries, the first value where one was logged twice."""
    values: dict[tuple[str, int], float] = {}
    for entry in entries:
        if entry.get("op") == "metrics":
            for name, value in entry["metrics"].items():
                values.setdefault((name, entry["step"]), value)
    return values


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])


def _now_ms() -> int:
    return int(time.time() * 1000)


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
