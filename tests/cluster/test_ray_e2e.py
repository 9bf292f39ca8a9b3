"""``cluster.launcher=ray`` against a real Ray cluster: a head started by this module on 127.0.0.1, the tiny
run submitted through Ray's Job Submission API with two CPU workers (the gloo FSDP2 path), its run dir,
eval and MLflow entries read back, and a resubmission of the finished config skipped."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e_support import QUICK, REPO, logged_steps, own_env

ray = pytest.importorskip("ray", reason="the Ray tests need ray[default] (pip install 'rlexp[ray]')")
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head():
    """``ray start --head`` with 2 CPUs; its dashboard (the Job Submission API) on 127.0.0.1 only.
    Ray's GCS and raylet bind the node's address whatever ``--node-ip-address`` says; the test submits
    through 127.0.0.1 and stops the head after the module."""
    ray_bin = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    temp_dir = Path("/tmp") / f"rlexp-ray-{os.getpid()}"  # Ray's socket paths must stay short
    dashboard_port = _free_port()
    start = [
        ray_bin, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={_free_port()}", "--num-cpus=2",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
        f"--temp-dir={temp_dir}", "--disable-usage-stats",
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
    yield address
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
    assert str(job.status.value if hasattr(job.status, "value") else job.status) == "SUCCEEDED"
    env_vars = job.runtime_env["env_vars"]
    assert env_vars["RLEXP_TEST_VAR"] == "travels"
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

    # the same config again: Ray knows the run finished, nothing is submitted
    second = _submit(ray_head, run_dir, env, *overrides)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert "with this config; skipped" in second.stdout
    assert sum((j.metadata or {}).get("rlexp_run_dir") == str(run_dir) for j in client.list_jobs()) == 1
