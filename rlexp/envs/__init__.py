"""The maze environment: generation, rules, rendering, action parsing, prompts, pinned eval sets.

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
    PROMPTS,
    WALL_BUMP,
    instructions,
    step_text,
    task_prompt,
    turn_text,
)
from rlexp.envs.render import BatchRenderer, render
from rlexp.envs.scripted import ExpertPolicy, NoisyExpertPolicy, RandomPolicy

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
    "NoisyExpertPolicy",
    "PinnedSetChanged",
    "RandomPolicy",
    "SkyRLMazeEnv",
    "StepResult",
    "TrainingMazeStream",
    "Transition",
    "expert_actions",
    "format_action",
    "generate_maze",
    "min_expert_steps",
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
