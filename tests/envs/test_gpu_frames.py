"""Device-side maze frames equal the NumPy renderer's picture and the real image processor's patches."""

from pathlib import Path

import numpy as np
import pytest
import torch

from rlexp.envs.gpu_frames import FrameEncoder, qwen_smart_resize
from rlexp.envs.maze import generate_maze
from rlexp.envs.render import render


def _batch(size: int, n: int, seed0: int = 100):
    mazes = [generate_maze(size, seed0 + i) for i in range(n)]
    walls = np.stack([m.grid for m in mazes])
    goals = np.array([m.goal for m in mazes])
    # agent at the start, on the goal (tile "agent on goal") and on some other free cell
    agents = []
    for i, m in enumerate(mazes):
        if i % 3 == 0:
            agents.append(m.start)
        elif i % 3 == 1:
            agents.append(m.goal)
        else:
            free = np.argwhere(~m.grid)
            agents.append(tuple(free[(7 * i) % len(free)]))
    return mazes, walls, np.array(agents), goals


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor

    from rlexp.models.tiny import build_tiny_model

    path = build_tiny_model(Path(tmp_path_factory.mktemp("tiny")))
    return AutoProcessor.from_pretrained(path)


@pytest.mark.parametrize("cell_px", [32, 16, 25])
def test_rgb_matches_numpy_render(cell_px):
    size = 9
    mazes, walls, agents, goals = _batch(size, 6)
    frames = FrameEncoder(size, cell_px, min_pixels=1, max_pixels=10**9, patch_size=1, merge_size=1).rgb(
        walls, agents, goals
    )
    for i, m in enumerate(mazes):
        np.testing.assert_array_equal(frames[i].numpy(), render(m, tuple(agents[i]), cell_px=cell_px))


def test_processor_keeps_288_px_frames(processor):
    ip = processor.image_processor
    assert qwen_smart_resize(288, 288, ip.patch_size * ip.merge_size, ip.size["shortest_edge"], ip.size["longest_edge"]) == (288, 288)


@pytest.mark.parametrize("size,cell_px", [(9, 32), (11, 32), (7, 32), (5, 64)])
def test_pixel_values_match_image_processor(processor, size, cell_px):
    from PIL import Image

    mazes, walls, agents, goals = _batch(size, 5)
    enc = FrameEncoder.from_processor(processor, size, cell_px)
    pixel_values, grid_thw = enc.encode(torch.from_numpy(walls), torch.from_numpy(agents), torch.from_numpy(goals))
    images = [Image.fromarray(render(m, tuple(agents[i]), cell_px=cell_px)) for i, m in enumerate(mazes)]
    ref = processor.image_processor(images=images, return_tensors="pt")
    assert torch.equal(grid_thw, ref["image_grid_thw"])
    assert pixel_values.shape == ref["pixel_values"].shape
    assert (pixel_values - ref["pixel_values"]).abs().max().item() < 1e-5
    if cell_px == 32:
        assert enc.tokens_per_image == size * size  # one merged vision token per maze cell


def test_table_path_equals_generic_path(processor):
    mazes, walls, agents, goals = _batch(9, 4)
    enc = FrameEncoder.from_processor(processor, 9, 32)
    fast, _ = enc.encode(walls, agents, goals)
    enc._table = None
    slow, _ = enc.encode(walls, agents, goals)
    assert torch.equal(fast, slow)


def test_sizes_the_processor_would_resize_are_refused():
    with pytest.raises(ValueError, match="resizes"):
        FrameEncoder(9, 25)  # 225 px -> 224 px
