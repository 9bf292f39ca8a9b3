"""Weights & Biases tracking: online when credentials exist, else offline into the run dir (``wandb sync``
uploads it later). The W&B run id is kept in ``tracking/wandb.json`` so a resumed run continues it."""

import json
import netrc
import os
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import wandb

from rlexp.tracking.base import Status, default_artifact_path

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
        self.run = wandb.init(
            project=project,
            entity=entity,
            group=group or run_info.get("group"),
            tags=[t[:MAX_TAG_LENGTH] for t in tags or []],
            name=run_info.get("run_name") or self.run_dir.name,
            id=json.loads(state_path.read_text())["run_id"],
            resume="allow",
            dir=str(self.run_dir),
            mode=mode or os.environ.get("WANDB_MODE") or ("online" if has_credentials() else "offline"),
            reinit="create_new",  # several runs in one process: a Hydra multirun
            # quiet; no code snapshot; console capture off (Hydra writes the log into the run dir)
            settings=wandb.Settings(silent=True, disable_code=True, console="off"),
        )
        self._step: int | None = None

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def set_tags(self, tags: dict[str, str]) -> None:
        """W&B tags are labels: each becomes ``key=value``."""
        new = [f"{k}={v}"[:MAX_TAG_LENGTH] for k, v in tags.items()]
        self.run.tags = tuple(dict.fromkeys([*self.run.tags, *new]))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """W&B drops steps below its last one (a resume from an older checkpoint) with a warning."""
        self.run.log(dict(metrics), step=step)
        self._step = step

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
        if self._step is None:
            self.run.log({key: media(str(path))}, commit=False)
        else:
            self.run.log({key: media(str(path))}, step=self._step)

    def finish(self, status: Status = "FINISHED") -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


def has_credentials() -> bool:
    """``WANDB_API_KEY``, or a netrc entry (``$NETRC`` or ``~/.netrc``) for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC") or str(Path.home() / ".netrc")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
