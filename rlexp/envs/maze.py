"""Maze layouts: the ``Maze`` record, Wilson's-algorithm generation and the BFS expert.

Rules follow VisGym's ``maze_2d``: the grid is square and odd-sized and includes the outer wall ring
(easy 9x9, hard 11x11); rooms sit at odd coordinates, so a 9x9 maze is a 4x4 grid of rooms joined
by one-cell corridors, carved as a uniform spanning tree by Wilson's loop-erased random walk. The
agent and the goal sit in opposite corners of the inner area. Coordinates are ``(row, col)``.
"""

from __future__ import annotations

import hashlib
import struct
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlexp.envs.rng import SplitMix64

MOVE_RIGHT, MOVE_UP, MOVE_LEFT, MOVE_DOWN, STOP = 0, 1, 2, 3, 4
NUM_ACTIONS = 5
#: (d_row, d_col) per action; STOP does not move. Index with an action int.
ACTION_DELTAS = np.array([[0, 1], [-1, 0], [0, -1], [1, 0], [0, 0]], dtype=np.int64)
_MOVE_DELTAS = tuple((int(dr), int(dc)) for dr, dc in ACTION_DELTAS[:4])

WALL_CHAR, PATH_CHAR = "#", "."


@dataclass(frozen=True, eq=False)
class Maze:
    """One layout. ``grid`` is (H, W) bool with True = wall; it is stored as a read-only copy.

    Equality compares layout and seed; ``layout_hash`` ignores the seed.
    """

    grid: np.ndarray
    start: tuple[int, int]
    goal: tuple[int, int]
    seed: int | None = None

    def __post_init__(self) -> None:
        grid = np.array(self.grid, dtype=bool)
        grid.flags.writeable = False
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "start", (int(self.start[0]), int(self.start[1])))
        object.__setattr__(self, "goal", (int(self.goal[0]), int(self.goal[1])))
        h, w = grid.shape if grid.ndim == 2 else (0, 0)
        if grid.ndim != 2 or h != w or h < 5 or h % 2 == 0:
            raise ValueError(f"maze grid must be square with an odd side >= 5, got shape {grid.shape}")
        # The wall ring is what lets stepping skip bounds checks.
        if not (grid[0].all() and grid[-1].all() and grid[:, 0].all() and grid[:, -1].all()):
            raise ValueError("maze grid must have an outer ring of walls")
        for name, (r, c) in (("start", self.start), ("goal", self.goal)):
            if not (0 <= r < h and 0 <= c < w) or grid[r, c]:
                raise ValueError(f"maze {name} {(r, c)} must be a path cell inside the grid")

    @property
    def size(self) -> int:
        return self.grid.shape[0]

    def layout_hash(self) -> str:
        """sha256 hex of (H, W, grid bytes, start, goal); identifies a layout whatever its seed."""
        h = hashlib.sha256(struct.pack("<2q", *self.grid.shape))
        h.update(self.grid.astype(np.uint8).tobytes())
        h.update(struct.pack("<4q", *self.start, *self.goal))
        return h.hexdigest()

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form: grid rows as strings of ``#`` (wall) and ``.`` (path)."""
        rows = ["".join(WALL_CHAR if v else PATH_CHAR for v in row) for row in self.grid]
        return {"grid": rows, "start": list(self.start), "goal": list(self.goal), "seed": self.seed}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Maze:
        rows = data["grid"]
        if any(set(row) - {WALL_CHAR, PATH_CHAR} for row in rows):
            raise ValueError(f"maze grid rows may only contain {WALL_CHAR!r} and {PATH_CHAR!r}")
        grid = np.array([[ch == WALL_CHAR for ch in row] for row in rows], dtype=bool)
        return cls(grid=grid, start=tuple(data["start"]), goal=tuple(data["goal"]), seed=data.get("seed"))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Maze):
            return NotImplemented
        return (
            self.seed == other.seed
            and self.start == other.start
            and self.goal == other.goal
            and np.array_equal(self.grid, other.grid)
        )

    def __hash__(self) -> int:
        return hash((self.layout_hash(), self.seed))


def generate_maze(size: int, seed: int) -> Maze:
    """Carve a ``size`` x ``size`` maze (wall ring included) with Wilson's algorithm.

    Deterministic in ``seed`` on every platform: all randomness comes from ``SplitMix64(seed)``.
    Draw order: the first tree cell, then per walk a start cell among the unvisited (row-major
    list) and a direction among the in-bounds ones (order right, up, left, down), and last the
    corner pairing, one of VisGym's four: (1,1)->(n-2,n-2), (n-2,n-2)->(1,1), (n-2,1)->(1,n-2),
    (1,n-2)->(n-2,1).
    """
    if size < 5 or size % 2 == 0:
        raise ValueError(f"maze size must be odd and at least 5 (it includes the wall ring), got {size}")
    rng = SplitMix64(seed)
    rooms = (size - 1) // 2
    grid = np.ones((size, size), dtype=bool)
    in_tree = [[False] * rooms for _ in range(rooms)]
    unvisited = [(r, c) for r in range(rooms) for c in range(rooms)]

    def carve_room(cell: tuple[int, int]) -> None:
        in_tree[cell[0]][cell[1]] = True
        unvisited.remove(cell)
        grid[2 * cell[0] + 1, 2 * cell[1] + 1] = False

    carve_room(unvisited[rng.below(len(unvisited))])
    while unvisited:
        first = unvisited[rng.below(len(unvisited))]
        # Random walk until the tree is hit; overwriting the exit direction erases loops.
        exit_dir: dict[tuple[int, int], tuple[int, int]] = {}
        cell = first
        while not in_tree[cell[0]][cell[1]]:
            options = [(dr, dc) for dr, dc in _MOVE_DELTAS if 0 <= cell[0] + dr < rooms and 0 <= cell[1] + dc < rooms]
            step = options[rng.below(len(options))]
            exit_dir[cell] = step
            cell = (cell[0] + step[0], cell[1] + step[1])
        cell = first
        while not in_tree[cell[0]][cell[1]]:
            dr, dc = exit_dir[cell]
            carve_room(cell)
            grid[2 * cell[0] + 1 + dr, 2 * cell[1] + 1 + dc] = False
            cell = (cell[0] + dr, cell[1] + dc)

    far = size - 2
    pairings = (((1, 1), (far, far)), ((far, far), (1, 1)), ((far, 1), (1, far)), ((1, far), (far, 1)))
    start, goal = pairings[rng.below(4)]
    return Maze(grid=grid, start=start, goal=goal, seed=seed)


def distance_map(grid: np.ndarray, target: tuple[int, int]) -> np.ndarray:
    """BFS distance (in moves) from every cell to ``target``; -1 for walls and unreachable cells."""
    h, w = grid.shape
    dist = np.full((h, w), -1, dtype=np.int64)
    dist[target] = 0
    queue = deque([target])
    while queue:
        r, c = queue.popleft()
        for dr, dc in _MOVE_DELTAS:
            nr, nc = r + dr, c + dc
            if 0 <= nr < h and 0 <= nc < w and not grid[nr, nc] and dist[nr, nc] < 0:
                dist[nr, nc] = dist[r, c] + 1
                queue.append((nr, nc))
    return dist


def greedy_move(dist: np.ndarray, pos: tuple[int, int]) -> int:
    """The move that decreases ``dist`` (from ``distance_map``) at ``pos``, or STOP at the target.

    Ties (impossible in a perfect maze) go to the lowest action number.
    """
    here = dist[pos]
    if here == 0:
        return STOP
    if here < 0:
        raise ValueError(f"position {pos} cannot reach the target")
    for action, (dr, dc) in enumerate(_MOVE_DELTAS):
        if dist[pos[0] + dr, pos[1] + dc] == here - 1:
            return action
    raise AssertionError("unreachable: a BFS distance map always has a descending neighbour")


def shortest_path(maze: Maze) -> list[int]:
    """BFS expert moves from start to goal (STOP not included)."""
    dist = distance_map(maze.grid, maze.goal)
    if dist[maze.start] < 0:
        raise ValueError("maze goal is unreachable from its start")
    moves, pos = [], maze.start
    while pos != maze.goal:
        action = greedy_move(dist, pos)
        moves.append(action)
        pos = (pos[0] + _MOVE_DELTAS[action][0], pos[1] + _MOVE_DELTAS[action][1])
    return moves


def min_expert_steps(size: int) -> int:
    """The fewest steps any maze of this size needs: agent and goal sit in opposite inner corners, so
    at least the Manhattan distance 2·(size − 3) in moves, plus ``stop``."""
    return 2 * (size - 3) + 1


def expert_actions(maze: Maze) -> list[int]:
    """Shortest path followed by STOP: what the SFT data and the expert policy do."""
    return shortest_path(maze) + [STOP]
