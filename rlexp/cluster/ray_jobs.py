"""``cluster.launcher=ray``: the composed run goes to a Ray cluster through Ray's Job Submission API.

What a submission carries, and nothing more:

* the working dir (the directory ``rlexp`` was started in, without run outputs, caches and ``.git``);
* the resolved config and what rlexp reads of Hydra's (choices, sweep, overrides), so that the job runs
  exactly the local composition (``rlexp.ray_job`` restores both; the cluster composes nothing);
* a runtime env of that working dir and environment variables only: the image has rlexp and its extras,
  so nothing is pip-installed per job, and only the variables ``cluster.ray.env_vars`` names travel.

The run dir is ``<cluster.shared_storage>/<the local run dir>`` (or the local run dir itself, absolute,
for a Ray cluster on this machine), so resubmitting the same ``run_name`` resumes it, as ``resume=latest``
does locally. A job whose run dir already finished with this very config is skipped; one still pending or
running is not submitted twice. ``ray job stop`` sends SIGTERM: the ranks checkpoint within
``preempt_grace_s`` (the job's ``RAY_JOB_STOP_WAIT_TIME_S`` is set above it) and the run is KILLED.

A multirun submits one Ray job per Hydra job, at most ``cluster.ray.max_concurrent_jobs`` pending or
running at once, and ``WaitForRayJobs`` (a Hydra callback) waits for them at the end of the sweep.
"""

import asyncio
import hashlib
import json
import logging
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from rlexp.cluster import RAY_JOB_PAYLOAD
from rlexp.config import ConfigError
from rlexp.runtime import hydra_context, run_dir_of
from rlexp.tracking.base import GIT_COMMIT_ENV, git_commit

log = logging.getLogger(__name__)

#: what the job runs on the cluster.
ENTRYPOINT = "python -m rlexp.ray_job"
#: never uploaded with the working dir: run outputs, trackers' local stores, caches, VCS and build files.
EXCLUDES = [
    ".git", "outputs", "multirun", "mlruns", "wandb", ".cache", "__pycache__", "*.pyc", "*.egg-info", ".venv",
    ".pytest_cache", ".hypothesis", "build", "dist",
]
#: seconds between looks at the cluster's job list while waiting for a slot or for the jobs to end.
POLL_S = 2.0
#: Ray job statuses that are final.
ENDED = ("SUCCEEDED", "FAILED", "STOPPED")
#: ids of the jobs this process submitted in its multirun, for ``WaitForRayJobs``.
SUBMITTED: list[tuple[str, str, str]] = []


def upload_excludes(working_dir: Path) -> list[str]:
    """``EXCLUDES`` plus the patterns of the checkout's ``.git/info/exclude``: Ray's upload skips what
    .gitignore files list but not that file, where local stores of wheels or weights usually go."""
    local = working_dir / ".git" / "info" / "exclude"
    patterns = local.read_text().splitlines() if local.is_file() else []
    return EXCLUDES + [line for line in map(str.strip, patterns) if line and not line.startswith("#")]


def submit(cfg: DictConfig) -> float | None:
    """Submit this run to the Ray cluster. A single run with ``cluster.ray.follow`` streams the job's logs
    until it ends and returns its final eval success (exits with one line if the job failed or was
    stopped); otherwise returns None once the job is submitted."""
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise ConfigError("cluster.launcher=ray needs Ray's client here: pip install 'rlexp[ray]'") from None

    address = cfg.cluster.ray.address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ConfigError(
            "cluster.launcher=ray needs the cluster's address: set cluster.ray.address (e.g. http://<head>:8265, "
            "ray://<head>:10001, sagemaker_ray://<cluster>/<namespace>) or RAY_ADDRESS"
        )
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    run_dir, job_cfg, payload = submission(cfg)
    digest = config_digest(job_cfg)
    client = JobSubmissionClient(address)
    earlier = [j for j in client.list_jobs() if (j.metadata or {}).get("rlexp_run_dir") == str(run_dir)]
    for job in earlier:
        status = str(job.status.value if hasattr(job.status, "value") else job.status)
        if status in ("PENDING", "RUNNING"):
            raise ConfigError(f"run dir {run_dir} is in use by Ray job {job.submission_id} ({status}); wait for it or stop it")
        if status == "SUCCEEDED" and (job.metadata or {}).get("rlexp_config") == digest:
            print(f"rlexp: {run_dir} finished as Ray job {job.submission_id} with this config; skipped", flush=True)
            return None
    sweep = str(HydraConfig.get().sweep.dir) if multirun else ""
    if multirun:
        _wait_for_slot(client, sweep, cfg.cluster.ray.max_concurrent_jobs)
    job_id = client.submit_job(
        entrypoint=ENTRYPOINT,
        submission_id=f"rlexp-{_slug(cfg.name)}-{_slug(Path(run_dir).name)}-{uuid.uuid4().hex[:6]}",
        runtime_env={"working_dir": os.getcwd(), "excludes": upload_excludes(Path.cwd()), "env_vars": {**named_env_vars(cfg), **job_env_vars(cfg, payload)}},
        metadata={"rlexp_run_dir": str(run_dir), "rlexp_config": digest, "rlexp_sweep": sweep, "rlexp_run_name": cfg.run_name},
    )
    print(
        f"rlexp: submitted Ray job {job_id} to {address} (run dir {run_dir})\n"
        f"  follow it: ray job logs -f {job_id} --address {address}\n"
        f"  stop it:   ray job stop {job_id} --address {address}   (it checkpoints; the same command resumes it)",
        flush=True,
    )
    if multirun:
        SUBMITTED.append((job_id, address, str(run_dir)))
        return None
    if not cfg.cluster.ray.follow:
        return None
    status = follow(client, job_id)
    if status != "SUCCEEDED":
        message = client.get_job_info(job_id).message or ""
        sys.exit(f"rlexp: Ray job {job_id} ended {status}{': ' + message if message else ''}; its run dir is {run_dir}")
    return final_success(run_dir)


def submission(cfg: DictConfig) -> tuple[Path, DictConfig, str]:
    """The run dir on the cluster, the resolved config the job runs, and the payload that carries both
    with the Hydra context (JSON, for ``$RLEXP_RAY_JOB``)."""
    run_dir = cluster_run_dir(cfg)
    job_cfg = job_config(cfg)
    payload = {"config": OmegaConf.to_container(job_cfg, enum_to_str=True), "hydra": hydra_context(), "run_dir": str(run_dir)}
    return run_dir, job_cfg, json.dumps(payload)


def cluster_run_dir(cfg: DictConfig) -> Path:
    """Where the run lives on the cluster: the local run dir (relative to here) under
    ``cluster.shared_storage``; without shared storage (a Ray cluster on this machine), the local run dir
    itself, absolute."""
    local = run_dir_of(cfg)
    storage = cfg.cluster.shared_storage
    if not storage:
        return local.resolve()
    if local.is_absolute():
        try:
            local = local.relative_to(Path.cwd())
        except ValueError:
            local = Path("outputs") / cfg.name / local.name
    return Path(storage) / local


def job_config(cfg: DictConfig) -> DictConfig:
    """The resolved config the job runs. The default MLflow store (``outputs/mlflow.db`` of the working
    directory) becomes that of the shared storage, or stays this directory's for a Ray cluster on this
    machine: the job runs in a copy of the working dir, which is not kept."""
    job = cfg.copy()
    OmegaConf.resolve(job)
    mlflow = job.logger.get("mlflow") if job.logger is not None else None
    if mlflow is not None and mlflow.tracking_uri is None:
        storage = cfg.cluster.shared_storage
        outputs = Path(storage) / "outputs" if storage else Path("outputs").resolve()
        mlflow.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{outputs / 'mlflow.db'}"
    return job


def config_digest(job_cfg: DictConfig) -> str:
    """What makes two submissions of one run dir the same run: the resolved config less ``run_name``
    (a timestamp by default; the run dir, compared beside it, already names the run)."""
    config = OmegaConf.to_container(job_cfg, enum_to_str=True)
    config.pop("run_name", None)
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def named_env_vars(cfg: DictConfig) -> dict[str, str]:
    """The variables of this shell that ``cluster.ray.env_vars`` names: the only ones that travel."""
    missing = [name for name in cfg.cluster.ray.env_vars if name not in os.environ]
    if missing:
        raise ConfigError(f"cluster.ray.env_vars names {', '.join(missing)}, which this shell does not set")
    return {name: os.environ[name] for name in cfg.cluster.ray.env_vars}


def job_env_vars(cfg: DictConfig, payload: str) -> dict[str, str]:
    """The run; the stop wait: ``ray job stop`` leaves the ranks ``preempt_grace_s`` to checkpoint before
    Ray's SIGKILL (Ray's job supervisor reads it from the job's runtime env); and this checkout's commit,
    which the job's trackers tag the run with (its working dir is a copy without ``.git``)."""
    env = {RAY_JOB_PAYLOAD: payload, "RAY_JOB_STOP_WAIT_TIME_S": str(math.ceil(cfg.preempt_grace_s) + 30)}
    if commit := git_commit():
        env[GIT_COMMIT_ENV] = commit
    return env


def follow(client, job_id: str) -> str:
    """Stream the job's logs here until it ends; its final status. Ctrl-C stops following, not the job."""

    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", flush=True)

    try:
        asyncio.run(tail())
        return wait_until_ended(client, job_id)
    except KeyboardInterrupt:
        sys.exit(f"\nrlexp: stopped following; Ray job {job_id} goes on (ray job stop {job_id} stops it)")


def wait_until_ended(client, job_id: str) -> str:
    while (status := _status(client.get_job_status(job_id))) not in ENDED:
        time.sleep(POLL_S)
    return status


def final_success(run_dir: Path) -> float | None:
    """The success rate of the run's last eval, where its run dir is readable from here."""
    summaries = sorted((Path(run_dir) / "eval").glob("step_*.summary.json"))
    return json.loads(summaries[-1].read_text())["success_rate"] if summaries else None


def _wait_for_slot(client, sweep: str, cap: int) -> None:
    announced = False
    while True:
        active = [
            j for j in client.list_jobs()
            if (j.metadata or {}).get("rlexp_sweep") == sweep and _status(j.status) in ("PENDING", "RUNNING")
        ]
        if len(active) < cap:
            return
        if not announced:
            print(f"rlexp: {len(active)} jobs of this sweep are running (cluster.ray.max_concurrent_jobs={cap}); waiting", flush=True)
            announced = True
        time.sleep(POLL_S)


def _status(status: Any) -> str:
    return str(getattr(status, "value", status))


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in str(text))[:40]


class WaitForRayJobs(Callback):
    """At the end of a multirun, waits for the Ray jobs it submitted (with ``cluster.ray.follow``) and
    prints how each ended; the sweep fails if any did not succeed."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not SUBMITTED:
            return
        from ray.job_submission import JobSubmissionClient

        submitted, failed = list(SUBMITTED), []
        SUBMITTED.clear()
        if not OmegaConf.select(config, "cluster.ray.follow", default=True):
            return
        print(f"rlexp: waiting for the sweep's {len(submitted)} Ray jobs", flush=True)
        for job_id, address, run_dir in submitted:
            status = wait_until_ended(JobSubmissionClient(address), job_id)
            print(f"  {job_id}: {status} ({run_dir})", flush=True)
            if status != "SUCCEEDED":
                failed.append(job_id)
        if failed:
            sys.exit(f"rlexp: {len(failed)} of the sweep's {len(submitted)} Ray jobs did not succeed: {', '.join(failed)}")
