"""Maze generation rules: sizes, wall ring, perfect maze, corners, determinism, expert."""

import hashlib
from collections import Counter

import numpy as np
import pytest

from rlexp.envs.maze import (
    ACTION_DELTAS,
    STOP,
    Maze,
    distance_map,
    expert_actions,
    generate_maze,
    shortest_path,
)
from rlexp.envs.rng import SplitMix64

SEEDS = range(40)


def path_graph(grid):
    """Nodes = path cells, edges = 4-adjacent path-cell pairs."""
    nodes = {(r, c) for r, c in zip(*np.nonzero(~grid))}
    edges = {
        frozenset([(r, c), (r + dr, c + dc)])
        for r, c in nodes
        for dr, dc in ((0, 1), (1, 0))
        if (r + dr, c + dc) in nodes
    }
    return nodes, edges


def test_splitmix64_matches_reference_vector():
    rng = SplitMix64(1234567)
    assert [rng.next_u64() for _ in range(5)] == [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
        4593380528125082431,
        16408922859458223821,
    ]


@pytest.mark.parametrize("size", [5, 9, 11, 15])
def test_size_and_outer_wall_ring(size):
    for seed in SEEDS:
        maze = generate_maze(size, seed)
        assert maze.grid.shape == (size, size) and maze.size == size and maze.grid.dtype == bool
        ring = np.ones((size, size), dtype=bool)
        ring[1:-1, 1:-1] = False
        assert maze.grid[ring].all()
        # Rooms (odd, odd) are always open; pillars (even, even) always walls.
        assert not maze.grid[1::2, 1::2].any()
        assert maze.grid[::2, ::2].all()


@pytest.mark.parametrize("size", [0, 3, 4, 8, 10])
def test_invalid_sizes_rejected(size):
    with pytest.raises(ValueError, match="odd"):
        generate_maze(size, 0)


@pytest.mark.parametrize("size", [5, 9, 11])
def test_wilson_gives_a_perfect_maze(size):
    """All path cells connected and the path graph is a tree (edges = nodes - 1)."""
    for seed in SEEDS:
        maze = generate_maze(size, seed)
        nodes, edges = path_graph(maze.grid)
        reachable = distance_map(maze.grid, maze.start) >= 0
        assert reachable.sum() == len(nodes)
        assert len(edges) == len(nodes) - 1


def test_wilson_is_uniform_over_spanning_trees():
    """2x2 rooms have 4 spanning trees (drop one side of the square); each should be ~1/4."""
    counts = Counter(generate_maze(5, seed).grid.tobytes() for seed in range(4000))
    assert len(counts) == 4
    assert all(850 < n < 1150 for n in counts.values()), counts


def test_start_and_goal_in_opposite_inner_corners():
    pairings = Counter()
    for seed in range(400):
        maze = generate_maze(9, seed)
        corners = {(1, 1), (1, 7), (7, 1), (7, 7)}
        assert maze.start in corners and maze.goal in corners
        assert maze.goal == (8 - maze.start[0], 8 - maze.start[1])
        pairings[maze.start] += 1
    assert len(pairings) == 4 and min(pairings.values()) > 60


@pytest.mark.parametrize(
    "size, seed, grid_sha, start, goal",
    [
        (9, 0, "e511df7277e84029e7fd9da8418c3060b37d8546cbd24bfd2f4999bd0108291e", (7, 1), (1, 7)),
        (9, 1, "7353641b4f7dba97e56c823b44862b753daeeffe5df0cdb1447f2985ad2b1c13", (1, 1), (7, 7)),
        (11, 0, "2709091b545833d7fb1f0c1dd7e7a5abc9569af27b9ba332cc3f5a39b6fbd1a5", (1, 1), (9, 9)),
        (11, 12345, "ffce6eac6d386c4b746214510d2b2ca652573c84dc678dd4abe8f7e3918bc27d", (1, 1), (9, 9)),
    ],
)
def test_generation_is_pinned_to_known_layouts(size, seed, grid_sha, start, goal):
    """Any change to the generator or its PRNG changes these and invalidates the pinned sets."""
    maze = generate_maze(size, seed)
    assert hashlib.sha256(maze.grid.tobytes()).hexdigest() == grid_sha
    assert (maze.start, maze.goal, maze.seed) == (start, goal, seed)


def test_generation_is_deterministic_and_seed_sensitive():
    assert generate_maze(11, 7) == generate_maze(11, 7)
    assert len({generate_maze(9, s).layout_hash() for s in range(50)}) > 45


def test_layout_hash_ignores_seed_and_sees_start_goal():
    maze = generate_maze(9, 3)
    same_layout = Maze(maze.grid, maze.start, maze.goal, seed=None)
    assert same_layout.layout_hash() == maze.layout_hash() and same_layout != maze
    swapped = Maze(maze.grid, maze.goal, maze.start, seed=3)
    assert swapped.layout_hash() != maze.layout_hash()


def test_dict_round_trip_and_grid_read_only():
    maze = generate_maze(11, 5)
    data = maze.to_dict()
    assert data["grid"][0] == "#" * 11 and set("".join(data["grid"])) == {"#", "."}
    assert Maze.from_dict(data) == maze and hash(Maze.from_dict(data)) == hash(maze)
    with pytest.raises(ValueError):
        maze.grid[1, 1] = True


def test_invalid_layouts_rejected():
    good = ["#####", "#...#", "###.#", "#...#", "#####"]
    Maze.from_dict({"grid": good, "start": [1, 1], "goal": [3, 1]})
    with pytest.raises(ValueError, match="ring"):
        Maze.from_dict({"grid": ["#####", "....#", "###.#", "#...#", "#####"], "start": [1, 1], "goal": [3, 1]})
    with pytest.raises(ValueError, match="path cell"):
        Maze.from_dict({"grid": good, "start": [2, 1], "goal": [3, 1]})
    with pytest.raises(ValueError, match="square"):
        Maze.from_dict({"grid": good[:4], "start": [1, 1], "goal": [3, 1]})


@pytest.mark.parametrize("size", [9, 11])
def test_expert_is_a_shortest_path_then_stop(size):
    for seed in SEEDS:
        maze = generate_maze(size, seed)
        moves = shortest_path(maze)
        assert expert_actions(maze) == moves + [STOP]
        assert len(moves) == distance_map(maze.grid, maze.goal)[maze.start]
        pos = np.array(maze.start)
        for move in moves:
            pos = pos + ACTION_DELTAS[move]
            assert not maze.grid[tuple(pos)]
        assert tuple(pos) == maze.goal
