"""What the policy is trained on is exactly what it saw: contexts, training sequences and loss masks."""

import numpy as np
import pytest

from rlexp.rollout.conversation import Trajectory, Turn, TurnFormatter, context_tokens, training_sequences


@pytest.fixture(scope="module")
def formatter(tiny_processor):
    return TurnFormatter(tiny_processor)


def _trajectory(formatter, replies: list[list[int]]) -> Trajectory:
    trajectory = Trajectory(maze_index=0, sample_index=0, task_prompt="Find the red goal.")
    for k, reply in enumerate(replies):
        image = np.full((225, 225, 3), 40 * k, dtype=np.uint8)
        turn = Turn(image=image, text=f"This is step {k + 1}.", response_ids=reply, logprobs=[-0.5] * len(reply))
        trajectory.turns.append(turn)
    return trajectory


def _reply_positions(sequence, reply):
    """Start indices where ``reply`` occurs as a run in the sequence."""
    ids, n = sequence.token_ids, len(reply)
    return [i for i in range(len(ids) - n + 1) if ids[i : i + n] == reply]


def test_full_history_is_one_sequence_masking_only_model_tokens(formatter):
    eos = formatter.eos_id
    replies = [[101, 102, eos], [103, 104, 105], [106, eos]]
    trajectory = _trajectory(formatter, replies)
    (sequence,) = training_sequences(formatter, trajectory, history_window=None)
    assert len(sequence.loss_mask) == len(sequence.token_ids) == len(sequence.engine_logprobs)
    masked = [t for t, m in zip(sequence.token_ids, sequence.loss_mask) if m]
    assert masked == [t for r in replies for t in r]
    for reply in replies:
        (start,) = _reply_positions(sequence, reply)
        assert sequence.loss_mask[start : start + len(reply)] == [1] * len(reply)
    assert sum(sequence.loss_mask) == sum(len(r) for r in replies)
    assert sequence.vision.image_grid_thw.shape[0] == 3  # one image per turn


def test_training_sequence_extends_each_generation_context(formatter):
    eos = formatter.eos_id
    trajectory = _trajectory(formatter, [[101, eos], [102, 103], [104, eos]])
    (sequence,) = training_sequences(formatter, trajectory, history_window=None)
    for t in range(3):
        context = context_tokens(formatter, trajectory, t, None)
        assert sequence.token_ids[: len(context.token_ids)] == context.token_ids
        assert sum(context.loss_mask) == 0


def test_reply_without_eos_gets_closed_by_next_observation(formatter):
    eos = formatter.eos_id
    trajectory = _trajectory(formatter, [[101, 102], [103, eos]])
    context = context_tokens(formatter, trajectory, 1, None)
    after_reply = context.token_ids[_reply_positions(context, [101, 102])[0] + 2]
    assert after_reply == eos  # the template's end-of-turn token follows a reply cut at the token cap
    trajectory = _trajectory(formatter, [[101, eos], [103, eos]])
    context = context_tokens(formatter, trajectory, 1, None)
    start = _reply_positions(context, [101, eos])[0]
    assert context.token_ids[start + 2] != eos  # no doubled EOS


def test_history_window_gives_one_sample_per_turn_with_its_own_context(formatter):
    eos = formatter.eos_id
    replies = [[101, eos], [102, eos], [103, eos], [104, eos]]
    trajectory = _trajectory(formatter, replies)
    sequences = training_sequences(formatter, trajectory, history_window=2)
    assert len(sequences) == 4
    for t, sequence in enumerate(sequences):
        context = context_tokens(formatter, trajectory, t, 2)
        assert sequence.token_ids[: len(context.token_ids)] == context.token_ids
        masked = [tok for tok, m in zip(sequence.token_ids, sequence.loss_mask) if m]
        assert masked == replies[t]
        assert sequence.vision.image_grid_thw.shape[0] == min(t + 1, 2)
    # the task prompt is in every windowed context: the first observation always carries it
    prompt_ids = formatter.processor.tokenizer.encode("Find the red goal.", add_special_tokens=False)
    for sequence in sequences:
        ids = sequence.token_ids
        assert any(ids[i : i + len(prompt_ids)] == prompt_ids for i in range(len(ids)))
