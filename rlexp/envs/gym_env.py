"""Adapters: a gymnasium ``Env`` and a skyrl-gym-style text env, both over ``MazeEnv``."""

from __future__ import annotations

import base64
from typing import Any

import gymnasium as gym
import numpy as np

from rlexp.envs.batch import MazeEnv, Transition
from rlexp.envs.maze import STOP, Maze, generate_maze
from rlexp.envs.prompts import task_prompt, turn_text
from rlexp.envs.view import ModelView, encode_frame


class MazeGymEnv(gym.Env):
    """Gymnasium maze env: image observations, ``Discrete(5)`` actions (``step`` also takes text).

    ``reset(seed=s)`` plays ``generate_maze(size, s)``, so gym seeds name the same mazes as the
    pinned sets; ``reset()`` without a seed draws the maze seed from the env's ``np_random``;
    ``options={"maze": maze}`` plays a given maze. ``terminated`` means the episode ended by STOP
    (or by reaching the goal with ``terminate_on_goal``), ``truncated`` by the step limit.
    Observations are the exact rendered frames; ``elicit_verbalization`` reads text actions inside
    their first ``<answer>``.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 4}

    def __init__(
        self,
        size: int = 9,
        max_steps: int = 20,
        cell_px: int = 25,
        render_mode: str | None = "rgb_array",
        terminate_on_goal: bool = False,
        format_reward: float = 0.0,
        action_format: str = "visgym_tuple",
        elicit_verbalization: bool = False,
    ):
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode must be 'rgb_array' or None, got {render_mode!r}")
        self.render_mode = render_mode
        self.size = size
        self._env = MazeEnv(
            size,
            max_steps,
            cell_px=cell_px,
            terminate_on_goal=terminate_on_goal,
            format_reward=format_reward,
            action_format=action_format,
            elicit_verbalization=elicit_verbalization,
        )
        side = size * cell_px
        self.observation_space = gym.spaces.Box(0, 255, (side, side, 3), dtype=np.uint8)
        self.action_space = gym.spaces.Discrete(5)

    @property
    def maze(self) -> Maze:
        return self._env.maze

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        maze = (options or {}).get("maze")
        if maze is None:
            maze_seed = seed if seed is not None else int(self.np_random.integers(2**63))
            maze = generate_maze(self.size, maze_seed)
        image = self._env.reset(maze).copy()
        return image, self._info(None)

    def step(self, action: int | str):
        t = self._env.step(action if isinstance(action, str) else int(action))
        terminated = t.done and (t.action == STOP or t.success)
        truncated = t.done and not terminated
        return t.image.copy(), t.reward, terminated, truncated, self._info(t)

    def render(self) -> np.ndarray | None:
        return self._env.image.copy() if self.render_mode == "rgb_array" else None

    def _info(self, t: Transition | None) -> dict[str, Any]:
        info = {"agent": self._env.agent_pos, "goal": self.maze.goal, "steps": self._env.steps, "seed": self.maze.seed}
        if t is not None:
            info.update(env_feedback=t.feedback, success=t.success, valid=t.valid)
        return info


def image_message(text: str, image: np.ndarray, image_format: str = "png") -> dict[str, Any]:
    """An OpenAI-format user message with ``text`` and a data-URL image: PNG as SkyRL builds it, or
    JPEG as VisGym's ``OpenAIVLM.query`` sends it (``data:image/jpeg;base64,`` of ``encode_frame``)."""
    data = encode_frame(image, image_format)
    url = f"data:image/{image_format};base64," + base64.b64encode(data).decode("ascii")
    return {
        "role": "user",
        "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}],
    }


class SkyRLMazeEnv:
    """skyrl-gym ``BaseTextEnv``-shaped adapter (``init`` / ``step``), without importing skyrl-gym.

    ``extras`` keys: ``maze`` (a ``Maze`` or its ``to_dict()``) or ``seed``; ``size`` (9),
    ``max_steps`` (20), ``prompt`` ("visgym"), ``action_format`` ("visgym_tuple"), ``image_format``
    and ``elicit_verbalization`` ("auto" / None: VisGym's JPEG and elicitation iff prompt is
    "visgym"; see ``ModelView``), and optionally ``cell_px``, ``terminate_on_goal``,
    ``format_reward``. The first user turn is ``task_prompt(...)``, later ones
    ``turn_text(feedback, ...)``, each with the new image. The history is SkyRL's to keep.
    ``env_config`` is accepted for skyrl-gym's constructor signature and unused.
    """

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
        extras = dict(extras or {})
        maze, seed = extras.pop("maze", None), extras.pop("seed", None)
        size = extras.pop("size", 9)
        if isinstance(maze, dict):
            maze = Maze.from_dict(maze)
        elif maze is None:
            if seed is None:
                raise ValueError("SkyRLMazeEnv needs extras['maze'] or extras['seed']")
            maze = generate_maze(size, seed)
        self.maze = maze
        self.max_steps = extras.pop("max_steps", 20)
        self.prompt = extras.pop("prompt", "visgym")
        self.action_format = extras.pop("action_format", "visgym_tuple")
        self.view = ModelView.resolve(
            self.prompt,
            image_format=extras.pop("image_format", "auto"),
            elicit_verbalization=extras.pop("elicit_verbalization", None),
        )
        self._env = MazeEnv(
            maze.size,
            self.max_steps,
            action_format=self.action_format,
            elicit_verbalization=self.view.elicit_verbalization,
            **extras,
        )

    def init(self, prompt: Any = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        image = self._env.reset(self.maze)
        text = task_prompt(
            self.prompt, self.action_format, self.max_steps, size=self.maze.size, elicit=self.view.elicit_verbalization
        )
        return [image_message(text, image, self.view.image_format)], {}

    def step(self, action: str) -> dict[str, Any]:
        t = self._env.step(action)
        text = turn_text(t.feedback, self._env.steps, self.max_steps)
        observations = [] if t.done else [image_message(text, t.image, self.view.image_format)]
        metadata = {"env_feedback": t.feedback, "success": t.success, "valid": t.valid, "steps": self._env.steps}
        return {"observations": observations, "reward": t.reward, "done": t.done, "metadata": metadata}

    def close(self) -> None:
        pass
