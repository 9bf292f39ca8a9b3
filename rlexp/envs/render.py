"""RGB rendering of mazes, VisGym ``maze_2d`` style, in NumPy.

Paths white, walls gray (169,169,169), the goal a full red cell, the agent a blue filled circle
of radius ``0.24 * cell_px`` (6 px at 25 px per cell) centred in its cell, no grid lines. A pixel
belongs to the circle when its centre lies within the radius of the cell centre.

The image is a mosaic of ``cell_px`` x ``cell_px`` tiles, one of five kinds per cell
(path, wall, goal, agent on path, agent on goal); tiles are precomputed once per ``cell_px``.
A full frame is drawn by broadcasting one pixel row per row of cells, then pasting the agent.
``render`` draws a whole image; ``BatchRenderer`` keeps a (B, H, W, 3) buffer and on a move redraws
only the two cells that changed, with output byte-identical to ``render``.

Unlike VisGym's pygame canvas, which erases the agent by painting a white disc (so a goal cell
the agent has left keeps a white hole), an image here depends only on (maze, agent position).
"""

from __future__ import annotations

from functools import cache

import numpy as np

from rlexp.envs.maze import Maze

PATH_RGB = (255, 255, 255)
WALL_RGB = (169, 169, 169)
GOAL_RGB = (255, 0, 0)
AGENT_RGB = (0, 0, 255)
AGENT_RADIUS_FRACTION = 0.24

TILE_PATH, TILE_WALL, TILE_GOAL, TILE_AGENT, TILE_AGENT_ON_GOAL = range(5)


@cache
def agent_mask(cell_px: int) -> np.ndarray:
    """(cell_px, cell_px) bool: pixels whose centre is within the agent radius of the cell centre."""
    centres = np.arange(cell_px) + 0.5 - cell_px / 2
    radius = AGENT_RADIUS_FRACTION * cell_px
    mask = centres[:, None] ** 2 + centres[None, :] ** 2 <= radius**2
    mask.flags.writeable = False
    return mask


@cache
def cell_tiles(cell_px: int) -> np.ndarray:
    """(5, cell_px, cell_px, 3) uint8 tiles indexed by the ``TILE_*`` constants (read-only)."""
    if cell_px < 1:
        raise ValueError(f"cell_px must be positive, got {cell_px}")
    tiles = np.empty((5, cell_px, cell_px, 3), dtype=np.uint8)
    for kind, rgb in ((TILE_PATH, PATH_RGB), (TILE_WALL, WALL_RGB), (TILE_GOAL, GOAL_RGB)):
        tiles[kind] = rgb
    tiles[TILE_AGENT] = tiles[TILE_PATH]
    tiles[TILE_AGENT_ON_GOAL] = tiles[TILE_GOAL]
    mask = agent_mask(cell_px)
    tiles[TILE_AGENT][mask] = AGENT_RGB
    tiles[TILE_AGENT_ON_GOAL][mask] = AGENT_RGB
    tiles.flags.writeable = False
    return tiles


def _draw(walls: np.ndarray, goals: np.ndarray, agents: np.ndarray, cell_px: int, out: np.ndarray) -> np.ndarray:
    """Draw B frames into ``out`` (B, H*px, W*px, 3).

    Without the agent, all ``cell_px`` pixel rows of a row of cells are identical: build that one
    pixel row per row of cells and broadcast it, then paste the agent tile.
    """
    b, h, w = walls.shape
    rows = np.arange(b)
    ids = walls.astype(np.intp)  # TILE_PATH = 0, TILE_WALL = 1
    ids[rows, goals[:, 0], goals[:, 1]] = TILE_GOAL
    tiles = cell_tiles(cell_px)
    tile_rows = tiles[:3, 0].reshape(3, cell_px * 3)  # first pixel row of the uniform tiles
    out.reshape(b, h, cell_px, w * cell_px * 3)[...] = tile_rows[ids].reshape(b, h, 1, w * cell_px * 3)
    cells = out.reshape(b, h, cell_px, w, cell_px, 3)  # a view: cells[b, r, :, c, :] is one tile
    on_goal = (agents == goals).all(axis=1)
    cells[rows, agents[:, 0], :, agents[:, 1], :] = tiles[np.where(on_goal, TILE_AGENT_ON_GOAL, TILE_AGENT)]
    return out


def render(maze: Maze, agent: tuple[int, int], cell_px: int = 25) -> np.ndarray:
    """(H*cell_px, W*cell_px, 3) uint8 image of ``maze`` with the agent at ``agent`` (row, col)."""
    h, w = maze.grid.shape
    out = np.empty((1, h * cell_px, w * cell_px, 3), dtype=np.uint8)
    _draw(maze.grid[None], np.array([maze.goal]), np.array([agent]), cell_px, out)
    return out[0]


class BatchRenderer:
    """Images of B mazes in one (B, H*px, W*px, 3) uint8 buffer, updated incrementally."""

    def __init__(self, cell_px: int = 25):
        self.cell_px = cell_px
        self._tiles = cell_tiles(cell_px)
        self._buffer: np.ndarray | None = None
        self._goals: np.ndarray | None = None

    @property
    def images(self) -> np.ndarray:
        """The buffer itself (not a copy): later calls overwrite it."""
        if self._buffer is None:
            raise RuntimeError("BatchRenderer.reset must be called first")
        return self._buffer

    def reset(self, walls: np.ndarray, goals: np.ndarray, agents: np.ndarray) -> np.ndarray:
        """Draw all images from scratch. walls (B,H,W) bool, goals and agents (B,2) int."""
        b, h, w = walls.shape
        px = self.cell_px
        if self._buffer is None or self._buffer.shape != (b, h * px, w * px, 3):
            self._buffer = np.empty((b, h * px, w * px, 3), dtype=np.uint8)
        self._goals = goals.copy()
        return _draw(walls, goals, agents, px, self._buffer)

    def move(self, episodes: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        """Redraw the agent of ``episodes`` (n,) moved from ``old`` to ``new`` (n,2) cells."""
        if len(episodes) == 0:
            return
        buf = self.images
        b, hp, wp, _ = buf.shape
        px = self.cell_px
        cells = buf.reshape(b, hp // px, px, wp // px, px, 3)  # a view: cells[b, r, :, c, :] is a tile
        goals = self._goals[episodes]
        old_on_goal = (old == goals).all(axis=1)
        new_on_goal = (new == goals).all(axis=1)
        cells[episodes, old[:, 0], :, old[:, 1], :] = self._tiles[np.where(old_on_goal, TILE_GOAL, TILE_PATH)]
        cells[episodes, new[:, 0], :, new[:, 1], :] = self._tiles[np.where(new_on_goal, TILE_AGENT_ON_GOAL, TILE_AGENT)]
