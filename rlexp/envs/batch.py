"""The maze rules, stepped for a batch of episodes at once with NumPy.

Rules (VisGym ``maze_2d`` plus its interactor's step limit):

- Every action costs a step, whatever it does. The episode ends on STOP or when ``steps`` reaches
  ``max_steps`` (STOP counts as a step, so an expert needs moves + 1 steps).
- An invalid action (unparsable text, or ``None``) changes nothing; its feedback is the parse error.
- A move into a wall is a *valid* action that leaves the agent in place, as in VisGym (there it is
  a well-formed action in the action space); feedback "Cannot move into a wall.".
- Reward is sparse and given on the step that ends the episode: task reward 1.0 iff the agent
  stopped on the goal. Walking onto the goal does not end the episode, unless
  ``terminate_on_goal=True``: then reaching the goal ends it with success and task reward 1.
- ``format_reward`` (default 0, off) mixes in a share for well-formed actions, as SkyRL's SFT recipe
  did with 0.2: final reward = (1 - format_reward) * task + format_reward * (valid actions / steps).
  ``success`` is always the true task success, never the mixed reward.
- ``elicit_verbalization=True``: model text is read inside its first ``<answer>`` (VisGym's
  ``--elicit-verbalization``; see ``actions``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rlexp.envs.actions import check_action_format, parse_action
from rlexp.envs.maze import ACTION_DELTAS, NUM_ACTIONS, STOP, Maze
from rlexp.envs.prompts import ACTION_EXECUTED, INVALID_ACTION, WALL_BUMP
from rlexp.envs.render import BatchRenderer

_NO_ACTION = -1


@dataclass(frozen=True)
class StepResult:
    """Outcome of one ``BatchedMazeEnv.step`` for B episodes.

    Episodes that were already done before the call are ``active=False``: reward 0, done True,
    success as recorded, valid False, action -1, feedback "".
    """

    images: np.ndarray  #: (B, H, W, 3) uint8, the env's buffer: copy what you keep
    reward: np.ndarray  #: (B,) float32
    done: np.ndarray  #: (B,) bool
    success: np.ndarray  #: (B,) bool, stopped on the goal (or reached it, with terminate_on_goal)
    valid: np.ndarray  #: (B,) bool, the action parsed into the action space (wall bumps are valid)
    feedback: list[str]  #: VisGym's env feedback per episode
    active: np.ndarray  #: (B,) bool, the episode took this step
    action: np.ndarray  #: (B,) int64 parsed action, -1 where invalid or inactive


class BatchedMazeEnv:
    """B maze episodes of one size stepped together; B is set by each ``reset``."""

    def __init__(
        self,
        size: int,
        max_steps: int,
        cell_px: int = 25,
        terminate_on_goal: bool = False,
        format_reward: float = 0.0,
        action_format: str = "visgym_tuple",
        elicit_verbalization: bool = False,
    ):
        if size < 5 or size % 2 == 0:
            raise ValueError(f"size must be odd and at least 5, got {size}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        if not 0.0 <= format_reward <= 1.0:
            raise ValueError(f"format_reward must be in [0, 1], got {format_reward}")
        check_action_format(action_format)
        self.size = size
        self.max_steps = max_steps
        self.cell_px = cell_px
        self.terminate_on_goal = terminate_on_goal
        self.format_reward = float(format_reward)
        self.action_format = action_format
        self.elicit_verbalization = bool(elicit_verbalization)
        self._renderer = BatchRenderer(cell_px)
        self.mazes: list[Maze] = []

    # Read-only views of the state, so callers cannot corrupt it by accident.
    agent_pos = property(lambda self: _read_only(self._pos), doc="(B, 2) int64 agent (row, col)")
    goal_pos = property(lambda self: _read_only(self._goal), doc="(B, 2) int64 goal (row, col)")
    steps = property(lambda self: _read_only(self._steps), doc="(B,) int64 actions taken")
    done = property(lambda self: _read_only(self._done), doc="(B,) bool episode over")
    success = property(lambda self: _read_only(self._success), doc="(B,) bool true task success")
    num_invalid = property(lambda self: _read_only(self._num_invalid), doc="(B,) int64 invalid actions")

    @property
    def batch_size(self) -> int:
        return len(self.mazes)

    @property
    def images(self) -> np.ndarray:
        """(B, H, W, 3) uint8 current frames: the internal buffer, overwritten by later calls."""
        return self._renderer.images

    def reset(self, mazes: Sequence[Maze]) -> np.ndarray:
        """Start one episode per maze; returns the first frames (the internal buffer: copy to keep)."""
        if len(mazes) == 0:
            raise ValueError("reset needs at least one maze")
        for maze in mazes:
            if maze.size != self.size:
                raise ValueError(f"env size is {self.size} but a maze has size {maze.size}")
        b = len(mazes)
        self.mazes = list(mazes)
        self._walls = np.stack([m.grid for m in mazes])
        self._goal = np.array([m.goal for m in mazes], dtype=np.int64)
        self._pos = np.array([m.start for m in mazes], dtype=np.int64)
        self._steps = np.zeros(b, dtype=np.int64)
        self._num_invalid = np.zeros(b, dtype=np.int64)
        self._done = np.zeros(b, dtype=bool)
        self._success = np.zeros(b, dtype=bool)
        self._rows = np.arange(b)
        return self._renderer.reset(self._walls, self._goal, self._pos)

    def step(self, actions: Sequence[str | int | None] | np.ndarray) -> StepResult:
        """Apply one action per episode: str = model text (parsed), int = action 0..4, None = invalid.

        Entries of episodes already done are ignored (anything may be passed there).
        """
        if not self.mazes:
            raise RuntimeError("call reset before step")
        b = self.batch_size
        if len(actions) != b:
            raise ValueError(f"expected {b} actions, got {len(actions)}")
        active = ~self._done
        act, errors = self._decode(actions, active)

        valid = active & (act >= 0)
        move_idx = np.where(valid, act, STOP)  # STOP row of ACTION_DELTAS is (0, 0)
        target = self._pos + ACTION_DELTAS[move_idx]
        is_move = valid & (act != STOP)
        blocked = is_move & self._walls[self._rows, target[:, 0], target[:, 1]]
        moved = is_move & ~blocked
        old_pos = self._pos.copy()
        self._pos[moved] = target[moved]
        self._renderer.move(np.flatnonzero(moved), old_pos[moved], self._pos[moved])

        self._steps[active] += 1
        self._num_invalid[active & ~valid] += 1
        on_goal = (self._pos == self._goal).all(axis=1)
        stopped = valid & (act == STOP)
        reached = moved & on_goal if self.terminate_on_goal else np.zeros(b, dtype=bool)
        succeeded = (stopped & on_goal) | reached
        ended = active & (stopped | reached | (self._steps >= self.max_steps))
        self._success |= succeeded
        self._done |= ended

        reward = np.zeros(b, dtype=np.float32)
        if ended.any():
            task = succeeded[ended].astype(np.float64)
            steps = self._steps[ended]
            valid_share = (steps - self._num_invalid[ended]) / steps
            reward[ended] = (1.0 - self.format_reward) * task + self.format_reward * valid_share

        feedback = [ACTION_EXECUTED if a else "" for a in active.tolist()]
        for i in np.flatnonzero(blocked).tolist():
            feedback[i] = WALL_BUMP
        for i, message in errors.items():
            feedback[i] = message
        return StepResult(
            images=self._renderer.images,
            reward=reward,
            done=self._done.copy(),
            success=self._success.copy(),
            valid=valid,
            feedback=feedback,
            active=active,
            action=np.where(valid, act, _NO_ACTION),
        )

    def _decode(self, actions, active: np.ndarray) -> tuple[np.ndarray, dict[int, str]]:
        """Actions as int64 (-1 = invalid or inactive) and the error feedback of invalid ones."""
        if isinstance(actions, np.ndarray) and np.issubdtype(actions.dtype, np.integer):
            if (active & ((actions < 0) | (actions >= NUM_ACTIONS))).any():
                raise ValueError(f"integer actions must be in 0..{NUM_ACTIONS - 1}")
            return np.where(active, actions, _NO_ACTION).astype(np.int64), {}
        act = np.full(len(actions), _NO_ACTION, dtype=np.int64)
        errors: dict[int, str] = {}
        for i, (a, is_active) in enumerate(zip(actions, active.tolist())):
            if not is_active:
                continue
            if a is None:
                errors[i] = INVALID_ACTION
            elif isinstance(a, str):
                parsed, error = parse_action(a, self.action_format, self.elicit_verbalization)
                if parsed is None:
                    errors[i] = error
                else:
                    act[i] = parsed
            else:
                value = operator.index(a)
                if not 0 <= value < NUM_ACTIONS:
                    raise ValueError(f"integer actions must be in 0..{NUM_ACTIONS - 1}, got {value}")
                act[i] = value
        return act, errors


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


@dataclass(frozen=True)
class Transition:
    """One ``MazeEnv.step`` outcome (the B=1 row of a ``StepResult``)."""

    image: np.ndarray  #: (H, W, 3) uint8 view of the env's buffer: copy to keep
    reward: float
    done: bool
    success: bool
    valid: bool
    feedback: str
    action: int  #: parsed action, -1 if invalid


class MazeEnv:
    """One episode at a time: a ``BatchedMazeEnv`` of batch size 1 with scalar results."""

    def __init__(self, size: int, max_steps: int, **kwargs):
        self.batch = BatchedMazeEnv(size, max_steps, **kwargs)

    @property
    def maze(self) -> Maze:
        return self.batch.mazes[0]

    @property
    def agent_pos(self) -> tuple[int, int]:
        row, col = self.batch.agent_pos[0].tolist()
        return row, col

    @property
    def steps(self) -> int:
        return int(self.batch.steps[0])

    @property
    def done(self) -> bool:
        return bool(self.batch.done[0])

    @property
    def image(self) -> np.ndarray:
        return self.batch.images[0]

    def reset(self, maze: Maze) -> np.ndarray:
        return self.batch.reset([maze])[0]

    def step(self, action: str | int | None) -> Transition:
        if self.done:
            raise RuntimeError("episode is over; call reset")
        r = self.batch.step([action])
        return Transition(
            image=r.images[0],
            reward=float(r.reward[0]),
            done=bool(r.done[0]),
            success=bool(r.success[0]),
            valid=bool(r.valid[0]),
            feedback=r.feedback[0],
            action=int(r.action[0]),
        )
