"""Maze frames drawn and patchified on a torch device, straight into Qwen-VL vision inputs.

``rlexp.envs.render`` draws a frame as a mosaic of ``cell_px`` x ``cell_px`` tiles (path, wall, goal,
agent on path, agent on goal). This module draws the same mosaic with one tensor gather on any torch
device and cuts it into patches in exactly the layout of ``Qwen2VLImageProcessor`` (rescale by 1/255,
normalise with the processor's mean/std, duplicate each frame ``temporal_patch_size`` times, order
patches by merge window): ``pixel_values`` of shape ``(n_images * grid_h * grid_w, 3 * T * P * P)``
and ``image_grid_thw`` ``[[1, grid_h, grid_w], ...]``.

The processor resizes an image to a multiple of ``patch_size * merge_size`` within its min/max pixel
bounds; ``FrameEncoder`` only accepts sizes the processor leaves as they are (it raises otherwise),
e.g. a 9x9 maze at ``cell_px=32`` -> 288x288 -> 18x18 patches -> 9x9 = 81 merged tokens, one per cell.

When ``cell_px == patch_size * merge_size`` each cell is exactly one merge window, so a frame's
patches are a lookup in a (5, merge**2, patch_dim) table of per-tile patch vectors: ``encode`` then
never materialises the image at all.

Inputs are integer grids: ``walls`` (B, H, W) bool, ``agents`` and ``goals`` (B, 2) as (row, col).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from rlexp.envs.render import TILE_AGENT, TILE_AGENT_ON_GOAL, TILE_GOAL, TILE_PATH, TILE_WALL, cell_tiles

__all__ = [
    "FrameEncoder",
    "cell_tile_ids",
    "patchify",
    "qwen_smart_resize",
]


def qwen_smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size ``Qwen2VLImageProcessor`` resizes an image to (its ``smart_resize`` rule)."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def cell_tile_ids(walls: torch.Tensor, agents: torch.Tensor, goals: torch.Tensor) -> torch.Tensor:
    """(B, H, W) long tile ids (``render.TILE_*``) of B frames: path/wall, the goal, the agent on top."""
    b = walls.shape[0]
    rows = torch.arange(b, device=walls.device)
    ids = walls.to(torch.long) * TILE_WALL + (~walls).to(torch.long) * TILE_PATH
    ids[rows, goals[:, 0], goals[:, 1]] = TILE_GOAL
    on_goal = (agents == goals).all(dim=1)
    agent_tile = torch.where(on_goal, TILE_AGENT_ON_GOAL, TILE_AGENT)
    ids[rows, agents[:, 0], agents[:, 1]] = agent_tile
    return ids


def patchify(images: torch.Tensor, patch_size: int, merge_size: int, temporal_patch_size: int) -> torch.Tensor:
    """(B, C, Hp, Wp) normalised frames -> (B * gh * gw, C * T * P * P), as ``Qwen2VLImageProcessor.patchify``."""
    b, c, hp, wp = images.shape
    gh, gw = hp // patch_size, wp // patch_size
    x = images.reshape(b, c, gh // merge_size, merge_size, patch_size, gw // merge_size, merge_size, patch_size)
    x = x.permute(0, 2, 5, 3, 6, 1, 4, 7)  # b, gh/m, gw/m, m, m, c, p, p
    x = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, temporal_patch_size, -1, -1)
    return x.reshape(b * gh * gw, c * temporal_patch_size * patch_size * patch_size)


class FrameEncoder:
    """Draws maze frames and turns them into ``pixel_values`` / ``image_grid_thw`` on ``device``.

    ``from_processor`` reads patch size, merge size, temporal patch size, mean, std and the pixel
    bounds from a Qwen-VL processor (or its image processor).
    """

    def __init__(
        self,
        size: int,
        cell_px: int = 32,
        *,
        patch_size: int = 16,
        merge_size: int = 2,
        temporal_patch_size: int = 2,
        image_mean: Sequence[float] = (0.5, 0.5, 0.5),
        image_std: Sequence[float] = (0.5, 0.5, 0.5),
        min_pixels: int = 4 * 32 * 32,
        max_pixels: int = 256 * 32 * 32,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        side = size * cell_px
        factor = patch_size * merge_size
        target = qwen_smart_resize(side, side, factor, min_pixels, max_pixels)
        if target != (side, side):
            raise ValueError(
                f"a {size}x{size} maze at cell_px={cell_px} is {side}x{side} px, which the image processor resizes "
                f"to {target[0]}x{target[1]}; choose cell_px so that size * cell_px is a multiple of {factor} "
                f"within the processor's pixel bounds [{min_pixels}, {max_pixels}]"
            )
        self.size = size
        self.cell_px = cell_px
        self.patch_size = patch_size
        self.merge_size = merge_size
        self.temporal_patch_size = temporal_patch_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.grid = side // patch_size  # patches per side
        self.patch_dim = 3 * temporal_patch_size * patch_size * patch_size
        self.patches_per_image = self.grid * self.grid
        self.tokens_per_image = self.patches_per_image // (merge_size * merge_size)

        # Normalised tiles (5, 3, px, px), computed in float32 as the processor does: x / 255, then (x - m) / s.
        tiles = torch.from_numpy(np.array(cell_tiles(cell_px))).to(torch.float32)
        tiles = tiles.permute(0, 3, 1, 2) * (1.0 / 255.0)
        mean = torch.tensor(list(image_mean), dtype=torch.float32).view(1, 3, 1, 1)
        std = torch.tensor(list(image_std), dtype=torch.float32).view(1, 3, 1, 1)
        tiles = (tiles - mean) / std
        self._tiles = tiles.to(self.device)  # (5, 3, px, px) float32
        self._table = None
        if cell_px == patch_size * merge_size:
            # A tile is exactly one merge window: its merge*merge patch vectors, in the processor's order.
            self._table = patchify(tiles, patch_size, merge_size, temporal_patch_size).view(
                5, merge_size * merge_size, self.patch_dim
            ).to(self.device, dtype)

    @classmethod
    def from_processor(cls, processor, size: int, cell_px: int = 32, device="cpu", dtype=torch.float32) -> FrameEncoder:
        ip = getattr(processor, "image_processor", processor)
        sz = ip.size
        get = sz.get if isinstance(sz, dict) else (lambda k, d=None: getattr(sz, k, d))
        min_pixels = get("shortest_edge", None) or getattr(ip, "min_pixels", None)
        max_pixels = get("longest_edge", None) or getattr(ip, "max_pixels", None)
        return cls(
            size,
            cell_px,
            patch_size=ip.patch_size,
            merge_size=ip.merge_size,
            temporal_patch_size=ip.temporal_patch_size,
            image_mean=ip.image_mean,
            image_std=ip.image_std,
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            device=device,
            dtype=dtype,
        )

    def _grids(self, walls, agents, goals) -> torch.Tensor:
        walls = torch.as_tensor(walls, device=self.device).to(torch.bool)
        agents = torch.as_tensor(agents, device=self.device).to(torch.long)
        goals = torch.as_tensor(goals, device=self.device).to(torch.long)
        if walls.shape[1:] != (self.size, self.size):
            raise ValueError(f"expected walls of shape (B, {self.size}, {self.size}), got {tuple(walls.shape)}")
        return cell_tile_ids(walls, agents, goals)

    def normalized_frames(self, walls, agents, goals) -> torch.Tensor:
        """(B, 3, H*px, W*px) float32 frames after rescale + normalise (the processor's intermediate)."""
        ids = self._grids(walls, agents, goals)
        b, h, w = ids.shape
        px = self.cell_px
        x = self._tiles[ids]  # (b, h, w, 3, px, px)
        return x.permute(0, 3, 1, 4, 2, 5).reshape(b, 3, h * px, w * px)

    def rgb(self, walls, agents, goals) -> torch.Tensor:
        """(B, H*px, W*px, 3) uint8 frames, pixel for pixel ``render.render``'s picture."""
        ids = self._grids(walls, agents, goals)
        b, h, w = ids.shape
        px = self.cell_px
        tiles = torch.from_numpy(np.array(cell_tiles(px))).to(self.device)  # (5, px, px, 3)
        return tiles[ids].permute(0, 1, 3, 2, 4, 5).reshape(b, h * px, w * px, 3)

    def encode(self, walls, agents, goals) -> tuple[torch.Tensor, torch.Tensor]:
        """``pixel_values`` (B * patches_per_image, patch_dim) and ``image_grid_thw`` (B, 3) long."""
        ids = self._grids(walls, agents, goals)
        b = ids.shape[0]
        if self._table is not None:
            pixel_values = self._table[ids.reshape(b, -1)].reshape(b * self.patches_per_image, self.patch_dim)
        else:
            frames = self.normalized_frames(walls, agents, goals)
            pixel_values = patchify(frames, self.patch_size, self.merge_size, self.temporal_patch_size).to(self.dtype)
        grid_thw = torch.tensor([[1, self.grid, self.grid]], dtype=torch.long, device=self.device).expand(b, 3)
        return pixel_values, grid_thw.contiguous()
