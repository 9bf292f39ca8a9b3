"""What the model sees of the env: VisGym's JPEG frames, and which settings ``auto`` picks."""

import base64
import io

import numpy as np
import pytest
from PIL import Image

from rlexp.envs import (
    IMAGE_FORMATS,
    MazeEnv,
    ModelView,
    SkyRLMazeEnv,
    encode_frame,
    expert_actions,
    generate_maze,
    load_pinned,
    model_frame,
    render,
)
from rlexp.envs.render import GOAL_RGB


def _visgym_jpeg_bytes(frame: np.ndarray) -> bytes:
    """VisGym's ``Interactor._image_to_b64`` as ``run_inference.py`` builds it (no ``image_quality``)."""
    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="JPEG")
    return buf.getvalue()


def _pil_round_trip(frame: np.ndarray, quality: int) -> np.ndarray:
    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="JPEG", quality=quality)
    return np.asarray(Image.open(buf).convert("RGB"))


def test_jpeg_frames_are_visgyms_bytes_and_pils_quality_75_round_trip():
    maze = generate_maze(9, 3)
    frame = render(maze, maze.start)
    assert encode_frame(frame, "jpeg") == _visgym_jpeg_bytes(frame)
    seen = model_frame(frame, "jpeg")
    assert seen.shape == frame.shape and seen.dtype == np.uint8
    np.testing.assert_array_equal(seen, _pil_round_trip(frame, 75))
    assert not np.array_equal(seen, _pil_round_trip(frame, 95))


def test_jpeg_changes_about_a_sixth_of_the_pixels():
    """The issue measured 16.5%; the first frames of the pinned easy set average 15.95% (15.0-16.8%)."""
    shares = []
    for maze in load_pinned("maze_easy"):
        frame = render(maze, maze.start)
        shares.append((model_frame(frame, "jpeg") != frame).any(axis=-1).mean())
    assert 0.145 < np.mean(shares) < 0.185
    assert min(shares) > 0.10 and max(shares) < 0.20


def test_png_is_the_exact_frame_and_a_copy():
    maze = generate_maze(9, 3)
    frame = render(maze, maze.start)
    seen = model_frame(frame, "png")
    np.testing.assert_array_equal(seen, frame)
    assert not np.shares_memory(seen, frame)
    decoded = np.asarray(Image.open(io.BytesIO(encode_frame(frame, "png"))))
    np.testing.assert_array_equal(decoded, frame)


def test_only_the_models_copy_is_encoded_and_the_goal_cell_stays_whole():
    """The env's buffer stays the exact render; after the agent leaves the goal, the goal cell is red
    throughout in both (VisGym's pygame canvas leaves a white hole there)."""
    maze = generate_maze(9, 5)
    env = MazeEnv(9, 40)
    env.reset(maze)
    moves = expert_actions(maze)[:-1]
    for action in moves:
        env.step(int(action))
    back = {0: 2, 1: 3, 2: 0, 3: 1}[int(moves[-1])]
    env.step(back)  # step off the goal
    assert env.agent_pos != maze.goal and env.steps == len(moves) + 1
    exact = env.image.copy()
    seen = model_frame(exact, "jpeg")
    np.testing.assert_array_equal(env.image, exact)
    np.testing.assert_array_equal(exact, render(maze, env.agent_pos))
    r, c = maze.goal
    inner = (slice(r * 25 + 4, r * 25 + 21), slice(c * 25 + 4, c * 25 + 21))
    assert (exact[inner] == GOAL_RGB).all()
    assert np.abs(seen[inner].astype(int) - GOAL_RGB).max() < 40  # JPEG-red, no white hole


def test_unknown_image_format_names_the_choices():
    frame = np.zeros((25, 25, 3), dtype=np.uint8)
    for call in (lambda: model_frame(frame, "gif"), lambda: encode_frame(frame, "gif")):
        with pytest.raises(ValueError, match="jpeg.*png"):
            call()
    assert IMAGE_FORMATS == ("jpeg", "png")


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("visgym", ModelView("jpeg", "visgym", True)),
        ("skyrl_instruct", ModelView("png", "last_k", False)),
    ],
)
def test_auto_follows_the_prompt_style(prompt, expected):
    assert ModelView.resolve(prompt) == expected
    assert ModelView.resolve(prompt, "auto", "auto", None) == expected


def test_explicit_settings_win_over_auto():
    view = ModelView.resolve("visgym", image_format="png", history_style="last_k", elicit_verbalization=False)
    assert view == ModelView("png", "last_k", False)
    assert ModelView.resolve("skyrl_instruct", "jpeg", "visgym", True) == ModelView("jpeg", "visgym", True)
    with pytest.raises(ValueError, match="visgym.*last_k"):
        ModelView.resolve("visgym", history_style="window")


def test_skyrl_adapter_sends_visgym_jpeg_and_elicits_for_the_visgym_prompt():
    env = SkyRLMazeEnv(extras={"seed": 2, "size": 9, "max_steps": 20})
    (message,), _ = env.init([])
    text, image = message["content"][0]["text"], message["content"][1]["image_url"]["url"]
    assert "give the final result in <answer>…</answer>.\nThis is step 1." in text
    prefix = "data:image/jpeg;base64,"
    assert image.startswith(prefix)
    assert base64.b64decode(image[len(prefix) :]) == _visgym_jpeg_bytes(render(env.maze, env.maze.start))
    out = env.step("<think>right is open?</think><answer>('stop', 'stop')</answer> ('move', 0)")
    assert out["done"] and out["metadata"]["valid"]  # the first answer decides
