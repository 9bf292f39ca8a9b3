"""FSDP2 on CPU: real torch.distributed (gloo), two ranks in processes spawned by torch's elastic launcher
(what torchrun runs). Two ranks take the same step as one process; checkpoints resume at another world
size; a rank killed with SIGKILL stops the run, naming it, and resuming gives the uninterrupted result."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed_support import one_update, train
from rlexp.training import distributed

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def ranks_import_this_dir(monkeypatch):
    """Spawned ranks unpickle their entrypoint by module name: give them this directory and tests/."""
    paths = [str(HERE), str(HERE.parent), str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))


@pytest.mark.slow
def test_two_ranks_take_the_same_grpo_step_as_one_process(tmp_path):
    single_metrics, single_adapter = one_update(str(tmp_path / "single"))
    metrics, adapter = distributed.launch(one_update, 2, str(tmp_path / "ranks"))
    assert metrics["train/optimizer_steps"] == single_metrics["train/optimizer_steps"] == 2
    assert metrics["train/tokens"] == single_metrics["train/tokens"]
    assert single_metrics["train/grad_norm"] > 1e-3 and single_metrics["train/loss"] != 0  # a real gradient
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm", "train/clip_frac"):
        assert metrics[key] == pytest.approx(single_metrics[key], rel=1e-4, abs=1e-6), key
    assert single_adapter.keys() == adapter.keys()
    moved = 0
    for name, value in single_adapter.items():
        # Adam divides by the gradient's size: summation-order noise of 1e-7 shows as ~1e-6 where it is ~0
        torch.testing.assert_close(adapter[name], value, rtol=1e-4, atol=1e-5, msg=name)
        moved += not torch.equal(value, value * 0)
    assert moved  # the update changed the adapter


def test_a_failing_rank_stops_the_run_naming_it():
    with pytest.raises(distributed.RankFailedError, match=r"rank 1 of 2 failed .*ValueError: rank 1 gives up"):
        distributed.launch(_fail_on_rank_1, 2)


def _fail_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 gives up")
    time.sleep(60)  # stopped by the launcher long before this


def adapter_of(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"global_step_{step}" / "policy" / "adapter_model.safetensors")


def assert_same_adapters(a: dict, b: dict, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.slow
def test_checkpoints_resume_at_another_world_size(tmp_path, monkeypatch):
    """SFT (the expert's moves: no sampling) for 3 steps on 2 ranks, against 2 ranks → 1 process → 2 ranks
    resuming from each other's checkpoints: the optimizer state reshards through DCP, the adapter through peft."""
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "outputs" / "dist"
    train("straight", 2, "sft", "total_steps=3")
    train("switch", 2, "sft", "total_steps=1")
    assert (runs / "switch" / "checkpoints" / "global_step_1" / distributed.OPTIMIZER_SHARDS).is_dir()
    train("switch", 1, "sft", "total_steps=2")
    assert "optimizer" in torch.load(runs / "switch" / "checkpoints" / "global_step_2" / "trainer_state.pt", weights_only=False)
    train("switch", 2, "sft", "total_steps=3")
    assert_same_adapters(adapter_of(runs / "switch", 3), adapter_of(runs / "straight", 3))


def rank_pids(parent: int) -> list[int]:
    """The rank processes the launcher spawned below ``parent`` (multiprocessing's spawn children)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            pids.append(int(proc.name))
    return sorted(pids)


@pytest.mark.slow
def test_kill_9_of_one_rank_mid_run_then_resume_gives_the_uninterrupted_result(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "outputs" / "dist"
    train("straight", 2, "grpo", "total_steps=3")

    driver = subprocess.Popen(
        [sys.executable, str(HERE / "distributed_support.py"), "killed", "2", "grpo", "total_steps=3"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    first = runs / "killed" / "checkpoints" / "global_step_1"
    deadline = time.time() + 600
    while not (first / "manifest.json").is_file():
        assert driver.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.2)
    pids = rank_pids(driver.pid)
    assert len(pids) == 2, pids
    os.kill(pids[-1], signal.SIGKILL)  # in step 2 (or its checkpoint): the other rank then waits at a collective
    _, stderr = driver.communicate(timeout=300)
    assert driver.returncode != 0
    assert re.search(r"rank [01] of 2 failed .*killed by SIGKILL", stderr), stderr[-3000:]
    assert not (runs / "killed" / "checkpoints" / "global_step_3").exists()

    train("killed", 2, "grpo", "total_steps=3")
    assert_same_adapters(adapter_of(runs / "killed", 3), adapter_of(runs / "straight", 3), rtol=0, atol=0)
    straight = (runs / "straight" / "metrics.jsonl").read_text().splitlines()
    resumed = (runs / "killed" / "metrics.jsonl").read_text().splitlines()
    assert [_without_timing(line) for line in resumed[-2:]] == [_without_timing(line) for line in straight[-2:]]


def _without_timing(line: str) -> dict:
    import json

    return {k: v for k, v in json.loads(line).items() if not k.startswith("timing/") and k not in ("time", "timestamp")}


def test_a_rank_killed_by_a_signal_is_named_with_the_python_stack_it_died_in():
    with pytest.raises(distributed.RankFailedError) as failed:
        distributed.launch(_abort_on_rank_1, 2)
    message = str(failed.value)
    assert re.match(r"rank 1 of 2 failed \(exit code -6\): killed by SIGABRT; its Python stacks:", message), message
    assert "in _abort_on_rank_1" in message, message


def _abort_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        os.abort()  # what a C++ std::terminate does
    time.sleep(60)  # stopped by the launcher long before this
