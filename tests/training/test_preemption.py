"""Preemption signals and the run-dir lock: the handler's rules in-process, the exits in subprocesses, the
lock through the real CLI. The whole-run behaviour (checkpoint, KILLED, resume bit for bit) is in
``bench/faults.py``, whose quick campaign runs in the slow suite (``test_fault_campaign``)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO
from e2e_support import own_env, rlexp_command
from rlexp.runtime import RunDirBusy, run_dir_lock
from rlexp.training.preemption import Preempted, Preemption


def test_first_signal_is_a_request_checked_at_safe_points_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with Preemption(grace_s=60) as preemption:
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested  # not raised: no abandonable work was running
        with pytest.raises(Preempted) as raised:
            preemption.check()
        assert raised.value.exit_code == 143
        with pytest.raises(Preempted):
            with preemption.abandonable():  # work not started once a signal came
                pytest.fail("abandonable work ran after the signal")
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_during_abandonable_work_abandons_it_at_once():
    with Preemption(grace_s=60) as preemption:
        with pytest.raises(Preempted) as raised:
            with preemption.abandonable():
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):  # the handler raises at the next bytecode
                    time.sleep(0.001)
                pytest.fail("still running after SIGINT")
        assert raised.value.exit_code == 130


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_second_signal_exits_at_once_with_the_signal_status():
    result = _python("""
        import logging, os, signal, time
        from rlexp.training.preemption import Preemption
        logging.basicConfig()
        with Preemption(grace_s=60):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
    """)
    assert result.returncode == 143
    assert "SIGTERM again: exiting now" in result.stderr


def test_grace_period_ends_a_process_that_does_not_finish():
    start = time.monotonic()
    result = _python("""
        import logging, os, signal, time
        from rlexp.training.preemption import Preemption
        logging.basicConfig()
        with Preemption(grace_s=1):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)  # an update that never ends
    """)
    assert result.returncode == 130 and time.monotonic() - start < 25
    assert "not done within preempt_grace_s=1 s" in result.stderr


def test_run_dir_lock_refuses_a_second_holder_and_a_dead_holder_does_not_block(tmp_path):
    with run_dir_lock(tmp_path):
        result = _python(f"""
            from rlexp.runtime import run_dir_lock
            with run_dir_lock({str(tmp_path)!r}):
                pass
        """)
        assert result.returncode != 0
        assert f"RunDirBusy: run dir {tmp_path} is in use by pid {os.getpid()}" in result.stderr
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from rlexp.runtime import run_dir_lock\nwith run_dir_lock({str(tmp_path)!r}):\n    print('held', flush=True)\n    input()"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunDirBusy, match=f"in use by pid {holder.pid}"):
        with run_dir_lock(tmp_path):
            pass
    holder.kill()
    holder.wait()
    with run_dir_lock(tmp_path):  # its lock died with it
        assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())


def test_cli_refuses_a_run_dir_in_use_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    with run_dir_lock(run_dir):
        result = subprocess.run(
            rlexp_command(run_dir, "logger=none"), cwd=REPO, env=own_env(), capture_output=True, text=True, timeout=300
        )
    assert result.returncode == 1
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("rlexp:")]
    assert line == (
        f"rlexp: run dir {run_dir} is in use by pid {os.getpid()} (lock {run_dir / '.lock'}); wait for it to end, or "
        "pick another run_name"
    )
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()


@pytest.mark.slow
def test_fault_campaign():
    """``bench/faults.py --quick``: every fault line at 100%."""
    result = subprocess.run(
        [sys.executable, "bench/faults.py", "--quick"], cwd=REPO, env=own_env(), capture_output=True, text=True, timeout=1800
    )
    lines = [line for line in result.stdout.splitlines() if "survived" in line]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    faults = (
        "random model outputs", "kill -9", "SIGTERM:", "SIGINT:", "second SIGTERM", "second process",
        "corrupt newest checkpoint", "disk full", "MLflow server killed", "total:",
    )
    for fault in faults:
        (line,) = [line for line in lines if line.startswith(fault)] or [f"{fault}: no line"]
        assert "(100%)" in line, result.stdout
    assert "every line at 100%: yes" in lines[-1], result.stdout
