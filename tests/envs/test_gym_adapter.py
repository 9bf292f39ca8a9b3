"""The gymnasium env (check_env, seeding, text actions) and the skyrl-gym-style adapter."""

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from rlexp.envs.actions import format_action
from rlexp.envs.gym_env import MazeGymEnv, SkyRLMazeEnv
from rlexp.envs.maze import STOP, expert_actions, generate_maze
from rlexp.envs.render import render

ENV_ID = "rlexp_tests/Maze-v0"
if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point=MazeGymEnv)


@pytest.mark.parametrize("size, max_steps", [(9, 20), (11, 30)])
def test_check_env_passes_without_warnings(size, max_steps):
    env = gym.make(ENV_ID, size=size, max_steps=max_steps)  # make gives it a spec, so every check runs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)


def test_reset_seed_plays_the_generator_maze_and_options_override():
    env = MazeGymEnv()
    obs, info = env.reset(seed=5)
    maze = generate_maze(9, 5)
    assert env.maze == maze and np.array_equal(obs, render(maze, maze.start)) and info["seed"] == 5
    other = generate_maze(9, 77)
    obs, _ = env.reset(options={"maze": other})
    assert env.maze == other
    env.reset(seed=1)
    first = [env.reset()[1]["seed"] for _ in range(3)]
    env.reset(seed=1)
    assert [env.reset()[1]["seed"] for _ in range(3)] == first  # unseeded resets follow np_random


def test_expert_episode_with_ints_and_text():
    env = MazeGymEnv(size=11, max_steps=30)
    env.reset(seed=3)
    actions = expert_actions(env.maze)
    for i, action in enumerate(actions):
        step_action = format_action(action, "visgym_tuple") if i % 2 else np.int64(action)
        obs, reward, terminated, truncated, info = env.step(step_action)
        assert obs.shape == env.observation_space.shape and info["valid"]
    assert terminated and not truncated and reward == 1.0 and info["success"]


def test_truncation_at_the_step_limit():
    env = MazeGymEnv(size=9, max_steps=3)
    env.reset(seed=0)
    results = [env.step("no idea") for _ in range(3)]
    assert [r[3] for r in results] == [False, False, True] and not any(r[2] for r in results)
    assert results[-1][4]["env_feedback"].startswith("Cannot parse action string")
    env.reset(seed=0)
    _, reward, terminated, truncated, _ = env.step(STOP)
    assert terminated and not truncated and reward == 0.0


def test_skyrl_adapter_runs_an_expert_episode():
    env = SkyRLMazeEnv(
        extras={"seed": 2, "size": 9, "max_steps": 20, "prompt": "skyrl_instruct", "action_format": "action_tag"}
    )
    messages, _ = env.init([])
    text = messages[0]["content"][0]["text"]
    assert text.startswith("You are navigating a 9x9 maze.") and text.endswith("You are allowed to take 19 more steps.")
    assert messages[0]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    moves = expert_actions(env.maze)
    for action in moves[:-1]:
        out = env.step(format_action(action, "action_tag"))
        assert not out["done"] and out["reward"] == 0.0
        assert out["observations"][0]["content"][0]["text"].startswith(
            "Environment feedback: Action executed successfully."
        )
    out = env.step(format_action(moves[-1], "action_tag"))
    assert out["done"] and out["reward"] == 1.0 and out["observations"] == [] and out["metadata"]["success"]


def test_skyrl_adapter_accepts_a_maze_dict():
    maze = generate_maze(11, 8)
    env = SkyRLMazeEnv(extras={"maze": maze.to_dict(), "max_steps": 30})
    env.init([])
    assert env.maze == maze
    with pytest.raises(ValueError, match="maze"):
        SkyRLMazeEnv(extras={})
