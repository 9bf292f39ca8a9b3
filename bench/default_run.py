"""Wall time of the default run (`rlexp` with no arguments) and its per-step time split.

    python bench/default_run.py [extra overrides...]

Runs `python -m rlexp` in a fresh run dir (the tiny model's cache is kept, as for a user's second
run; the first run builds it in a few seconds), then reads the run's metrics.jsonl.
"""

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "rlexp", f"hydra.run.dir={run_dir}", *sys.argv[1:]],
            cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wall = time.perf_counter() - start
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "timing/generate_s" in r]
    print(f"default run wall time: {wall:.1f} s ({len(steps)} training steps, 2 evals on the pinned mazes)")
    for key in ("generate_s", "train_s", "sync_s", "generate_tokens_per_s"):
        values = [r[f"timing/{key}"] for r in steps]
        print(f"  per step {key:<22} median {statistics.median(values):8.2f}   min {min(values):8.2f}   max {max(values):8.2f}")
    step_times = [r["timing/generate_s"] + r["timing/train_s"] + r["timing/sync_s"] for r in steps]
    print(f"  step time (generate + train + sync) median {statistics.median(step_times):.2f} s")


if __name__ == "__main__":
    main()
