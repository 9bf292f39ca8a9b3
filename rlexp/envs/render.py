"""RGB rendering of mazes, VisGym ``maze_2d`` style, in NumPy.

Paths white, walls gray (169,169,169), the goal a full red cell, the agent a blue filled circle
of radius ``0.24 * cell_px`` (6 px at 25 px per cell) centred in its cell, no grid lines. A pixel
belongs to the circle when its centre lies within the radius of the cell centre.

The image is a mosaic of ``cell_px`` x ``cell_px`` tiles, one of five kinds per cell
(path, wall, goal, agent on path, agent on goal); tiles are precomputed once per ``cell_px``.
``render`` draws a whole image; ``BatchRenderer`` keeps a (B, H, W, 3) buffer and on a move redraws
only the two cells that changed, with output byte-identical to ``render``.

Unlike VisGym's pygame canvas, which erases the agent by painting a white disc (so a goal cell
the agent has left keeps a white hole), an image here depends only on (maze, agent position).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from rlexp.envs.maze import Maze

PATH_RGB = (255, 255, 255)
WALL_RGB = (169, 169, 169)
GOAL_RGB = (255, 0, 0)
AGENT_RGB = (0, 0, 255)
AGENT_RADIUS_FRACTION = 0.24

TILE_PATH, TILE_WALL, TILE_GOAL, TILE_AGENT, TILE_AGENT_ON_GOAL = range(5)


@lru_cache(maxsize=None)
def agent_mask(cell_px: int) -> np.ndarray:
    """(cell_px, cell_px) bool: pixels whose centre is within the agent radius of the cell centre."""
    centres = np.arange(cell_px) + 0.5 - cell_px / 2
    radius = AGENT_RADIUS_FRACTION * cell_px
    mask = centres[:, None] ** 2 + centres[None, :] ** 2 <= radius**2
    mask.flags.writeable = False
    return mask


@lru_cache(maxsize=None)
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


def tiles_to_image(tile_ids: np.ndarray, tiles: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Assemble (..., H, W) tile ids into (..., H*px, W*px, 3) images, into ``out`` if given."""
    *lead, h, w = tile_ids.shape
    px = tiles.shape[1]
    mosaic = tiles[tile_ids]  # (..., H, W, px, px, 3)
    n = len(lead)
    mosaic = mosaic.transpose(*range(n), n, n + 2, n + 1, n + 3, n + 4)
    shape = (*lead, h * px, w * px, 3)
    if out is None:
        return mosaic.reshape(shape)
    out.reshape(*lead, h, px, w, px, 3)[...] = mosaic
    return out


def render(maze: Maze, agent: tuple[int, int], cell_px: int = 25) -> np.ndarray:
    """(H*cell_px, W*cell_px, 3) uint8 image of ``maze`` with the agent at ``agent`` (row, col)."""
    ids = np.where(maze.grid, TILE_WALL, TILE_PATH).astype(np.uint8)
    ids[maze.goal] = TILE_GOAL
    ids[tuple(agent)] = TILE_AGENT_ON_GOAL if tuple(agent) == maze.goal else TILE_AGENT
    return tiles_to_image(ids, cell_tiles(cell_px))


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
        ids = np.where(walls, TILE_WALL, TILE_PATH).astype(np.uint8)
        rows = np.arange(b)
        ids[rows, goals[:, 0], goals[:, 1]] = TILE_GOAL
        on_goal = (agents == goals).all(axis=1)
        ids[rows, agents[:, 0], agents[:, 1]] = np.where(on_goal, TILE_AGENT_ON_GOAL, TILE_AGENT)
        if self._buffer is None or self._buffer.shape != (b, h * px, w * px, 3):
            self._buffer = np.empty((b, h * px, w * px, 3), dtype=np.uint8)
        self._goals = goals.copy()
        return tiles_to_image(ids, self._tiles, out=self._buffer)

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
        cells[episodes, new[:, 0], :, new[:, 1], :] = self._tiles[
            np.where(new_on_goal, TILE_AGENT_ON_GOAL, TILE_AGENT)
        ]
