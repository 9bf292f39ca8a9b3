"""The pinned evaluation sets and the stream of training mazes that avoids them.

Rule: per difficulty, the first 64 mazes of ``generate_maze(size, seed)`` for seeds 0, 1, 2, ...,
skipping any maze whose expert solution (BFS moves + stop) needs more than ``max_steps`` steps,
so every pinned maze is solvable within the limit. The sets live in
``rlexp/envs/data/{name}_pinned.json``; evaluation always reads the file, and ``load_pinned``
refuses a file whose content checksum differs from ``PINNED_SHA256``.

    python -m rlexp.envs.pinned --check   # regenerate in memory and compare with the files
    python -m rlexp.envs.pinned --write   # (re)write the files and print their checksums

The checksum is over canonical JSON (sorted keys, no whitespace), so it survives re-indentation
or line-ending conversion but not a change of any value.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

from rlexp.envs.maze import Maze, expert_actions, generate_maze

PINNED_SETS = {
    "maze_easy": {"difficulty": "easy", "size": 9, "max_steps": 20},
    "maze_hard": {"difficulty": "hard", "size": 11, "max_steps": 30},
}
PINNED_COUNT = 64
PINNED_SHA256 = {
    "maze_easy": "968994d5c11fb11682f5f29524e2464eff8c43f761ef50638c62b27859a93f17",
    "maze_hard": "73774bcd5749f2ef9b437fd4d9c7198bc9bae7b0d70c3f43f4de42929ab00e8b",
}
RULE = (
    "The first {count} mazes of rlexp.envs.maze.generate_maze(size={size}, seed) for seeds 0, 1, 2, ..., "
    "skipping any maze whose expert solution (BFS moves + stop) needs more than max_steps={max_steps} steps."
)

#: training maze seeds are (stream seed + 1) * 2**32 + position: never a pinned seed (< 2**32).
_TRAIN_SEED_STRIDE = 1 << 32


class PinnedSetChanged(RuntimeError):
    """A pinned file's content does not match ``PINNED_SHA256``."""


def _check_name(name: str) -> dict[str, Any]:
    if name not in PINNED_SETS:
        raise ValueError(f"unknown pinned set {name!r}; choose one of {tuple(PINNED_SETS)}")
    return PINNED_SETS[name]


def pinned_path(name: str) -> Path:
    _check_name(name)
    return Path(__file__).parent / "data" / f"{name}_pinned.json"


def content_sha256(data: dict[str, Any]) -> str:
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def build_pinned(name: str) -> dict[str, Any]:
    """Apply the rule with the current generator: the content the file must hold."""
    spec = _check_name(name)
    size, max_steps = spec["size"], spec["max_steps"]
    mazes, skipped, seed = [], [], 0
    while len(mazes) < PINNED_COUNT:
        maze = generate_maze(size, seed)
        expert_length = len(expert_actions(maze))
        if expert_length > max_steps:
            skipped.append(seed)
        else:
            mazes.append({**maze.to_dict(), "expert_length": expert_length, "layout_hash": maze.layout_hash()})
        seed += 1
    return {
        "name": name,
        **spec,
        "count": PINNED_COUNT,
        "rule": RULE.format(count=PINNED_COUNT, **spec),
        "skipped_seeds": skipped,
        "mazes": mazes,
    }


@cache
def _load_verified(name: str) -> dict[str, Any]:
    path = pinned_path(name)
    data = json.loads(path.read_text(encoding="utf-8"))
    actual, expected = content_sha256(data), PINNED_SHA256[name]
    if actual != expected:
        raise PinnedSetChanged(
            f"{path} has changed: content sha256 {actual}, expected {expected}. The pinned evaluation set "
            "must stay fixed so that runs stay comparable; restore the file from git, or if the change is "
            "intended run `python -m rlexp.envs.pinned --write` and update PINNED_SHA256."
        )
    return data


def load_pinned_file(name: str) -> dict[str, Any]:
    """The verified file content (a fresh copy): metadata, rule and per-maze records."""
    return json.loads(json.dumps(_load_verified(name)))


def load_pinned(name: str) -> list[Maze]:
    """The 64 pinned mazes of ``name`` ("maze_easy" or "maze_hard"), in file order."""
    return [Maze.from_dict(record) for record in _load_verified(name)["mazes"]]


def pinned_layout_hashes(name: str) -> frozenset[str]:
    return frozenset(record["layout_hash"] for record in _load_verified(name)["mazes"])


class TrainingMazeStream:
    """Deterministic endless stream of training mazes that never coincide with a pinned maze.

    Position ``i`` uses generator seed ``(seed + 1) * 2**32 + i`` (disjoint from pinned seeds), and a
    maze is skipped if its expert does not fit ``max_steps``, takes fewer than ``min_expert_length``
    steps (stop included), or its ``layout_hash`` is excluded (default: every pinned set). Save
    ``state_dict()`` with a checkpoint to resume the stream.
    """

    #: consecutive draws without a fitting maze after which the length window counts as empty.
    MAX_MISSES = 10_000

    def __init__(
        self, size: int, max_steps: int, seed: int = 0, exclude_hashes: Iterable[str] | None = None,
        min_expert_length: int = 0,
    ):
        if not 0 <= seed < 2**31:
            raise ValueError(f"stream seed must be in [0, 2**31), got {seed}")
        if exclude_hashes is None:
            exclude_hashes = frozenset().union(*(pinned_layout_hashes(name) for name in PINNED_SETS))
        self.size = size
        self.max_steps = max_steps
        self.seed = seed
        self.min_expert_length = min_expert_length
        self.exclude_hashes = frozenset(exclude_hashes)
        self.position = 0

    def maze_seed(self, position: int) -> int:
        return (self.seed + 1) * _TRAIN_SEED_STRIDE + position

    def next_batch(self, n: int) -> list[Maze]:
        batch: list[Maze] = []
        misses = 0
        while len(batch) < n:
            maze = generate_maze(self.size, self.maze_seed(self.position))
            self.position += 1
            fits = self.min_expert_length <= len(expert_actions(maze)) <= self.max_steps
            if fits and maze.layout_hash() not in self.exclude_hashes:
                batch.append(maze)
                misses = 0
            elif (misses := misses + 1) >= self.MAX_MISSES:
                raise ValueError(
                    f"none of {misses} {self.size}x{self.size} mazes drawn in a row has an expert of "
                    f"{self.min_expert_length}..{self.max_steps} steps (stop included); widen the window"
                )
        return batch

    def state_dict(self) -> dict[str, int]:
        return {
            "size": self.size, "max_steps": self.max_steps, "seed": self.seed,
            "min_expert_length": self.min_expert_length, "position": self.position,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        mine = self.state_dict()
        state = {"min_expert_length": 0, **state}  # streams saved before the key existed drew every length
        for key in ("size", "max_steps", "seed", "min_expert_length"):
            if state[key] != mine[key]:
                raise ValueError(f"stream state has {key}={state[key]} but this stream has {key}={mine[key]}")
        self.position = int(state["position"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlexp.envs.pinned", description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="regenerate the files from the rule")
    action.add_argument("--check", action="store_true", help="compare the files with the rule and checksums")
    args = parser.parse_args(argv)
    status = 0
    for name in PINNED_SETS:
        data = build_pinned(name)
        path = pinned_path(name)
        if args.write:
            path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
            print(f"wrote {path}: content sha256 {content_sha256(data)}")
            continue
        on_disk = json.loads(path.read_text(encoding="utf-8"))
        matches_rule = on_disk == data
        matches_sha = content_sha256(on_disk) == PINNED_SHA256[name]
        print(f"{name}: matches rule {matches_rule}, matches PINNED_SHA256 {matches_sha}")
        status |= not (matches_rule and matches_sha)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
