"""The maze environment: generation, rules, rendering, action parsing, prompts, the model's view, pinned eval sets.

VisGym ``maze_2d`` semantics (see ``maze``, ``batch``, ``prompts``), deterministic everywhere, stepped
in batches with NumPy; gymnasium and skyrl-gym adapters in ``gym_env``.
"""

from rlexp.envs.actions import ACTION_FORMATS, format_action, parse_action
from rlexp.envs.batch import BatchedMazeEnv, MazeEnv, StepResult, Transition
from rlexp.envs.gym_env import MazeGymEnv, SkyRLMazeEnv
from rlexp.envs.maze import (
    MOVE_DOWN,
    MOVE_LEFT,
    MOVE_RIGHT,
    MOVE_UP,
    NUM_ACTIONS,
    STOP,
    Maze,
    expert_actions,
    generate_maze,
    min_expert_steps,
    shortest_path,
)
from rlexp.envs.prompts import (
    ACTION_EXECUTED,
    ELICIT_SUFFIX,
    PROMPTS,
    WALL_BUMP,
    drop_feedback,
    history_head,
    instructions,
    step_text,
    task_prompt,
    turn_text,
)
from rlexp.envs.render import BatchRenderer, render
from rlexp.envs.scripted import ExpertPolicy, NoisyExpertPolicy, RandomPolicy
from rlexp.envs.view import HISTORY_STYLES, IMAGE_FORMATS, ModelView, encode_frame, model_frame

_PINNED_NAMES = (
    "PINNED_SETS",
    "PINNED_SHA256",
    "PinnedSetChanged",
    "TrainingMazeStream",
    "load_pinned",
    "load_pinned_file",
    "pinned_layout_hashes",
)


def __getattr__(name: str):
    # Imported lazily so that `python -m rlexp.envs.pinned` does not find its module pre-imported.
    if name in _PINNED_NAMES:
        from rlexp.envs import pinned

        return getattr(pinned, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ACTION_EXECUTED",
    "ACTION_FORMATS",
    "ELICIT_SUFFIX",
    "HISTORY_STYLES",
    "IMAGE_FORMATS",
    "MOVE_DOWN",
    "MOVE_LEFT",
    "MOVE_RIGHT",
    "MOVE_UP",
    "NUM_ACTIONS",
    "PINNED_SETS",
    "PINNED_SHA256",
    "PROMPTS",
    "STOP",
    "WALL_BUMP",
    "BatchRenderer",
    "BatchedMazeEnv",
    "ExpertPolicy",
    "Maze",
    "MazeEnv",
    "MazeGymEnv",
    "ModelView",
    "NoisyExpertPolicy",
    "PinnedSetChanged",
    "RandomPolicy",
    "SkyRLMazeEnv",
    "StepResult",
    "TrainingMazeStream",
    "Transition",
    "drop_feedback",
    "encode_frame",
    "expert_actions",
    "format_action",
    "generate_maze",
    "history_head",
    "min_expert_steps",
    "model_frame",
    "instructions",
    "load_pinned",
    "load_pinned_file",
    "parse_action",
    "pinned_layout_hashes",
    "render",
    "shortest_path",
    "step_text",
    "task_prompt",
    "turn_text",
]
