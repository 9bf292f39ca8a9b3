"""The entrypoint of a Ray job that ``cluster.launcher=ray`` submitted (``python -m rlexp.ray_job``).

It runs on the cluster, as the job's driver (on the head node): it rebuilds the submitted run from
``$RLEXP_RAY_JOB`` (the resolved config, what rlexp reads of Hydra's config, the run dir on shared
storage), composes nothing, and runs the task as ``rlexp`` would; training then places its ranks as Ray
actors (``rlexp.training.ray_workers``).
"""

import json
import os
import sys

from omegaconf import OmegaConf

from rlexp.cli import run_task
from rlexp.cluster import RAY_JOB_PAYLOAD
from rlexp.config import Config
from rlexp.runtime import log_like_hydra, restore_hydra_context


def main() -> None:
    if RAY_JOB_PAYLOAD not in os.environ:
        sys.exit(f"rlexp.ray_job runs inside a Ray job that rlexp submitted (cluster.launcher=ray); ${RAY_JOB_PAYLOAD} is not set")
    payload = json.loads(os.environ[RAY_JOB_PAYLOAD])
    log_like_hydra()
    if payload["hydra"] is not None:
        restore_hydra_context(payload["hydra"], output_dir=payload["run_dir"])
    cfg = OmegaConf.merge(OmegaConf.structured(Config), payload["config"])
    run_task(cfg)


if __name__ == "__main__":
    main()
