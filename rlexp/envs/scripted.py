"""Scripted policies for baseline evaluations, and the loop that evaluates them.

Each policy's ``act(env, mazes)`` returns one action int per episode of ``env`` (done episodes
included; the env ignores those) from ``env.agent_pos``; randomness comes from the policy's own
SplitMix64, so a policy is deterministic given its seed.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Protocol, Sequence

import numpy as np

from rlexp.envs.batch import BatchedMazeEnv
from rlexp.envs.maze import NUM_ACTIONS, Maze, distance_map, expert_actions, greedy_move
from rlexp.envs.rng import SplitMix64


class ScriptedPolicy(Protocol):
    def act(self, env: BatchedMazeEnv, mazes: Sequence[Maze]) -> list[int]: ...


@lru_cache(maxsize=4096)
def _goal_distances(maze: Maze) -> np.ndarray:
    return distance_map(maze.grid, maze.goal)


class ExpertPolicy:
    """Shortest-path move from wherever the agent is (so it recovers after a detour); STOP on the goal."""

    def act(self, env: BatchedMazeEnv, mazes: Sequence[Maze]) -> list[int]:
        return [greedy_move(_goal_distances(m), (r, c)) for m, (r, c) in zip(mazes, env.agent_pos.tolist())]


class RandomPolicy:
    """Uniform over the five actions, STOP included."""

    def __init__(self, seed: int = 0):
        self._rng = SplitMix64(seed)

    def act(self, env: BatchedMazeEnv, mazes: Sequence[Maze]) -> list[int]:
        return [self._rng.below(NUM_ACTIONS) for _ in mazes]


class NoisyExpertPolicy:
    """Per step and episode: the expert's action with probability ``p``, else a uniform random one."""

    def __init__(self, p: float, seed: int = 0):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        self.p = p
        self._rng = SplitMix64(seed)
        self._expert = ExpertPolicy()

    def act(self, env: BatchedMazeEnv, mazes: Sequence[Maze]) -> list[int]:
        expert = self._expert.act(env, mazes)
        return [a if self._rng.random() < self.p else self._rng.below(NUM_ACTIONS) for a in expert]


def evaluate_scripted(
    policy: ScriptedPolicy,
    mazes: Sequence[Maze],
    size: int,
    max_steps: int,
    *,
    terminate_on_goal: bool = False,
    cell_px: int = 25,
) -> dict[str, Any]:
    """Play one episode per maze and summarise.

    Returns ``success_rate`` (stopped on the goal), ``mean_steps`` (actions taken, STOP included),
    ``invalid_action_rate`` (invalid actions / all actions), ``optimal_path_ratio`` (mean over
    successful episodes of expert_length / steps, both counting STOP; 1.0 = optimal, NaN if no
    success), ``num_mazes``, ``max_steps`` (the turn limit the numbers hold for) and ``per_maze``.
    """
    env = BatchedMazeEnv(size, max_steps, cell_px=cell_px, terminate_on_goal=terminate_on_goal)
    env.reset(mazes)
    while not env.done.all():
        env.step(np.asarray(policy.act(env, mazes), dtype=np.int64))
    steps = env.steps.tolist()
    success = env.success.tolist()
    invalid = env.num_invalid.tolist()
    per_maze = [
        {
            "seed": maze.seed,
            "layout_hash": maze.layout_hash(),
            "success": ok,
            "steps": n,
            "num_invalid": bad,
            "expert_length": len(expert_actions(maze)),
        }
        for maze, ok, n, bad in zip(mazes, success, steps, invalid)
    ]
    ratios = [m["expert_length"] / m["steps"] for m in per_maze if m["success"]]
    return {
        "success_rate": sum(success) / len(mazes),
        "mean_steps": sum(steps) / len(mazes),
        "invalid_action_rate": sum(invalid) / sum(steps),
        "optimal_path_ratio": sum(ratios) / len(ratios) if ratios else math.nan,
        "num_mazes": len(mazes),
        "max_steps": max_steps,
        "per_maze": per_maze,
    }
