"""Scripted policies for baseline evaluations, and the loop that evaluates them.

Each policy's ``act(env, mazes)`` returns one action int per episode of ``env`` (done episodes
included; the env ignores those) from ``env.agent_pos``; randomness comes from the policy's own
SplitMix64, so a policy is deterministic given its seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Protocol

import numpy as np

from rlexp.envs.batch import BatchedMazeEnv
from rlexp.envs.maze import NUM_ACTIONS, Maze, distance_map, greedy_move
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
