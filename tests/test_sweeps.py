"""Real multiruns into a real MLflow server (no ``hydra.sweep.dir``: they land where a user's would, under
the working dir), the report, and the MLflow UI in Chromium. test_documented_commands.py runs every sweep
file as written."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient
from omegaconf import OmegaConf

from conftest import REPO
from test_documented_commands import argv, readme_commands

SWEEPS = sorted(p.stem for p in (REPO / "sweeps").glob("*.yaml"))
#: a tiny run in seconds: 1 step, evals on 2 pinned mazes.
QUICK = [
    "total_steps=1", "eval.num_mazes=2", "rollout.max_turns=2", "rollout.max_new_tokens_per_turn=6",
    "algorithm.train_batch_size=1", "algorithm.policy_mini_batch_size=1",
]


#: the README's multirun example: 2 group sizes x 2 LoRA ranks.
README_MULTIRUN = "rlexp -m algorithm.n_samples_per_prompt=4,8 model.lora.rank=8,16"


def rlexp(*args: str, cwd: Path = REPO, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "rlexp", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def the_sweep_dir(cwd: Path) -> Path:
    (sweep_dir,) = (cwd / "outputs" / "tiny_cpu").glob("multirun-*")
    return sweep_dir


@pytest.mark.parametrize("sweep", SWEEPS)
def test_every_sweep_file_composes_with_its_sweep_params(sweep):
    if sweep == "optuna":
        pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="the Optuna sweep needs the [sweeps] extra")
    result = rlexp("--config-dir", "sweeps", "--config-name", sweep, "--cfg", "hydra")
    assert result.returncode == 0, result.stderr
    hydra = OmegaConf.create(result.stdout).hydra
    assert hydra.sweeper.params, f"sweeps/{sweep}.yaml sweeps nothing"
    header = (REPO / "sweeps" / f"{sweep}.yaml").read_text().splitlines()[:4]
    assert any(f"--config-name {sweep}" in line for line in header), "the header shows the exact command"
    job = rlexp("--config-dir", "sweeps", "--config-name", sweep, "--cfg", "job")
    assert job.returncode == 0, job.stderr


@pytest.fixture(scope="module")
def readme_multirun(mlflow_server, tmp_path_factory):
    """The README's multirun (tiny settings, as test_documented_commands.py runs it), logged to the server."""
    assert README_MULTIRUN in readme_commands()
    cwd = tmp_path_factory.mktemp("readme-multirun")
    result = rlexp(*argv(README_MULTIRUN)[3:], "logger=mlflow", f"logger.mlflow.tracking_uri={mlflow_server.uri}", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return the_sweep_dir(cwd)


@pytest.mark.slow
def test_multirun_lands_in_mlflow_with_params_history_and_artifacts(mlflow_server, readme_multirun):
    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("tiny_cpu")
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.sweep = '{readme_multirun.name}'")
    assert len(runs) == 4
    swept = sorted((r.data.params["algorithm.n_samples_per_prompt"], r.data.params["model.lora.rank"]) for r in runs)
    assert swept == [("4", "16"), ("4", "8"), ("8", "16"), ("8", "8")]
    for run in runs:
        assert run.info.status == "FINISHED"
        assert run.data.tags["choice.experiment"] == "tiny_cpu"
        assert run.data.tags["checkpoint"].endswith("checkpoints/global_step_1")
        history = client.get_metric_history(run.info.run_id, "eval/success_rate")
        assert sorted(m.step for m in history) == [0, 1]
        assert client.get_metric_history(run.info.run_id, "train/loss")
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "eval")}
        assert any(path.endswith(".jsonl") for path in artifacts), artifacts
        assert any(path.endswith((".png", ".gif")) for path in _all_artifacts(client, run.info.run_id, "eval"))


def _all_artifacts(client, run_id, path):
    for item in client.list_artifacts(run_id, path):
        if item.is_dir:
            yield from _all_artifacts(client, run_id, item.path)
        else:
            yield item.path


@pytest.mark.slow
def test_report_prints_table_and_plots_the_sweep(mlflow_server, readme_multirun, tmp_path):
    out = tmp_path / "report"
    result = rlexp(
        "task=report", f"report.sweep={readme_multirun.name}", f"report.tracking_uri={mlflow_server.uri}", f"hydra.run.dir={out}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = [line for line in result.stdout.splitlines() if line.startswith("|")]
    assert "algorithm.n_samples_per_prompt" in table[0] and "model.lora.rank" in table[0]
    assert len(table) == 2 + 4
    assert all("@ step 1" in row for row in table[2:])
    assert (out / "report.png").stat().st_size > 10_000
    assert (out / "report.md").read_text().strip() == "\n".join(table)


@pytest.mark.slow
def test_failing_job_does_not_stop_the_sweep_and_is_marked_failed(mlflow_server, tmp_path):
    result = rlexp(
        "-m", "model.path=/nonexistent/model,tiny", "logger=mlflow", f"logger.mlflow.tracking_uri={mlflow_server.uri}", *QUICK,
        cwd=tmp_path,
    )
    assert result.returncode != 0  # the sweep reports the failure...
    sweep_dir = the_sweep_dir(tmp_path)
    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("tiny_cpu")
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.sweep = '{sweep_dir.name}'")
    statuses = sorted((r.data.params["model.path"], r.info.status) for r in runs)
    assert statuses == [("/nonexistent/model", "FAILED"), ("tiny", "FINISHED")]  # ...after running the rest


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_mlflow_ui_shows_the_sweep_runs(mlflow_server, readme_multirun, tmp_path):
    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("tiny_cpu")
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.sweep = '{readme_multirun.name}'")
    url = f"{mlflow_server.uri}/#/experiments/{experiment.experiment_id}/runs"
    browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000", "--window-size=1400,900"]
    dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    for run in runs:
        assert run.info.run_name in dom, f"{run.info.run_name} not on the experiment page"
    screenshot = tmp_path / "mlflow-ui.png"
    subprocess.run([*browser, f"--screenshot={screenshot}", url], capture_output=True, timeout=120)
    assert screenshot.stat().st_size > 10_000
