"""A turn limit below the env's step limit: training mazes stay solvable, evals state the ceiling."""

from omegaconf import OmegaConf

from conftest import compose_config
from rlexp.envs import ExpertPolicy, TrainingMazeStream, expert_actions, load_pinned
from rlexp.evaluation.evaluate import episode_rows, summarize
from rlexp.rollout.driver import scripted_trajectories
from rlexp.training.loop import stream_limit


def test_the_seed_turn_limit_leaves_twelve_pinned_mazes_out_of_reach_and_the_eval_says_so():
    cfg = compose_config("name=test", "rollout.max_turns=15")
    mazes = load_pinned("maze_easy")
    trajectories = scripted_trajectories(ExpertPolicy(), mazes, cfg.env, 1, 15)
    result = summarize(episode_rows(trajectories, mazes), mazes, 15, 1)
    assert result.solvable == 52 and result.success_rate == 52 / 64  # the expert reaches exactly the ceiling
    assert "only 52/64 solvable in 15 turns" in result.summary()
    assert result.metrics()["eval/ceiling"] == 52 / 64
    at_env_limit = summarize(episode_rows(scripted_trajectories(ExpertPolicy(), mazes, cfg.env, 1, 20), mazes), mazes, 20, 1)
    assert at_env_limit.success_rate == 1.0 and "solvable" not in at_env_limit.summary()


def test_training_mazes_are_drawn_solvable_within_the_turn_limit():
    cfg = compose_config("name=test", "rollout.max_turns=15")
    limit = stream_limit(cfg)
    assert limit == 15
    mazes = TrainingMazeStream(9, limit, seed=0).next_batch(64)
    assert max(len(expert_actions(m)) for m in mazes) <= 15


def test_a_toy_turn_limit_no_maze_can_meet_falls_back_to_the_env_limit(caplog):
    cfg = compose_config("name=test", "rollout.max_turns=4")
    assert stream_limit(cfg) == OmegaConf.select(cfg, "env.max_steps")
    assert "no 9x9 maze is solvable in so few turns" in caplog.text
