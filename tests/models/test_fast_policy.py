"""The fast one-image-turn forward equals the transformers model on the rollout's own token layout."""

from pathlib import Path

import numpy as np
import pytest
import torch

from rlexp.envs.actions import format_action
from rlexp.envs.gpu_frames import FrameEncoder
from rlexp.envs.maze import generate_maze
from rlexp.envs.prompts import instructions, step_text, turn_text
from rlexp.envs.render import render
from rlexp.models.fast_policy import FastTurnForward, TurnLayout, mrope_position_ids, variant_index

pytest.importorskip("torchvision")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    from rlexp.models.tiny import build_tiny_model

    path = build_tiny_model(Path(tmp_path_factory.mktemp("tiny")))
    model = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(path)


@pytest.fixture(scope="module")
def layout(tiny):
    return TurnLayout.build(tiny[1], size=9, cell_px=32, max_steps=20)


def test_layout_rows_equal_the_rollout_context(tiny, layout):
    from rlexp.rollout.conversation import Trajectory, Turn, TurnFormatter, context_tokens

    _, processor = tiny
    formatter = TurnFormatter(processor)
    eos = formatter.eos_id
    maze = generate_maze(9, 3)
    image = render(maze, maze.start, cell_px=32)
    cases = [(0, None), (1, 0), (7, 1), (9, 0), (10, 1), (19, 0)]
    for step, fb in cases:
        text = step_text(0, 20) if step == 0 else turn_text(layout.feedback_texts[fb], step, 20)
        action = step % 5
        reply = processor.tokenizer.encode(format_action(action, "visgym_tuple"), add_special_tokens=False) + [eos]
        turns = [Turn(image=image, text="x", response_ids=[5, eos]) for _ in range(step)]
        turns.append(Turn(image=image, text=text, response_ids=reply))
        traj = Trajectory(0, 0, instructions("visgym", "visgym_tuple", 9), turns=turns)
        seq = context_tokens(formatter, traj, step, history_window=1, include_reply=True)
        v = variant_index(step, fb or 0)
        ids, pred = layout.batch(torch.tensor([v]), torch.tensor([action]))
        n = int(layout.lengths[v])
        assert ids[0, :n].tolist() == seq.token_ids
        assert seq.loss_mask[int(pred[0]) + 1 :] == [1, 1]  # the action token and EOS are the reply


def test_position_ids_equal_get_rope_index(tiny, layout):
    model, _ = tiny
    ids = layout.ids[:3]
    kwargs = dict(image_grid_thw=torch.tensor([[1, 18, 18]] * 3))
    import inspect

    if "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters:
        kwargs["mm_token_type_ids"] = (ids == layout.image_token_id).int()
    ref, _ = model.model.get_rope_index(ids, **kwargs)
    assert torch.equal(ref, layout.position_ids.expand(3, 3, -1))
    assert torch.equal(mrope_position_ids(10, 2, 2, 3)[:, -1], torch.tensor([6, 6, 6]))


def test_fast_forward_equals_model(tiny, layout):
    model, processor = tiny
    enc = FrameEncoder.from_processor(processor, 9, 32)
    mazes = [generate_maze(9, 40 + i) for i in range(4)]
    walls = np.stack([m.grid for m in mazes])
    goals = np.array([m.goal for m in mazes])
    agents = np.array([mazes[0].start, mazes[1].goal, mazes[2].start, mazes[3].start])
    pixel_values, grid_thw = enc.encode(walls, agents, goals)
    fast = FastTurnForward(model, layout, pixel_values[: enc.patches_per_image], grid_thw[:1])
    variants = torch.tensor([0, variant_index(3, 1), variant_index(12, 0), variant_index(19, 1)])
    actions = torch.tensor([0, 2, 4, 3])
    ids, pred = layout.batch(variants, actions)
    select = torch.stack([pred, pred + 1], dim=1)
    with torch.no_grad():
        got = fast(ids, pixel_values, select)
        for i in range(4):
            n = int(layout.lengths[variants[i]])
            kwargs = {}
            import inspect

            if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
                kwargs["mm_token_type_ids"] = (ids[i : i + 1, :n] == layout.image_token_id).int()
            ref = model(
                input_ids=ids[i : i + 1, :n],
                pixel_values=pixel_values[i * enc.patches_per_image : (i + 1) * enc.patches_per_image],
                image_grid_thw=grid_thw[i : i + 1],
                **kwargs,
            ).logits[0, select[i]]
            assert (got[i] - ref).abs().max().item() < 1e-4
