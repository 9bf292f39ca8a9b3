"""Single-core throughput of the maze environment (step+render, reset+render, generation).

    python bench/env_throughput.py [--batch 256] [--seconds 1.0]

Pins itself to one CPU and one BLAS/OpenMP thread. An "episode-step" is one action applied to one
episode plus its frame brought up to date; batched rates count B episode-steps per ``step`` call.
Frames are returned as views of the env's buffer; the "+ copy" row adds copying them out.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402

from rlexp.envs import BatchedMazeEnv, MazeEnv, MazeGymEnv, format_action, generate_maze, render  # noqa: E402


def rate(fn: Callable[[], object], items_per_call: int, seconds: float) -> float:
    """Best of 3 timed runs of ``fn`` repeated for about ``seconds``: items per second."""
    fn()
    calls = 1
    start = time.perf_counter()
    while time.perf_counter() - start < seconds / 10:
        fn()
        calls += 1
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls * 10):
            fn()
        best = min(best, time.perf_counter() - start)
    return calls * 10 * items_per_call / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    b, secs = args.batch, args.seconds
    rng = np.random.default_rng(0)
    rows: list[tuple[str, float, str]] = []

    for size in (9, 11):
        side = size * 25
        mazes = [generate_maze(size, seed) for seed in range(b)]
        moves = rng.integers(0, 4, size=(4096, b))  # moves only: episodes never end
        texts = [[format_action(int(a), "visgym_tuple") for a in row] for row in moves[:64]]

        env = BatchedMazeEnv(size, max_steps=10**9)
        env.reset(mazes)
        it = iter(range(10**12))
        rows.append((f"batched step+render, int actions, B={b}", rate(lambda: env.step(moves[next(it) % 4096]), b, secs), f"{side}x{side}"))
        rows.append((f"batched step+render + copy of frames, B={b}", rate(lambda: env.step(moves[next(it) % 4096]).images.copy(), b, secs), f"{side}x{side}"))
        rows.append((f"batched step+render, text actions (parsed), B={b}", rate(lambda: env.step(texts[next(it) % 64]), b, secs), f"{side}x{side}"))
        rows.append((f"batched reset+render, B={b}", rate(lambda: env.reset(mazes), b, secs), f"{side}x{side}"))

        single = MazeEnv(size, max_steps=10**9)
        single.reset(mazes[0])
        rows.append(("unbatched MazeEnv step+render, int action", rate(lambda: single.step(int(moves[next(it) % 4096, 0])), 1, secs), f"{side}x{side}"))
        rows.append(("unbatched MazeEnv reset+render", rate(lambda: single.reset(mazes[0]), 1, secs), f"{side}x{side}"))
        rows.append(("render() full frame from scratch", rate(lambda: render(mazes[0], mazes[0].start), 1, secs), f"{side}x{side}"))
        seeds = iter(range(10**12))
        rows.append(("generate_maze (Wilson, pure Python)", rate(lambda: generate_maze(size, next(seeds)), 1, secs), f"{size}x{size} cells"))

    gym_env = MazeGymEnv(size=9, max_steps=10**9)
    gym_env.reset(seed=0)
    rows.append(("MazeGymEnv.step (obs copied), int action", rate(lambda: gym_env.step(int(moves[next(it) % 4096, 0])), 1, secs), "225x225"))

    print(f"numpy {np.__version__}, 1 thread, pinned to CPU {sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'}")
    print("| measurement | per second | image |")
    print("|---|---:|---|")
    for name, value, image in rows:
        print(f"| {name} | {value:,.0f} | {image} |")


if __name__ == "__main__":
    main()
