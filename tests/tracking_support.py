"""Real backends for the tracker tests: an ``mlflow server`` subprocess, an isolated offline W&B, and a
reader for W&B's offline ``.wandb`` files (wandb 0.31 ships no Python reader for them)."""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from wandb.proto import wandb_internal_pb2


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


def wandb_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """The records of a ``run-<id>.wandb`` file: a 7-byte header, then LevelDB-log blocks of 32 KiB whose
    chunks (checksum u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) carry ``Record`` protos."""
    data, block, records, pending = Path(path).read_bytes(), 32768, [], b""
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos = 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in this block for a chunk header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


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
