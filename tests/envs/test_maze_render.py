"""Rendering: image size, colours, agent circle, incremental batch rendering == full render."""

import numpy as np
import pytest

from rlexp.envs.batch import BatchedMazeEnv
from rlexp.envs.maze import Maze, generate_maze
from rlexp.envs.render import AGENT_RGB, GOAL_RGB, PATH_RGB, WALL_RGB, BatchRenderer, agent_mask, render
from rlexp.envs.rng import SplitMix64


def cell(img, rc, px=25):
    r, c = rc
    return img[r * px : (r + 1) * px, c * px : (c + 1) * px]


@pytest.mark.parametrize("size, side", [(9, 225), (11, 275)])
def test_image_size_and_dtype(size, side):
    maze = generate_maze(size, 0)
    img = render(maze, maze.start)
    assert img.shape == (side, side, 3) and img.dtype == np.uint8


def test_cell_colours_without_grid_lines():
    maze = generate_maze(9, 0)
    img = render(maze, maze.start)
    for r in range(9):
        for c in range(9):
            if (r, c) in (maze.start, maze.goal):
                continue
            expected = WALL_RGB if maze.grid[r, c] else PATH_RGB
            assert (cell(img, (r, c)) == expected).all(), (r, c)
    assert (cell(img, maze.goal) == GOAL_RGB).all()


def test_agent_is_a_centred_blue_disc_of_radius_about_6px():
    maze = generate_maze(9, 0)
    agent_cell = cell(render(maze, maze.start), maze.start)
    blue = (agent_cell == AGENT_RGB).all(axis=-1)
    assert (agent_cell[~blue] == PATH_RGB).all()
    rows, cols = np.nonzero(blue)
    assert abs(rows.mean() - 12) < 0.01 and abs(cols.mean() - 12) < 0.01
    assert 12 <= blue[12].sum() <= 13 and 12 <= blue[:, 12].sum() <= 13  # diameter ~ 2 * 6 px
    assert abs(blue.sum() - np.pi * 6**2) < 10
    assert np.array_equal(blue, agent_mask(25))


def test_agent_on_goal_is_drawn_over_red():
    maze = generate_maze(9, 0)
    goal_cell = cell(render(maze, maze.goal), maze.goal)
    blue = (goal_cell == AGENT_RGB).all(axis=-1)
    assert np.array_equal(blue, agent_mask(25)) and (goal_cell[~blue] == GOAL_RGB).all()
    assert (cell(render(maze, maze.goal), maze.start) == PATH_RGB).all()


@pytest.mark.parametrize("cell_px", [1, 8, 25, 32])
def test_other_cell_sizes(cell_px):
    maze = generate_maze(11, 2)
    img = render(maze, maze.start, cell_px=cell_px)
    assert img.shape == (11 * cell_px, 11 * cell_px, 3)
    assert (img == AGENT_RGB).all(axis=-1).sum() == agent_mask(cell_px).sum() > 0


@pytest.mark.parametrize("size", [9, 11])
def test_batched_render_is_byte_identical_to_render(size):
    """Random rollouts (walls, goal visits, stop) in a batch; every frame equals ``render``."""
    mazes = [generate_maze(size, seed) for seed in range(24)]
    # Half the agents start next to the goal so that stepping onto and off it is exercised.
    starts = []
    for i, m in enumerate(mazes):
        if i % 2:
            free = [(m.goal[0] + dr, m.goal[1] + dc) for dr, dc in ((0, 1), (1, 0), (0, -1), (-1, 0))]
            start = next(p for p in free if not m.grid[p])
            m = Maze(m.grid, start, m.goal, m.seed)
        starts.append(m)
    env = BatchedMazeEnv(size, max_steps=60)
    images = env.reset(starts)
    rng = SplitMix64(11)
    for _ in range(60):
        for i, m in enumerate(starts):
            assert np.array_equal(images[i], render(m, tuple(env.agent_pos[i])))
        if env.done.all():
            break
        actions = np.array([rng.below(5) if rng.random() < 0.97 else 4 for _ in starts])
        images = env.step(actions).images


def test_batch_renderer_reset_resizes_buffer():
    renderer = BatchRenderer(25)
    for b, size in ((3, 9), (5, 11)):
        mazes = [generate_maze(size, s) for s in range(b)]
        walls = np.stack([m.grid for m in mazes])
        goals = np.array([m.goal for m in mazes])
        starts = np.array([m.start for m in mazes])
        imgs = renderer.reset(walls, goals, starts)
        assert imgs.shape == (b, size * 25, size * 25, 3)
        assert all(np.array_equal(imgs[i], render(m, m.start)) for i, m in enumerate(mazes))
