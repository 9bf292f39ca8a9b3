"""Episode rules of BatchedMazeEnv / MazeEnv: costs, walls, limits, rewards, invariants."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlexp.envs.batch import BatchedMazeEnv, MazeEnv
from rlexp.envs.maze import MOVE_DOWN, MOVE_LEFT, MOVE_RIGHT, MOVE_UP, STOP, Maze, expert_actions, generate_maze
from rlexp.envs.prompts import ACTION_EXECUTED, INVALID_ACTION, WALL_BUMP

# start (1,1) -> right, right, down, down, left, left -> goal (3,1): 6 moves, expert length 7
CORRIDOR = Maze.from_dict(
    {"grid": ["#####", "#...#", "###.#", "#...#", "#####"], "start": [1, 1], "goal": [3, 1], "seed": None}
)
TO_GOAL = [MOVE_RIGHT, MOVE_RIGHT, MOVE_DOWN, MOVE_DOWN, MOVE_LEFT, MOVE_LEFT]


def corridor_env(**kwargs) -> MazeEnv:
    env = MazeEnv(5, kwargs.pop("max_steps", 20), **kwargs)
    env.reset(CORRIDOR)
    return env


def test_reset_state_and_images():
    mazes = [generate_maze(9, s) for s in range(3)]
    env = BatchedMazeEnv(9, 20)
    images = env.reset(mazes)
    assert images.shape == (3, 225, 225, 3) and images.dtype == np.uint8
    assert env.agent_pos.tolist() == [list(m.start) for m in mazes]
    assert env.steps.tolist() == [0, 0, 0] and not env.done.any() and env.num_invalid.tolist() == [0, 0, 0]


def test_state_arrays_are_read_only():
    env = corridor_env()
    for array in (env.batch.agent_pos, env.batch.steps, env.batch.done, env.batch.num_invalid):
        with pytest.raises(ValueError):
            array[0] = 1


def test_valid_move_feedback():
    env = corridor_env()
    t = env.step("('move', 0)")
    assert env.agent_pos == (1, 2) and t.valid and t.feedback == ACTION_EXECUTED and t.action == MOVE_RIGHT


def test_invalid_action_costs_a_step_and_changes_nothing():
    env = corridor_env()
    before = env.image.copy()
    t = env.step("I am not sure")
    assert env.agent_pos == (1, 1) and env.steps == 1 and not t.done and not t.valid and t.action == -1
    assert t.feedback == "Cannot parse action string 'I am not sure' so the action is invalid."
    assert np.array_equal(env.image, before) and env.batch.num_invalid[0] == 1
    t = env.step(None)
    assert env.steps == 2 and t.feedback == INVALID_ACTION
    t = env.step("('move', 5)")
    assert t.feedback == "The action 5 is not in the valid action space of move so nothing is executed."


def test_wall_bump_is_valid_costs_a_step_and_stays():
    env = corridor_env()
    t = env.step(MOVE_UP)
    assert env.agent_pos == (1, 1) and env.steps == 1 and t.valid and t.feedback == WALL_BUMP
    assert env.batch.num_invalid[0] == 0


def test_step_limit_ends_the_episode_without_reward():
    env = corridor_env(max_steps=4)
    for i in range(4):
        t = env.step(MOVE_LEFT)  # always a wall
        assert t.done == (i == 3) and t.reward == 0.0
    assert env.steps == 4 and not t.success
    with pytest.raises(RuntimeError, match="over"):
        env.step(MOVE_LEFT)


def test_reward_only_for_stop_on_goal():
    env = corridor_env()
    for move in TO_GOAL:
        t = env.step(move)
        assert t.reward == 0.0 and not t.done  # walking onto the goal does not end the episode
    assert env.agent_pos == CORRIDOR.goal
    t = env.step("('stop', 'stop')")
    assert t.done and t.success and t.reward == 1.0 and env.steps == 7


def test_stop_elsewhere_ends_with_zero_and_leaving_goal_loses_it():
    env = corridor_env()
    t = env.step(STOP)
    assert t.done and not t.success and t.reward == 0.0
    env = corridor_env()
    for move in TO_GOAL + [MOVE_RIGHT]:
        env.step(move)
    t = env.step(STOP)
    assert t.done and not t.success and t.reward == 0.0


def test_expert_needs_exactly_its_length_in_steps():
    env = corridor_env(max_steps=len(expert_actions(CORRIDOR)))
    for action in expert_actions(CORRIDOR):
        t = env.step(action)
    assert t.done and t.success and t.reward == 1.0


def test_terminate_on_goal():
    env = corridor_env(terminate_on_goal=True)
    for i, move in enumerate(TO_GOAL):
        t = env.step(move)
        assert t.done == (i == len(TO_GOAL) - 1)
    assert t.success and t.reward == 1.0 and t.feedback == ACTION_EXECUTED


def test_format_reward_mixes_in_the_valid_share():
    env = corridor_env(format_reward=0.2)
    env.step("nonsense")
    for move in TO_GOAL:
        env.step(move)
    t = env.step(STOP)  # 8 steps, 7 valid
    assert t.success and t.reward == pytest.approx(0.8 + 0.2 * 7 / 8)
    env = corridor_env(format_reward=0.2, max_steps=2)
    env.step(MOVE_UP)
    t = env.step(MOVE_UP)  # limit reached, never stopped: format share only
    assert not t.success and t.reward == pytest.approx(0.2)


def test_action_tag_format():
    env = corridor_env(action_format="action_tag")
    assert env.step("<action>right</action>").valid and env.agent_pos == (1, 2)
    assert not env.step("('move', 0)").valid


def test_done_episodes_are_ignored():
    env = BatchedMazeEnv(5, 20)
    env.reset([CORRIDOR, CORRIDOR])
    r = env.step([STOP, MOVE_RIGHT])
    assert r.done.tolist() == [True, False]
    before = env.images[0].copy()
    r = env.step([object(), MOVE_RIGHT])  # anything goes for a done episode
    assert r.active.tolist() == [False, True] and r.feedback[0] == "" and r.reward[0] == 0.0
    assert env.steps.tolist() == [1, 2] and np.array_equal(env.images[0], before)


def test_integer_actions_are_checked():
    env = BatchedMazeEnv(5, 20)
    env.reset([CORRIDOR, CORRIDOR])
    for bad in ([5, 0], np.array([0, -1])):
        with pytest.raises(ValueError, match="0..4"):
            env.step(bad)
    with pytest.raises(ValueError, match="expected 2"):
        env.step([0])
    r = env.step(np.array([MOVE_RIGHT, MOVE_UP], dtype=np.int32))
    assert r.feedback == [ACTION_EXECUTED, WALL_BUMP]


def test_size_mismatch_rejected():
    with pytest.raises(ValueError, match="size"):
        BatchedMazeEnv(9, 20).reset([CORRIDOR])


action_st = st.one_of(
    st.integers(0, 4),
    st.none(),
    st.sampled_from(["('move', 0)", "('move', 3)", "('stop', 'stop')", "garbage", "('move', 9)"]),
    st.text(max_size=30),
)


@settings(max_examples=60, deadline=None)
@given(
    seeds=st.lists(st.integers(0, 10_000), min_size=1, max_size=6),
    size=st.sampled_from([5, 9, 11]),
    max_steps=st.integers(1, 25),
    terminate_on_goal=st.booleans(),
    data=st.data(),
)
def test_state_stays_valid_and_steps_advance(seeds, size, max_steps, terminate_on_goal, data):
    mazes = [generate_maze(size, s) for s in seeds]
    env = BatchedMazeEnv(size, max_steps, cell_px=4, terminate_on_goal=terminate_on_goal)
    env.reset(mazes)
    walls = np.stack([m.grid for m in mazes])
    for _ in range(max_steps + 2):
        actions = data.draw(st.lists(action_st, min_size=len(mazes), max_size=len(mazes)))
        was_done, steps_before, pos_before = env.done.copy(), env.steps.copy(), env.agent_pos.copy()
        r = env.step(actions)
        pos = env.agent_pos
        assert ((pos >= 1) & (pos <= size - 2)).all()
        assert not walls[np.arange(len(mazes)), pos[:, 0], pos[:, 1]].any()
        assert (np.abs(pos - pos_before).sum(axis=1) <= 1).all()
        assert (env.steps[~was_done] == steps_before[~was_done] + 1).all()
        assert (env.steps[was_done] == steps_before[was_done]).all()
        assert (pos[was_done] == pos_before[was_done]).all()
        assert (env.steps <= max_steps).all() and env.done[env.steps == max_steps].all()
        assert ((r.reward == 1.0) == (r.success & ~was_done)).all()
        assert (r.active == ~was_done).all()
