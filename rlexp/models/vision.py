"""Qwen-VL image preprocessing on the device the model runs on, for frames the processor would not resize.

``Qwen2VLImageProcessor`` on CPU costs about 4 ms a 288 x 288 frame, and its float32 patches take 8x the
frame's bytes (``temporal_patch_size`` copies of each pixel as a float). A GRPO step of 256 episodes x 20
turns at one frame a turn spent most of its minute there. ``FramePatcher`` keeps frames as uint8 and does
the processor's rescale, normalise and patchify where they are used (the same layout, tested against the
processor). Frames the processor would resize (its ``smart_resize`` rule) keep the processor's path.
"""

from __future__ import annotations

import torch

from rlexp.envs.gpu_frames import patchify, qwen_smart_resize


class FramePatcher:
    """The image processor's arithmetic for uint8 (N, H, W, 3) frames of sizes it leaves as they are."""

    def __init__(self, image_processor):
        p = image_processor
        self.patch_size = p.patch_size
        self.merge_size = p.merge_size
        self.temporal_patch_size = p.temporal_patch_size
        self.min_pixels = p.size["shortest_edge"]
        self.max_pixels = p.size["longest_edge"]
        self.resizes = bool(p.do_resize)
        # Each channel maps 256 byte values to floats: one table, computed in float64 then rounded, gives
        # the processor's float32 results bit for bit.
        scale = float(p.rescale_factor) if p.do_rescale else 1.0
        mean = torch.tensor(p.image_mean if p.do_normalize else [0.0] * 3, dtype=torch.float64)
        std = torch.tensor(p.image_std if p.do_normalize else [1.0] * 3, dtype=torch.float64)
        levels = torch.arange(256, dtype=torch.float64)
        self.table = ((levels[None, :] * scale - mean[:, None]) / std[:, None]).to(torch.float32)  # (3, 256)

    def handles(self, height: int, width: int) -> bool:
        """Whether the processor keeps an image of this size as it is (else it resizes: use the processor)."""
        factor = self.patch_size * self.merge_size
        if not self.resizes:
            return height % factor == 0 and width % factor == 0
        return qwen_smart_resize(height, width, factor, self.min_pixels, self.max_pixels) == (height, width)

    def grid_thw(self, height: int, width: int) -> torch.Tensor:
        """(1, 3) long: one frame's (t, h, w) grid of patches."""
        return torch.tensor([[1, height // self.patch_size, width // self.patch_size]], dtype=torch.long)

    def num_tokens(self, height: int, width: int) -> int:
        """``<|image_pad|>`` tokens one frame takes in the prompt (patches / merge_size**2)."""
        return (height // self.patch_size) * (width // self.patch_size) // self.merge_size**2

    def pixel_values(self, frames: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        """uint8 (N, H, W, 3) frames -> float32 (N * gh * gw, 3 * T * P * P) patches on ``device``."""
        x = frames.to(device, non_blocking=True).permute(0, 3, 1, 2).to(torch.long)
        channels = torch.arange(3, device=x.device)[None, :, None, None]
        normalised = self.table.to(x.device)[channels, x]
        return patchify(normalised, self.patch_size, self.merge_size, self.temporal_patch_size)
