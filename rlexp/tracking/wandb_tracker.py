"""Weights & Biases tracking: online when credentials exist, else offline into the run dir (``wandb sync``
uploads it later). The W&B run id is kept in ``tracking/wandb.json`` so a resumed run continues it;
``resume_from`` keeps each metric of each step once across the processes of one run."""

import json
import logging
import netrc
import os
import struct
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import wandb
from wandb.proto import wandb_internal_pb2

from rlexp.tracking.base import Status, default_artifact_path
from rlexp.tracking.secrets import redact

log = logging.getLogger(__name__)

#: files shown as media; others are saved as run files.
MEDIA = {
    ".png": wandb.Image,
    ".jpg": wandb.Image,
    ".jpeg": wandb.Image,
    ".gif": lambda path: wandb.Video(path, format="gif"),
}
#: W&B refuses longer tags.
MAX_TAG_LENGTH = 64


class WandbTracker:
    def __init__(
        self,
        run_dir: str | Path,
        run_info: dict[str, Any],
        project: str = "rlexp",
        entity: str | None = None,
        group: str | None = None,
        tags: list[str] | None = None,
        mode: str | None = None,
    ):
        """``group``: else the multirun sweep; ``mode``: else ``$WANDB_MODE``, else ``online`` with
        credentials (``WANDB_API_KEY`` or a netrc entry for the W&B host) and ``offline`` without."""
        self.run_dir = Path(run_dir)
        state_path = self.run_dir / "tracking" / "wandb.json"
        state_path.parent.mkdir(parents=True, exist_ok=True)
        if not state_path.exists():
            state_path.write_text(json.dumps({"run_id": uuid.uuid4().hex[:12]}) + "\n")
        self.run_id = json.loads(state_path.read_text())["run_id"]
        self.run = _init_when_free(
            project=project,
            entity=entity,
            group=group or run_info.get("group"),
            tags=[t[:MAX_TAG_LENGTH] for t in redact(tags or [])],
            name=run_info.get("run_name") or self.run_dir.name,
            id=self.run_id,
            resume="allow",
            dir=str(self.run_dir),
            mode=mode or os.environ.get("WANDB_MODE") or ("online" if has_credentials() else "offline"),
            reinit="create_new",  # several runs in one process: a Hydra multirun
            # quiet; no code snapshot; console capture off (Hydra writes the log into the run dir)
            settings=wandb.Settings(silent=True, disable_code=True, console="off"),
        )
        self._step: int | None = None
        #: (key, step) that earlier processes of this run already wrote; see ``resume_from``.
        self._skip: set[tuple[str, int]] = set()

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def set_tags(self, tags: dict[str, str]) -> None:
        """W&B tags are labels: each becomes ``key=value``."""
        new = [f"{k}={v}"[:MAX_TAG_LENGTH] for k, v in tags.items()]
        self.run.tags = tuple(dict.fromkeys([*self.run.tags, *new]))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """W&B drops steps below its last one (a resume from an older checkpoint) with a warning."""
        self._step = step
        metrics = {k: v for k, v in metrics.items() if (k, step) not in self._skip}
        if metrics:
            self.run.log(metrics, step=step)

    def resume_from(self, step: int) -> None:
        """The run continues after checkpoint ``step`` and logs the later steps again; keep each
        (key, step) once in the run's history.

        W&B cannot delete history rows. Online, it drops steps below the run's last one (with a
        warning); offline, each process writes its own ``run-<id>.wandb`` and ``wandb sync`` of all of
        them would store recomputed steps twice. The files are the record of what earlier processes
        wrote (online runs write them too), so their history is read back and a key at a step they
        already hold is not logged again (per key, so a step that a kill cut short is completed). The
        values kept are the first process's: bit-identical for a deterministic resume except wall-clock
        ``timing/*``; ``metrics.jsonl`` holds the resumed run's. A file that cannot be read is reported
        and ignored (its steps are then logged again).

        A kill -9 also loses what W&B's service had not yet written: rows up to the checkpoint can be
        missing from the files although the run will not compute them again. Those are sent again from
        ``metrics.jsonl`` (written synchronously, and cut to ``step`` just before; pictures of such steps
        are not resent).
        """
        current = Path(self.run.dir).parent.resolve()
        for path in sorted(self.run_dir.glob(f"wandb/*run-*-{self.run_id}*/run-{self.run_id}.wandb")):
            if path.parent.resolve() == current:
                continue
            try:
                self._skip |= history_keys(read_records(path))
            except Exception as error:  # a torn or unknown format: log again rather than fail
                log.warning("W&B: cannot read %s (%s); the steps it holds may be logged twice", path, error)
        if self._skip:
            steps = sorted({s for _, s in self._skip})
            log.info("W&B run %s already has steps %d..%d; they are not logged again", self.run_id, steps[0], steps[-1])
        if step > 0:
            self._backfill(step)

    def _backfill(self, step: int) -> None:
        """Log the metrics of steps up to ``step`` that metrics.jsonl has and the W&B files lack."""
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return
        sent: set[int] = set()
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            at = record.get("step") if isinstance(record, dict) else None
            if not isinstance(at, int) or at > step:
                continue
            values = {k: v for k, v in record.items() if k not in ("step", "time") and (k, at) not in self._skip}
            if values:
                self.run.log(values, step=at)
                self._skip |= {(k, at) for k in values}
                sent.add(at)
        if sent:
            log.warning("W&B lacked steps %s of this run (lost in a kill); sent again from %s", sorted(sent), path)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Pictures go to the history at the last logged step, keyed by their top folder and name
        (``eval/maze_17_png``, so one panel per maze shows every eval); other files become run files."""
        path = Path(path)
        media = MEDIA.get(path.suffix.lower())
        if media is None:
            base = self.run_dir if path.resolve().is_relative_to(self.run_dir.resolve()) else path.parent
            self.run.save(str(path), base_path=str(base), policy="now")
            return
        folder = (artifact_path or default_artifact_path(path, self.run_dir) or "media").split("/")[0]
        key = f"{folder}/{path.stem}_{path.suffix[1:].lower()}"
        if (key, self._step) in self._skip:
            return
        if self._step is None:
            self.run.log({key: media(str(path))}, commit=False)
        else:
            self.run.log({key: media(str(path))}, step=self._step)

    def finish(self, status: Status = "FINISHED") -> None:
        """KILLED (a preemption) is W&B's "preempted" state: marked preempting, ending with SIGTERM's 143."""
        if status == "KILLED":
            self.run.mark_preempting()
        self.run.finish(exit_code={"FINISHED": 0, "FAILED": 1, "KILLED": 143}[status])


#: how long a resumed run waits for W&B to release its run id (see ``_init_when_free``).
RUN_ID_RELEASE_S = 90


def _init_when_free(**kwargs):
    """``wandb.init``, retried while W&B says the run id is in use: after a kill -9, the killed process's
    W&B service holds the run until it notices its parent is gone, and a resume must not fail on that."""
    deadline = time.monotonic() + RUN_ID_RELEASE_S
    while True:
        try:
            return wandb.init(**kwargs)
        except Exception as error:  # W&B raises its own ServerResponseError here
            if "in use" not in str(error) or time.monotonic() > deadline:
                raise
            log.info("W&B run %s is still held by a previous process; retrying", kwargs.get("id"))
            time.sleep(2)


def has_credentials() -> bool:
    """``WANDB_API_KEY``, or a netrc entry (``$NETRC`` or ``~/.netrc``) for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC") or str(Path.home() / ".netrc")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def read_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """The records of a ``run-<id>.wandb`` file: a 7-byte header, then LevelDB-log blocks of 32 KiB whose
    chunks (checksum u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) carry ``Record`` protos.
    A record torn by a kill at the end of the file is left out."""
    data, block, records, pending = Path(path).read_bytes(), 32768, [], b""
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log")
    pos = 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in this block for a chunk header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 or pos + 7 + length > len(data):
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history_keys(records) -> set[tuple[str, int]]:
    """(top-level key, step) of every history row's items, W&B's own ``_``-keys left out."""
    found = set()
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        items = {(list(item.nested_key) or [item.key])[0]: item.value_json for item in record.history.item}
        if "_step" not in items:
            continue
        step = int(json.loads(items["_step"]))
        found |= {(key, step) for key in items if not key.startswith("_")}
    return found
