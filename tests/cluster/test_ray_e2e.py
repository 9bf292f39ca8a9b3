"""``cluster.launcher=ray`` against a real Ray cluster: a head started by this module on 127.0.0.1, the tiny
run submitted through Ray's Job Submission API with two CPU workers (the gloo FSDP2 path), its run dir,
eval and MLflow entries read back, and a resubmission of the finished config skipped; a job stopped with
``ray job stop`` mid-run leaves a checkpoint and a KILLED run that the same command resumes (its training
metrics on the head's Prometheus endpoint while it runs); a multirun of jobs under a cap of one at a time
lands each in MLflow, and re-run with one more job it submits only the new one."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from e2e_support import QUICK, REPO, logged_steps, own_env
from rlexp.tracking.base import GIT_COMMIT_ENV, git_commit

ray = pytest.importorskip("ray", reason="the Ray tests need ray[default] (pip install 'rlexp[ray]')")
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayHead(str):
    """The Job Submission API's address, with the head's Prometheus endpoint as ``metrics``."""

    def __new__(cls, address: str, metrics: str):
        head = super().__new__(cls, address)
        head.metrics = metrics
        return head


@pytest.fixture(scope="module")
def ray_head():
    """``ray start --head`` with 2 CPUs; its dashboard (the Job Submission API) on 127.0.0.1 only.
    Ray's GCS and raylet bind the node's address whatever ``--node-ip-address`` says; the test submits
    through 127.0.0.1 and stops the head after the module. The head's Prometheus endpoint (its metrics
    export port) is ``ray_head.metrics``."""
    ray_bin = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    temp_dir = Path("/tmp") / f"rlexp-ray-{os.getpid()}"  # Ray's socket paths must stay short
    dashboard_port, metrics_port = _free_port(), _free_port()
    start = [
        ray_bin, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={_free_port()}", "--num-cpus=2",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
        f"--metrics-export-port={metrics_port}", f"--temp-dir={temp_dir}", "--disable-usage-stats",
    ]
    subprocess.run(start, check=True, capture_output=True, env=own_env(), timeout=180)
    address = f"http://127.0.0.1:{dashboard_port}"
    from ray.job_submission import JobSubmissionClient

    deadline = time.time() + 60
    while True:
        try:
            JobSubmissionClient(address).list_jobs()
            break
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(1)
    yield RayHead(address, f"http://127.0.0.1:{metrics_port}/metrics")
    subprocess.run([ray_bin, "stop", "--force"], capture_output=True, timeout=120)
    shutil.rmtree(temp_dir, ignore_errors=True)


def _submit(address: str, run_dir: Path, env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "rlexp", f"hydra.run.dir={run_dir}", *QUICK, "cluster=ray_cpu",
        f"cluster.ray.address={address}", *overrides,
    ]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def test_a_tiny_run_on_two_ray_workers_lands_its_run_dir_eval_and_mlflow_run_then_a_resubmission_is_skipped(
    ray_head, tmp_path
):
    from mlflow import MlflowClient
    from ray.job_submission import JobSubmissionClient

    run_dir = tmp_path / "on-ray"  # the MLflow run is named after it
    env = {**own_env(), "WANDB_API_KEY": "not-for-the-cluster", "RLEXP_TEST_VAR": "travels"}
    overrides = ["cluster.ray.workers=2", "cluster.ray.env_vars=[RLEXP_TEST_VAR]", "total_steps=2",
                 "eval_interval=2", "ckpt_interval=2"]
    first = _submit(ray_head, run_dir, env, *overrides)
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-4000:]
    assert "submitted Ray job rlexp-" in out and "ray job logs -f rlexp-" in out, out[-2000:]

    # the run dir, with both training steps once, a checkpoint and the final eval of the pinned mazes
    assert logged_steps(run_dir) == [1, 2]
    assert (run_dir / "checkpoints" / "global_step_2" / "policy" / "adapter_model.safetensors").is_file()
    summary = json.loads((run_dir / "eval" / "step_000002.summary.json").read_text())
    assert summary["num_mazes"] == 4

    # the job's runtime env: the working dir and the named variables, never the submitter's secrets
    client = JobSubmissionClient(ray_head)
    job = next(j for j in client.list_jobs() if (j.metadata or {}).get("rlexp_run_dir") == str(run_dir))
    assert _state(job.status) == "SUCCEEDED"
    env_vars = job.runtime_env["env_vars"]
    assert env_vars["RLEXP_TEST_VAR"] == "travels"
    assert env_vars[GIT_COMMIT_ENV] == git_commit() is not None  # its working dir is a copy without .git
    assert "WANDB_API_KEY" not in env_vars and "pip" not in job.runtime_env
    assert job.runtime_env["working_dir"].startswith("gcs://")

    # the tracker entry (the tests' MLflow store, which the submitted config carries to the job)
    tracking = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    runs = tracking.search_runs(
        [e.experiment_id for e in tracking.search_experiments()], "tags.mlflow.runName = 'on-ray'"
    )
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert [m.step for m in tracking.get_metric_history(runs[0].info.run_id, "train/loss")] == [1, 2]
    assert runs[0].data.tags.get("choice.cluster") == "ray_cpu"
    assert runs[0].data.tags.get("git_commit") == git_commit()

    # the same config again: Ray knows the run finished, nothing is submitted
    second = _submit(ray_head, run_dir, env, *overrides)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert "with this config; skipped" in second.stdout
    assert sum((j.metadata or {}).get("rlexp_run_dir") == str(run_dir) for j in client.list_jobs()) == 1


def _state(status) -> str:
    return str(getattr(status, "value", status))


def _job_id(output: str) -> str:
    return re.search(r"submitted Ray job (\S+)", output).group(1)


def _mlflow_run(name: str):
    from mlflow import MlflowClient

    tracking = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    runs = tracking.search_runs(
        [e.experiment_id for e in tracking.search_experiments()], f"tags.mlflow.runName = '{name}'"
    )
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return tracking, runs[0]


def test_ray_job_stop_mid_run_leaves_a_checkpoint_and_a_killed_run_that_the_same_command_resumes(ray_head, tmp_path):
    from ray.job_submission import JobSubmissionClient

    run_dir = tmp_path / "stopped-on-ray"
    # no periodic checkpoint before the end: one found after the stop is the one the SIGTERM wrote
    overrides = ["total_steps=12", "eval_interval=12", "ckpt_interval=100"]
    first = _submit(ray_head, run_dir, own_env(), *overrides, "cluster.ray.follow=false")
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    job_id = _job_id(first.stdout)

    client = JobSubmissionClient(ray_head)
    deadline = time.time() + 300
    while not ((run_dir / "metrics.jsonl").is_file() and logged_steps(run_dir)):
        assert _state(client.get_job_status(job_id)) in ("PENDING", "RUNNING"), client.get_job_logs(job_id)[-3000:]
        assert time.time() < deadline, "the job logged no step within 300 s"
        time.sleep(0.2)

    # while it runs, rank 0's training metrics are on the head's Prometheus endpoint (Ray exports every few s)
    gauges: dict[str, float] = {}
    while not {"ray_rlexp_step", "ray_rlexp_rollout_success_rate", "ray_rlexp_timing_generate_s"} <= gauges.keys():
        assert _state(client.get_job_status(job_id)) == "RUNNING", "the job ended before its metrics were exported"
        assert time.time() < deadline, f"no rlexp metrics on {ray_head.metrics} within 300 s: {sorted(gauges)}"
        time.sleep(1)
        text = urllib.request.urlopen(ray_head.metrics, timeout=10).read().decode()
        gauges = {m[1]: float(m[2]) for m in re.finditer(r'^(ray_rlexp_\w+)\{[^}]*run="stopped-on-ray"[^}]*\} (\S+)', text, re.M)}
    assert gauges["ray_rlexp_step"] >= 1 and 0 <= gauges["ray_rlexp_rollout_success_rate"] <= 1
    ray_bin = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    stop = subprocess.run([ray_bin, "job", "stop", job_id, "--address", ray_head], capture_output=True, text=True,
                          env=own_env(), timeout=240)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    logs = client.get_job_logs(job_id)
    assert _state(client.get_job_status(job_id)) == "STOPPED", logs[-3000:]

    # what the SIGTERM left: a whole checkpoint of the steps done, the run KILLED here and in MLflow
    done = logged_steps(run_dir)
    assert 1 <= len(done) < 12 and done == list(range(1, len(done) + 1)), (done, logs[-3000:])
    checkpoints = sorted((run_dir / "checkpoints").glob("global_step_*"))
    assert [c.name for c in checkpoints] == [f"global_step_{done[-1]}"], logs[-3000:]
    assert (checkpoints[0] / "manifest.json").is_file()
    assert (run_dir / "status").read_text().strip() == "KILLED"
    _, killed = _mlflow_run("stopped-on-ray")
    assert killed.info.status == "KILLED"

    # the same command again: it resumes from that checkpoint and finishes, each step logged once
    second = _submit(ray_head, run_dir, own_env(), *overrides)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-4000:]
    assert f"global_step_{done[-1]}" in out, out[-4000:]  # it says which checkpoint it resumed from
    assert logged_steps(run_dir) == list(range(1, 13))
    tracking, finished = _mlflow_run("stopped-on-ray")
    assert finished.info.run_id == killed.info.run_id and finished.info.status == "FINISHED"
    assert [m.step for m in tracking.get_metric_history(finished.info.run_id, "train/loss")] == list(range(1, 13))


def _sweep(address: str, sweep_dir: Path, seeds: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "rlexp", "-m", f"hydra.sweep.dir={sweep_dir}", *QUICK, "cluster=ray_cpu",
        f"cluster.ray.address={address}", "cluster.ray.max_concurrent_jobs=1", "total_steps=1", "eval_interval=1",
        "ckpt_interval=1", f"seed={seeds}",
    ]
    return subprocess.run(command, cwd=REPO, env=own_env(), capture_output=True, text=True, timeout=900)


def test_a_multirun_on_ray_runs_one_job_at_a_time_under_the_cap_and_a_rerun_submits_only_unfinished_jobs(
    ray_head, tmp_path
):
    from ray.job_submission import JobSubmissionClient

    sweep_dir = tmp_path / "sweep"
    first = _sweep(ray_head, sweep_dir, "0,1")
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-4000:]
    assert "cluster.ray.max_concurrent_jobs=1); waiting" in out, out[-3000:]
    client = JobSubmissionClient(ray_head)

    def sweep_jobs():
        jobs = [j for j in client.list_jobs() if (j.metadata or {}).get("rlexp_sweep") == str(sweep_dir)]
        return sorted(jobs, key=lambda j: j.start_time)

    jobs = sweep_jobs()
    assert [j.metadata["rlexp_run_dir"] for j in jobs] == [str(sweep_dir / "0"), str(sweep_dir / "1")]
    assert all(_state(j.status) == "SUCCEEDED" for j in jobs)
    assert jobs[1].start_time >= jobs[0].end_time  # the cap: the second started after the first ended
    for job_dir in ("0", "1"):
        assert logged_steps(sweep_dir / job_dir) == [1]

    # the sweep again with one more seed: the two finished jobs are skipped, only the new one runs
    second = _sweep(ray_head, sweep_dir, "0,1,2")
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-4000:]
    assert out.count("with this config; skipped") == 2, out[-3000:]
    jobs = sweep_jobs()
    assert [j.metadata["rlexp_run_dir"] for j in jobs] == [str(sweep_dir / n) for n in ("0", "1", "2")]
    assert _state(jobs[2].status) == "SUCCEEDED" and logged_steps(sweep_dir / "2") == [1]
    # every job in MLflow, named <sweep dir name>/<job number>, finished, its step logged once
    for job_dir in ("0", "1", "2"):
        tracking, run = _mlflow_run(f"sweep/{job_dir}")
        assert run.info.status == "FINISHED"
        assert [m.step for m in tracking.get_metric_history(run.info.run_id, "train/loss")] == [1]
