"""The driver applies the env's view settings: the engine gets VisGym's JPEG frames and history, the
trainer rebuilds exactly those contexts, and elicitation reaches both the prompt and the parser."""

import numpy as np
import pytest

from conftest import compose_config
from rlexp.envs import (
    ELICIT_SUFFIX,
    ExpertPolicy,
    ModelView,
    expert_actions,
    format_action,
    generate_maze,
    model_frame,
    render,
)
from rlexp.rollout.conversation import TurnFormatter, context_tokens, training_sequences
from rlexp.rollout.driver import run_rollouts, scripted_trajectories
from rlexp.rollout.engine import GenerationOutput, SamplingParams


class ScriptedEngine:
    """Replies with the expert's next action in ``text`` and records every request it gets."""

    def __init__(self, formatter, replies):
        self.formatter, self.replies, self.requests = formatter, replies, []

    def generate(self, requests, params):
        self.requests.append(requests)
        text = self.replies[len(self.requests) - 1]
        ids = self.formatter.processor.tokenizer.encode(text, add_special_tokens=False) + [self.formatter.eos_id]
        return [GenerationOutput(ids, [-0.1] * len(ids), text, "stop") for _ in requests]


@pytest.fixture(scope="module")
def formatter(tiny_processor):
    return TurnFormatter(tiny_processor)


def test_env_defaults_are_visgyms_and_skyrl_prompt_turns_them_off():
    assert ModelView.from_config(compose_config("env=maze_easy", "~experiment").env) == ModelView(
        "jpeg", "visgym", True
    )
    assert ModelView.from_config(compose_config("env=maze_hard", "~experiment").env) == ModelView(
        "jpeg", "visgym", True
    )
    skyrl = compose_config("~experiment", "env.prompt=skyrl_instruct", "env.action_format=action_tag").env
    assert ModelView.from_config(skyrl) == ModelView("png", "last_k", False)
    tiny = compose_config().env  # experiment=tiny_cpu
    assert ModelView.from_config(tiny) == ModelView("jpeg", "visgym", False)


def test_engine_sees_jpeg_frames_and_visgym_history_and_the_trainer_scores_the_same(formatter):
    env_cfg = compose_config("~experiment", "env.history_window=1").env
    maze = generate_maze(9, 0)  # 12 moves + stop
    moves = [int(a) for a in expert_actions(maze)]
    # elicitation on: the reply's first <answer> decides, whatever comes after it
    replies = [f"<think>go</think><answer>{format_action(a, 'visgym_tuple')}</answer> ('move', 9)" for a in moves]
    engine = ScriptedEngine(formatter, replies)
    (trajectory,) = run_rollouts(engine, formatter, [maze], env_cfg, 1, SamplingParams(), max_turns=len(moves))
    assert trajectory.success and trajectory.num_invalid == 0
    assert trajectory.task_prompt.endswith(ELICIT_SUFFIX) and trajectory.history_style == "visgym"
    for t, (requests,) in enumerate(engine.requests):
        turn = trajectory.turns[t]
        np.testing.assert_array_equal(turn.image, model_frame(render(maze, turn.position), "jpeg"))
        assert len(requests.images) == min(t, 1) + 1  # one earlier turn + the current one
        np.testing.assert_array_equal(requests.images[-1], turn.image)
        assert requests.prompt_token_ids == context_tokens(formatter, trajectory, t, 1).token_ids
    for t, sequence in enumerate(training_sequences(formatter, trajectory, env_cfg.history_window)):
        prompt = engine.requests[t][0].prompt_token_ids
        assert sequence.token_ids == prompt + trajectory.turns[t].response_ids


def test_png_frames_are_the_exact_render(formatter):
    env_cfg = compose_config("~experiment", "env.image_format=png").env
    maze = generate_maze(9, 0)  # 12 moves + stop
    (trajectory,) = scripted_trajectories(ExpertPolicy(), [maze], env_cfg, 1, 20)
    assert trajectory.success
    for turn in trajectory.turns:
        np.testing.assert_array_equal(turn.image, render(maze, turn.position))
