"""Every command README.md documents, and the header command of every file in ``sweeps/``, run as a
subprocess from a fresh working dir (so nothing lands in the checkout, and relative paths such as
``outputs/…`` and ``--config-dir sweeps`` mean what they mean to a user).

``COMMANDS`` says how each one is run; a documented command it does not list fails
``test_every_documented_command_is_classified``, and so does an entry no longer documented:

- as written: exactly the documented arguments;
- tiny: the documented arguments, then ``TINY`` for the keys the command does not set (a 1-step run that
  evaluates 2 mazes at 2 turns; the job and the sweep are the documented ones, only smaller);
- cfg job: needs GPU nodes and a real checkpoint, so it is composed and printed (``--cfg job``, in place
  of ``-m`` for a multirun: Hydra allows only one of them) instead of run;
- not run: exercised elsewhere, named in ``where``.

``replace`` swaps a placeholder of the README (a path to your own checkpoint, a sweep's name) for the
real one the earlier commands made.
"""

import functools
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import REPO

#: a tiny run in seconds: 1 step, evals on 2 pinned mazes at 2 turns.
TINY = (
    "total_steps=1", "eval.num_mazes=2", "rollout.max_turns=2", "rollout.max_new_tokens_per_turn=6",
    "algorithm.train_batch_size=1", "algorithm.policy_mini_batch_size=1",
)
#: the same for ``task=eval``.
TINY_EVAL = ("eval.num_mazes=2", "rollout.max_turns=2", "rollout.max_new_tokens_per_turn=6")


@dataclass(frozen=True)
class Doc:
    how: str  # "as written" | "tiny" | "cfg job" | "not run"
    where: str  # the test (or file) that runs it
    extra: tuple[str, ...] = ()  # appended (after the documented arguments)
    replace: tuple[tuple[str, str], ...] = ()  # (documented text, what the test uses)


# the placeholders the tests fill in: the tiny model's dir, the sweep the group_size test made.
TINY_MODEL, SWEEP_NAME = "<tiny model dir>", "<group_size sweep>"

COMMANDS = {
    # --- README: the first two commands
    "python3 -m pip install -e . torch==2.14.1 torchvision==0.29.1 && rlexp": Doc(
        "not run", "test_wheel.py (the install, from a wheel) and test_training_commands (`rlexp`)"),
    "python3 -m pip install -e '.[dev]' torch==2.14.1 torchvision==0.29.1 && python3 -m pytest": Doc(
        "not run", ".ci/run (this suite)"),
    # --- README: the command line
    "rlexp": Doc("tiny", "test_training_commands"),
    "rlexp --cfg job": Doc("as written", "test_composing_commands"),
    "rlexp --help": Doc("as written", "test_composing_commands"),
    "rlexp env=maze_hard algorithm.lr=1e-3 run_name=try1": Doc("tiny", "test_training_commands"),
    "rlexp env=maze_hard algorithm.lr=1e-3 run_name=try1 total_steps=8": Doc(
        "tiny", "test_training_commands", replace=(("total_steps=8", "total_steps=2"),)),
    "rlexp task=eval eval.policy=expert rollout.max_turns=20": Doc("as written", "test_scripted_eval"),
    "rlexp task=eval checkpoint=outputs/tiny_cpu/try1/checkpoints/global_step_2": Doc(
        "tiny", "test_training_commands", extra=TINY_EVAL),
    "rlexp task=eval model.path=/path/to/sft-checkpoint eval.policy=model": Doc(
        "tiny", "test_training_commands", extra=TINY_EVAL, replace=(("/path/to/sft-checkpoint", TINY_MODEL),)),
    "rlexp task=export checkpoint=outputs/tiny_cpu/try1/checkpoints/global_step_2": Doc("as written", "test_training_commands"),
    # needs vLLM and a GPU: tests/rollout/test_engine_contract.py runs rollout=vllm from the entrypoint there
    "rlexp rollout=vllm cluster=gpu_1x model.path=/fsx/qwen3-vl-8b-maze-sft": Doc("cfg job", "test_composing_commands"),
    "rlexp experiment=visgym_maze_grpo model.path=/fsx/qwen3-vl-8b-maze-sft --cfg job": Doc(
        "as written", "test_composing_commands"),
    "rlexp -m algorithm.n_samples_per_prompt=4,8 model.lora.rank=8,16": Doc(
        "tiny", "test_sweeps.py::readme_multirun (its runs are also checked in a real MLflow server)"),
    "rlexp task=report": Doc("as written", "test_training_commands"),
    # --- README: sweeps, and the sweep files' headers
    "rlexp -m --config-dir sweeps --config-name group_size": Doc("tiny", "test_sweep_file_runs_as_written"),
    "rlexp -m --config-dir sweeps --config-name group_size experiment=visgym_maze_grpo model.path=/fsx/sft": Doc(
        "cfg job", "test_composing_commands"),
    "rlexp -m --config-dir sweeps --config-name lora_rank": Doc("tiny", "test_sweep_file_runs_as_written"),
    # on a machine without CUDA, each job stops with the reason (the test checks that); TINY would not change that
    "rlexp -m --config-dir sweeps --config-name instance_type model.path=/fsx/qwen3-vl-8b-maze-sft": Doc(
        "as written", "test_sweep_file_runs_as_written"),
    "rlexp -m --config-dir sweeps --config-name instance_type task=plan": Doc("as written", "test_plan_commands"),
    "rlexp task=plan experiment=visgym_maze_grpo cluster=p4d_24xlarge cluster.price_per_hour=21.96 plan.step_time_s=600": Doc(
        "as written", "test_plan_commands"),
    "rlexp cluster=gpu_2x model=qwen3_vl_8b model.path=/fsx/qwen3-vl-8b-maze-sft": Doc(
        "cfg job", "test_composing_commands (2 ranks on CPU: tests/training/test_distributed.py)"),
    "rlexp --config-dir sweeps --config-name instance_type cluster=gpu_1x --cfg job": Doc(
        "as written", "test_composing_commands"),
    "rlexp -m --config-dir sweeps --config-name optuna": Doc(
        "tiny", "test_sweep_file_runs_as_written", extra=("hydra.sweeper.n_trials=2",)),
    "rlexp -m --config-dir sweeps --config-name optuna hydra.sweeper.n_trials=40 experiment=visgym_maze_grpo": Doc(
        "cfg job", "test_composing_commands"),
    "ray start --head --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1 --num-cpus=2": Doc(
        "not run", "tests/cluster/test_ray_e2e.py (its head, on free ports)"),
    "rlexp cluster=ray_cpu cluster.ray.address=http://127.0.0.1:8265 cluster.ray.workers=2": Doc(
        "not run", "tests/cluster/test_ray_e2e.py (the same run, submitted to its head)"),
    "rlexp task=manifest cluster=hyperpod_g7e_12xlarge cluster.kuberay.image=<account>.dkr.ecr.<region>.amazonaws.com/rlexp:latest": Doc(
        "not run", "tests/cluster/test_manifests.py (task=manifest for every GPU cluster option)"),
    "rlexp task=report report.sweep=multirun-2026-12-03_10-00-00": Doc(
        "as written", "test_report_of_a_sweep", replace=(("multirun-2026-12-03_10-00-00", SWEEP_NAME),)),
}


def readme_commands() -> list[str]:
    """The commands in README.md's ```bash blocks, trailing comments dropped."""
    blocks = re.findall(r"^```bash\n(.*?)^```", (REPO / "README.md").read_text(), flags=re.S | re.M)
    lines = (line.strip() for block in blocks for line in block.splitlines())
    return [re.sub(r"\s+#\s.*$", "", line) for line in lines if line and not line.startswith("#")]


def sweep_header_commands(sweep: str) -> list[str]:
    """The commands in a sweep file's header comment (``#   rlexp …``, a trailing ``(note)`` dropped)."""
    header = itertools.takewhile(lambda line: line.startswith("#"), (REPO / "sweeps" / f"{sweep}.yaml").read_text().splitlines())
    commands = (line.lstrip("#").strip() for line in header)
    return [re.sub(r"\s{2,}\(.*\)$", "", c) for c in commands if c.startswith("rlexp ")]


SWEEPS = sorted(p.stem for p in (REPO / "sweeps").glob("*.yaml"))


def documented_commands() -> list[str]:
    return list(dict.fromkeys(readme_commands() + [c for s in SWEEPS for c in sweep_header_commands(s)]))


def argv(command: str, **placeholders: str) -> list[str]:
    """``command`` as ``COMMANDS`` says to run it: ``python -m rlexp`` and its arguments."""
    doc = COMMANDS[command]
    for documented, used in doc.replace:
        command = command.replace(documented, placeholders.get(used, used))
    args = shlex.split(command)
    assert args[0] == "rlexp", command
    args = args[1:]
    if doc.how == "cfg job":
        args = [a for a in args if a != "-m"] + ["--cfg", "job"]
    added = list(doc.extra)
    if doc.how == "tiny":
        given = {a.split("=", 1)[0] for a in args + added if "=" in a}
        added += [a for a in TINY if a.split("=", 1)[0] not in given]
    return [sys.executable, "-m", "rlexp", *args, *added]


def run(command: str, cwd: Path, timeout: float = 600, **placeholders: str) -> subprocess.CompletedProcess:
    doc = COMMANDS[command]
    # the checkout under test, whichever rlexp is installed; the tiny model's cache from conftest's
    # environment; MLflow's default store, as a user gets it: <cwd>/outputs/mlflow.db
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("MLFLOW_TRACKING_URI", None)
    result = subprocess.run(argv(command, **placeholders), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert "HydraConfig was not set" not in result.stderr, result.stderr[-3000:]
    result.log = result.stdout + result.stderr  # Hydra logs to stdout, tracebacks and progress bars go to stderr
    return result


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"{shlex.join(result.args[2:])}\n{result.stderr[-3000:]}"
    return result


def workdir(tmp_path: Path) -> Path:
    """A user's working dir: the ready sweeps beside it (``--config-dir sweeps`` is relative), nothing else."""
    shutil.copytree(REPO / "sweeps", tmp_path / "sweeps")
    return tmp_path


def commands_for(test: str) -> list[str]:
    return [c for c, doc in COMMANDS.items() if doc.where == test]


def test_every_documented_command_is_classified():
    documented = documented_commands()
    unclassified = [c for c in documented if c not in COMMANDS]
    assert not unclassified, f"add these documented commands to COMMANDS (how the suite runs each): {unclassified}"
    stale = [c for c in COMMANDS if c not in documented]
    assert not stale, f"COMMANDS lists commands no longer documented: {stale}"
    for command, doc in COMMANDS.items():
        assert doc.how in {"as written", "tiny", "cfg job", "not run"}, command
        test = doc.where.split(" ")[0]
        if doc.how != "not run":
            module = sys.modules[__name__] if "::" not in test else __import__(test.split(".py")[0])
            assert hasattr(module, test.split("::")[-1]), f"{command}: {doc.where} does not exist"
    for sweep in SWEEPS:
        assert sweep_header_commands(sweep), f"sweeps/{sweep}.yaml: its header shows no command"
        assert sweep_header_commands(sweep)[0] in commands_for("test_sweep_file_runs_as_written"), sweep


@pytest.mark.parametrize("command", commands_for("test_composing_commands"))
def test_composing_commands(command, tmp_path):
    result = ok(run(command, workdir(tmp_path)))
    if "--help" in command:
        assert "model: qwen3_vl_2b, qwen3_vl_8b, tiny" in result.stdout
        return
    cfg = OmegaConf.create(result.stdout)
    for arg in shlex.split(command):
        key, _, value = arg.partition("=")
        if "." in key and not key.startswith("hydra"):
            assert str(OmegaConf.select(cfg, key)) == value, arg  # the command's own settings are in the config
    if "visgym_maze_grpo" in command:
        assert cfg.total_steps == 160 and cfg.model.lora.rank == 32 and cfg.rollout.max_turns == 20
    assert not list(tmp_path.glob("outputs")), "composing wrote outputs"


@pytest.mark.slow
def test_scripted_eval(tmp_path):
    (command,) = commands_for("test_scripted_eval")
    ok(run(command, tmp_path))
    (summary,) = tmp_path.glob("outputs/tiny_cpu/*/eval/expert.summary.json")
    summary = json.loads(summary.read_text())
    assert summary["success_rate"] == 1.0 and summary["num_mazes"] == 64 and summary["turn_limit"] == 20


def test_plan_commands(tmp_path):
    """``task=plan`` on this CPU machine: the instance-type sweep prints one table per cluster option of the
    sweep (README shows its rows), and a priced plan gives the cost; no weights load, nothing is trained."""
    sweep, priced = commands_for("test_plan_commands")
    result = ok(run(sweep, workdir(tmp_path)))
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert sorted(row.split("|")[1].strip() for row in rows) == [cluster for ((_, cluster),) in expected_jobs("instance_type")]
    assert result.stdout.count("model config: bundled shape of Qwen/Qwen3-VL-8B-Instruct") == len(rows)
    readme = (REPO / "README.md").read_text()
    assert all(row in readme for row in rows), "README's fit table differs from what the sweep prints now"
    result = ok(run(priced, tmp_path))
    assert "on p4d_24xlarge: 1 node(s) x 8 GPU(s) of 40 GB; world size 8, FSDP2" in result.stdout
    assert "per run (160 steps): 213.3 GPU-hours, $585.60" in result.stdout, result.stdout
    assert not list(tmp_path.glob("outputs/*/*/checkpoints"))


@functools.cache
def tiny_model_dir() -> str:
    from rlexp.models import resolve_model_path

    return str(resolve_model_path("tiny"))


@pytest.mark.slow
def test_training_commands(tmp_path):
    """The README's command-line section in order, in one working dir: a run, a named run, resuming it,
    evaluating its checkpoint, exporting it, evaluating a plain model dir, and the report of them all."""
    cwd = workdir(tmp_path)
    runs = cwd / "outputs" / "tiny_cpu"

    ok(run("rlexp", cwd))
    (default_run,) = runs.iterdir()
    assert (default_run / "eval" / "step_000001.summary.json").is_file()
    assert (default_run / "checkpoints" / "global_step_1" / "manifest.json").is_file()

    ok(run("rlexp env=maze_hard algorithm.lr=1e-3 run_name=try1", cwd))
    assert sorted(p.name for p in (runs / "try1" / "checkpoints").iterdir()) == ["global_step_1"]
    resumed = ok(run("rlexp env=maze_hard algorithm.lr=1e-3 run_name=try1 total_steps=8", cwd))
    assert re.search(r"resumed from \S*try1/checkpoints/global_step_1 at step 1", resumed.log), resumed.log[-3000:]
    assert (runs / "try1" / "checkpoints" / "global_step_2").is_dir()
    steps = [json.loads(line).get("step") for line in (runs / "try1" / "metrics.jsonl").read_text().splitlines()]
    assert 1 in steps and 2 in steps

    before = set(runs.iterdir())
    evaluated = ok(run("rlexp task=eval checkpoint=outputs/tiny_cpu/try1/checkpoints/global_step_2", cwd))
    assert "eval (model) on maze_hard" in evaluated.log  # the checkpoint's own env, from its config.yaml
    (eval_dir,) = set(runs.iterdir()) - before
    assert json.loads((eval_dir / "eval" / "model.summary.json").read_text())["num_mazes"] == 2

    before = set(runs.iterdir())
    ok(run("rlexp task=export checkpoint=outputs/tiny_cpu/try1/checkpoints/global_step_2", cwd))
    (export_dir,) = set(runs.iterdir()) - before
    assert (export_dir / "merged" / "model.safetensors").is_file() and not (export_dir / "merged" / "adapter_config.json").exists()
    assert (export_dir / "adapter" / "adapter_config.json").is_file()

    ok(run("rlexp task=eval model.path=/path/to/sft-checkpoint eval.policy=model", cwd, **{TINY_MODEL: tiny_model_dir()}))
    assert len(list(runs.glob("*/eval/model.summary.json"))) == 2

    report = ok(run("rlexp task=report", cwd))
    rows = [line for line in report.stdout.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + 4, report.stdout  # header, rule, and the four runs above (two trainings, two evals)
    assert list(runs.glob("*/report.png"))
    assert (cwd / "outputs" / "mlflow.db").is_file()  # the documented default store


def sweep_jobs(sweep_dir: Path) -> list[Path]:
    return sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


@pytest.fixture(scope="module")
def sweep_runs(tmp_path_factory):
    """Runs a sweep file's header command once per module, each in its own working dir: (its result,
    the one sweep dir it made, or None)."""
    done = {}

    def run_sweep(sweep: str) -> tuple[subprocess.CompletedProcess, Path | None]:
        if sweep not in done:
            cwd = workdir(tmp_path_factory.mktemp(sweep))
            result = run(sweep_header_commands(sweep)[0], cwd)
            found = list(cwd.glob("outputs/*/multirun-*"))
            done[sweep] = result, (found[0] if len(found) == 1 else None)
        return done[sweep]

    return run_sweep


def expected_jobs(sweep: str) -> list[tuple[tuple[str, str], ...]]:
    """The jobs a basic-sweeper file asks for: the product of its comma-separated params (interpolated
    ones, such as ``model.lora.alpha: ${model.lora.rank}``, left out), sorted."""
    params = OmegaConf.to_container(OmegaConf.load(REPO / "sweeps" / f"{sweep}.yaml").hydra.sweeper.params)
    axes = [[(k, v) for v in str(values).split(",")] for k, values in params.items() if "${" not in str(values)]
    return sorted(itertools.product(*axes))


@pytest.mark.slow
@pytest.mark.parametrize("sweep", SWEEPS)
def test_sweep_file_runs_as_written(sweep, sweep_runs):
    """Each sweep file's header command, without ``hydra.sweep.dir``, from a user's working dir: one job
    dir per swept value under ``outputs/<experiment>/multirun-<time>/``."""
    if sweep == "optuna":
        pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="the Optuna sweep needs the [sweeps] extra")
    result, sweep_dir = sweep_runs(sweep)
    assert sweep_dir is not None, result.stderr[-3000:]
    experiment = "visgym_maze_grpo" if sweep == "instance_type" else "tiny_cpu"
    assert sweep_dir.parent.name == experiment and re.fullmatch(r"multirun-\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", sweep_dir.name)
    jobs = sweep_jobs(sweep_dir)

    if sweep == "instance_type":
        import torch

        if torch.cuda.is_available():
            pytest.skip("needs the seed's 8B checkpoint at /fsx; composed by test_composing_commands")
        # on this CPU machine every job starts and stops with the reason, and the sweep says it failed
        assert result.returncode != 0 and "cuda" in result.stderr.lower(), result.stderr[-3000:]
        assert [j.name for j in jobs] == [str(i) for i in range(len(expected_jobs(sweep)))]
        return

    ok(result)
    if sweep == "optuna":
        results = OmegaConf.load(sweep_dir / "optimization_results.yaml")
        assert set(results.best_params) == {"algorithm.lr", "rollout.temperature", "algorithm.n_samples_per_prompt"}
        finals = [json.loads((job / "eval" / "step_000001.summary.json").read_text())["success_rate"] for job in jobs]
        assert len(finals) == 2 and results.best_value == max(finals)
        return
    expected = expected_jobs(sweep)
    ran = []
    for job in jobs:
        assert (job / "eval" / "step_000001.summary.json").is_file(), job
        cfg = OmegaConf.load(job / ".hydra" / "config.yaml")
        ran.append(tuple((key, str(OmegaConf.select(cfg, key))) for key, _ in expected[0]))
        if sweep == "lora_rank":
            assert cfg.model.lora.alpha == cfg.model.lora.rank  # alpha = rank, as the file says
    assert sorted(ran) == expected


@pytest.mark.slow
def test_report_of_a_sweep(sweep_runs):
    result, sweep_dir = sweep_runs("group_size")
    ok(result)
    cwd = sweep_dir.parent.parent.parent
    report = ok(run("rlexp task=report report.sweep=multirun-2026-12-03_10-00-00", cwd, **{SWEEP_NAME: sweep_dir.name}))
    rows = [line for line in report.stdout.splitlines() if line.startswith("|")]
    assert "algorithm.n_samples_per_prompt" in rows[0]
    assert len(rows) == 2 + len(expected_jobs("group_size"))
