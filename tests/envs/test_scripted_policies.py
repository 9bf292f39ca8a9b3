"""Scripted baselines on the pinned sets: expert perfect, random ~0, noisy expert in between."""

import math

import pytest

from rlexp.envs.pinned import PINNED_SETS, load_pinned
from rlexp.envs.scripted import ExpertPolicy, NoisyExpertPolicy, RandomPolicy, evaluate_scripted


def run(policy, name):
    spec = PINNED_SETS[name]
    return evaluate_scripted(policy, load_pinned(name), spec["size"], spec["max_steps"])


@pytest.mark.parametrize("name", list(PINNED_SETS))
def test_expert_solves_all_pinned_mazes_optimally(name):
    result = run(ExpertPolicy(), name)
    assert result["success_rate"] == 1.0 and result["num_mazes"] == 64
    assert result["optimal_path_ratio"] == 1.0 and result["invalid_action_rate"] == 0.0
    assert result["max_steps"] == PINNED_SETS[name]["max_steps"]
    assert all(m["steps"] == m["expert_length"] for m in result["per_maze"])


@pytest.mark.parametrize("name", list(PINNED_SETS))
def test_random_policy_nearly_never_succeeds(name):
    result = run(RandomPolicy(seed=0), name)
    assert result["success_rate"] <= 0.10
    assert result["success_rate"] > 0 or math.isnan(result["optimal_path_ratio"])


def test_noisy_expert_success_grows_with_p():
    rates = [run(NoisyExpertPolicy(p, seed=1), "maze_easy")["success_rate"] for p in (0.0, 0.5, 0.8, 1.0)]
    assert rates[0] <= 0.10 and rates[-1] == 1.0
    assert all(a <= b + 0.05 for a, b in zip(rates, rates[1:])), rates
    assert rates[2] > rates[0]


def test_policies_are_deterministic_given_seed():
    assert run(NoisyExpertPolicy(0.7, seed=4), "maze_hard") == run(NoisyExpertPolicy(0.7, seed=4), "maze_hard")
    assert run(RandomPolicy(seed=9), "maze_easy")["per_maze"] == run(RandomPolicy(seed=9), "maze_easy")["per_maze"]


def test_noisy_expert_rejects_bad_p():
    with pytest.raises(ValueError):
        NoisyExpertPolicy(1.5)
