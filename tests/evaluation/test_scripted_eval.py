"""Scripted baselines through the same driver and summary as the model: expert perfect, random ~0."""

import subprocess
import sys

import pytest

from conftest import REPO, compose_config
from rlexp.envs import ExpertPolicy, NoisyExpertPolicy, RandomPolicy, load_pinned
from rlexp.evaluation.evaluate import episode_rows, summarize, wilson_interval
from rlexp.rollout.driver import scripted_trajectories


def run(policy, env: str, max_turns: int | None = None):
    cfg = compose_config(f"env={env}")
    mazes = load_pinned(cfg.env.pinned_set)
    turns = max_turns or cfg.env.max_steps
    return summarize(episode_rows(scripted_trajectories(policy, mazes, cfg.env, 1, turns), mazes), mazes, turns, 1)


@pytest.mark.parametrize("env", ["maze_easy", "maze_hard"])
def test_expert_solves_all_pinned_mazes_optimally(env):
    result = run(ExpertPolicy(), env)
    assert result.success_rate == 1.0 and result.num_mazes == 64
    assert result.optimal_path_ratio == 1.0 and result.invalid_action_rate == 0.0
    assert all(row["turns"] == row["expert_length"] for row in result.per_maze)


def test_turn_limit_caps_what_the_expert_can_solve():
    """The seed's 15 turns: mazes needing 16 moves + stop cannot be solved, and the result says so."""
    result = run(ExpertPolicy(), "maze_easy", max_turns=15)
    solvable = sum(row["expert_length"] <= 15 for row in result.per_maze)
    assert result.success_rate == solvable / 64 < 1.0
    assert result.turn_limit == 15


@pytest.mark.parametrize("env", ["maze_easy", "maze_hard"])
def test_random_policy_nearly_never_succeeds(env):
    assert run(RandomPolicy(seed=0), env).success_rate <= 0.10


def test_noisy_expert_success_grows_with_p():
    rates = [run(NoisyExpertPolicy(p, seed=1), "maze_easy").success_rate for p in (0.0, 0.5, 0.8, 1.0)]
    assert rates[0] <= 0.10 and rates[-1] == 1.0
    assert all(a <= b + 0.05 for a, b in zip(rates, rates[1:])), rates
    assert rates[2] > rates[0]


def test_policies_are_deterministic_given_seed():
    assert run(NoisyExpertPolicy(0.7, seed=4), "maze_hard").per_maze == run(NoisyExpertPolicy(0.7, seed=4), "maze_hard").per_maze


def test_noisy_expert_rejects_bad_p():
    with pytest.raises(ValueError):
        NoisyExpertPolicy(1.5)


def test_wilson_interval_hand_values():
    low, high = wilson_interval(32, 64)
    assert low == pytest.approx(0.3810, abs=1e-4) and high == pytest.approx(0.6190, abs=1e-4)
    assert wilson_interval(0, 64)[0] == 0.0 and wilson_interval(0, 64)[1] == pytest.approx(0.0566, abs=1e-4)
    assert wilson_interval(64, 64)[1] == 1.0


def test_eval_task_from_the_command_line(tmp_path):
    run_dir = tmp_path / "eval"
    result = subprocess.run(
        [sys.executable, "-m", "rlexp", "task=eval", "eval.policy=expert", "rollout.max_turns=20", f"hydra.run.dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "success 100.0%" in result.stdout and "≤20 turns" in result.stdout
    assert len((run_dir / "eval" / "expert.jsonl").read_text().splitlines()) == 64
