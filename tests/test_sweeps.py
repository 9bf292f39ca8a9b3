"""Real multiruns of the ready sweeps into a real MLflow server, the report, and the MLflow UI in Chromium."""

import shutil
import subprocess
import sys

import pytest
from mlflow import MlflowClient
from omegaconf import OmegaConf

from conftest import REPO

SWEEPS = sorted(p.stem for p in (REPO / "sweeps").glob("*.yaml"))
#: a tiny run in seconds: 1 step, evals on 2 pinned mazes.
QUICK = [
    "total_steps=1", "eval.num_mazes=2", "rollout.max_turns=2", "rollout.max_new_tokens_per_turn=6",
    "algorithm.train_batch_size=1", "algorithm.policy_mini_batch_size=1",
]


def rlexp(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlexp", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


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
def group_size_sweep(mlflow_server, tmp_path_factory):
    """The group-size sweep crossed with two LoRA ranks: a 2 x 2 multirun logged to the server."""
    sweep_dir = tmp_path_factory.mktemp("sweep") / "multirun-test"
    result = rlexp(
        "-m", "--config-dir", "sweeps", "--config-name", "group_size",
        "algorithm.n_samples_per_prompt=2,4", "model.lora.rank=4,8",
        "logger=mlflow", f"logger.mlflow.tracking_uri={mlflow_server.uri}", f"hydra.sweep.dir={sweep_dir}", *QUICK,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return sweep_dir


@pytest.mark.slow
def test_multirun_lands_in_mlflow_with_params_history_and_artifacts(mlflow_server, group_size_sweep):
    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("tiny_cpu")
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.sweep = '{group_size_sweep.name}'")
    assert len(runs) == 4
    swept = sorted((r.data.params["algorithm.n_samples_per_prompt"], r.data.params["model.lora.rank"]) for r in runs)
    assert swept == [("2", "4"), ("2", "8"), ("4", "4"), ("4", "8")]
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
def test_report_prints_table_and_plots_the_sweep(mlflow_server, group_size_sweep, tmp_path):
    out = tmp_path / "report"
    result = rlexp(
        "task=report", f"report.sweep={group_size_sweep.name}", f"report.tracking_uri={mlflow_server.uri}", f"hydra.run.dir={out}"
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
    sweep_dir = tmp_path / "multirun-failing"
    result = rlexp(
        "-m", "model.path=/nonexistent/model,tiny", "logger=mlflow", f"logger.mlflow.tracking_uri={mlflow_server.uri}",
        f"hydra.sweep.dir={sweep_dir}", *QUICK,
    )
    assert result.returncode != 0  # the sweep reports the failure...
    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("tiny_cpu")
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.sweep = '{sweep_dir.name}'")
    statuses = sorted((r.data.params["model.path"], r.info.status) for r in runs)
    assert statuses == [("/nonexistent/model", "FAILED"), ("tiny", "FINISHED")]  # ...after running the rest


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_mlflow_ui_shows_the_sweep_runs(mlflow_server, group_size_sweep, tmp_path):
    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("tiny_cpu")
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.sweep = '{group_size_sweep.name}'")
    url = f"{mlflow_server.uri}/#/experiments/{experiment.experiment_id}/runs"
    browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000", "--window-size=1400,900"]
    dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    for run in runs:
        assert run.info.run_name in dom, f"{run.info.run_name} not on the experiment page"
    screenshot = tmp_path / "mlflow-ui.png"
    subprocess.run([*browser, f"--screenshot={screenshot}", url], capture_output=True, timeout=120)
    assert screenshot.stat().st_size > 10_000


@pytest.mark.slow
def test_optuna_sweep_maximises_final_eval_success(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="the Optuna sweep needs the [sweeps] extra")
    sweep_dir = tmp_path / "multirun-optuna"
    result = rlexp(
        "-m", "--config-dir", "sweeps", "--config-name", "optuna", "hydra.sweeper.n_trials=2",
        f"hydra.sweep.dir={sweep_dir}", *QUICK,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    assert set(results.best_params) == {"algorithm.lr", "rollout.temperature", "algorithm.n_samples_per_prompt"}
    finals = [OmegaConf.load(sweep_dir / str(n) / "eval" / "step_000001.summary.json").success_rate for n in (0, 1)]
    assert results.best_value == max(finals)
