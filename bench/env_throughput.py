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
from collections.abc import Callable  # noqa: E402
from itertools import count  # noqa: E402

import numpy as np  # noqa: E402

from rlexp.envs import BatchedMazeEnv, MazeEnv, MazeGymEnv, format_action, generate_maze, render  # noqa: E402

Row = tuple[str, float, str]


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


def bench_size(size: int, b: int, secs: float) -> list[Row]:
    image = f"{size * 25}x{size * 25}"
    mazes = [generate_maze(size, seed) for seed in range(b)]
    moves = np.random.default_rng(0).integers(0, 4, size=(4096, b))  # moves only: episodes never end
    texts = [[format_action(int(a), "visgym_tuple") for a in row] for row in moves[:64]]
    tick, seeds = count(), count()

    env = BatchedMazeEnv(size, max_steps=10**9)
    env.reset(mazes)
    single = MazeEnv(size, max_steps=10**9)
    single.reset(mazes[0])
    return [
        (f"batched step+render, int actions, B={b}", rate(lambda: env.step(moves[next(tick) % 4096]), b, secs), image),
        (
            f"batched step+render + copy of frames, B={b}",
            rate(lambda: env.step(moves[next(tick) % 4096]).images.copy(), b, secs),
            image,
        ),
        (
            f"batched step+render, text actions (parsed), B={b}",
            rate(lambda: env.step(texts[next(tick) % 64]), b, secs),
            image,
        ),
        (f"batched reset+render, B={b}", rate(lambda: env.reset(mazes), b, secs), image),
        (
            "unbatched MazeEnv step+render, int action",
            rate(lambda: single.step(int(moves[next(tick) % 4096, 0])), 1, secs),
            image,
        ),
        ("unbatched MazeEnv reset+render", rate(lambda: single.reset(mazes[0]), 1, secs), image),
        ("render() full frame from scratch", rate(lambda: render(mazes[0], mazes[0].start), 1, secs), image),
        (
            "generate_maze (Wilson, pure Python)",
            rate(lambda: generate_maze(size, next(seeds)), 1, secs),
            f"{size}x{size} cells",
        ),
    ]


def bench_gym(secs: float) -> Row:
    env = MazeGymEnv(size=9, max_steps=10**9)
    env.reset(seed=0)
    moves = np.random.default_rng(1).integers(0, 4, size=4096).tolist()
    tick = count()
    return (
        "MazeGymEnv.step (obs copied), int action",
        rate(lambda: env.step(moves[next(tick) % 4096]), 1, secs),
        "225x225",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    cpus = "?"
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        cpus = sorted(os.sched_getaffinity(0))
    rows = (
        bench_size(9, args.batch, args.seconds) + bench_size(11, args.batch, args.seconds) + [bench_gym(args.seconds)]
    )
    print(f"numpy {np.__version__}, 1 thread, pinned to CPU {cpus}")
    print("| measurement | per second | image |")
    print("|---|---:|---|")
    for name, value, image in rows:
        print(f"| {name} | {value:,.0f} | {image} |")


if __name__ == "__main__":
    main()
