"""Real backends for the tracker tests: an ``mlflow server`` subprocess, an isolated offline W&B, and the
history rows of W&B's offline ``.wandb`` files (read with the tracker's own reader)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from rlexp.tracking.wandb_tracker import read_records as wandb_records  # noqa: F401 (the tests' name for it)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 with a sqlite store and served artifacts under ``root``. It runs in
    its own process group (it spawns uvicorn workers), which ``stop`` signals as a whole."""

    def __init__(self, root: Path, port: int | None = None):
        self.root, self.port = Path(root), port or free_port()
        self.root.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120) -> None:
        command = [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}", "--artifacts-destination", str(self.root / "artifacts"),
        ]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job-runner process
        log = (self.root / "server.log").open("a")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                if requests.get(f"{self.uri}/health", timeout=1).ok:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"mlflow server not healthy after {timeout_s} s")

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Signal the whole process group; SIGKILL simulates a crash."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass
        self.process = None


def isolate_wandb(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """No W&B credentials and W&B's own files under ``root``: trackers run offline, touching nothing else
    (subprocesses inherit this environment)."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(root / "no-netrc"))
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(root / "wandb-home" / name.lower()))


def wandb_history(records) -> list[dict]:
    """History rows as ``{top-level key: decoded JSON value}`` (media rows hold ``{"_type": …}`` parts)."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict = {}
        for item in record.history.item:
            keys = list(item.nested_key) or [item.key]
            if len(keys) == 1:
                row[keys[0]] = json.loads(item.value_json)
            else:
                row.setdefault(keys[0], {})[keys[1]] = json.loads(item.value_json)
        rows.append(row)
    return rows
