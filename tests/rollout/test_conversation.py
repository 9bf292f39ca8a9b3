"""What the policy is trained on is exactly what it saw: contexts, training sequences and loss masks."""

import numpy as np
import pytest
from PIL import Image

from rlexp.rollout.conversation import (
    Trajectory,
    Turn,
    TurnFormatter,
    context_tokens,
    observation_text,
    training_sequences,
)


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


# --- VisGym's num_interaction_history ---------------------------------------------------------------

INSTRUCTIONS = "Find the red goal."
FEEDBACK = "Environment feedback: Cannot move into a wall.\n\n"


def _step(k: int) -> str:
    return f"This is step {k + 1}. You are allowed to take {19 - k} more steps."


def _visgym_trajectory(formatter, n: int, style: str = "visgym") -> Trajectory:
    """Turn texts as the driver writes them: the step text, after the first turn with the feedback."""
    eos = formatter.eos_id
    trajectory = Trajectory(maze_index=0, sample_index=0, task_prompt=INSTRUCTIONS, history_style=style)
    for k in range(n):
        image = np.full((225, 225, 3), 40 * k, dtype=np.uint8)
        text = _step(k) if k == 0 else FEEDBACK + _step(k)
        trajectory.turns.append(Turn(image=image, text=text, response_ids=[101 + k, eos], logprobs=[-0.5, -0.1]))
    return trajectory


def _visgym_user_texts(turn_texts: list[str], turn_index: int, k: int) -> list[str]:
    """The user messages VisGym sends at ``turn_index``, replayed with its own code's logic.

    ``Interactor.run_episode`` builds each prompt (the first: instructions + "\\n" + step text; later:
    feedback + "\\n\\n" + step text) and calls ``BaseVLM.prune_conversation_history(k, instructions)``
    before appending it: keep the last 2k messages and, unless the oldest kept one holds the
    instructions, drop its feedback and put the instructions in front.
    """
    import re

    history: list[str] = []  # user texts only; the assistant replies sit between them
    for t in range(turn_index + 1):
        step_msg = turn_texts[t][turn_texts[t].index("This is step") :]
        prompt = INSTRUCTIONS + "\n" + step_msg if t == 0 or k == 0 else turn_texts[t]
        if k == 0:
            history = []
        elif len(history) * 2 >= k * 2:
            history = history[-k:]
            if INSTRUCTIONS not in history[0]:
                history[0] = INSTRUCTIONS + re.sub(r"(?s)Environment feedback:.*?(?=This is step)", "", history[0])
        history.append(prompt)
    return history


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_visgym_history_matches_visgyms_messages_turn_by_turn(formatter, k):
    trajectory = _visgym_trajectory(formatter, 5)
    texts = [turn.text for turn in trajectory.turns]
    for t in range(5):
        expected = _visgym_user_texts(texts, t, k)
        start = t - len(expected) + 1
        ours = [observation_text(trajectory, j, j == start, k) for j in range(start, t + 1)]
        assert ours == expected
        context = context_tokens(formatter, trajectory, t, k)
        assert context.vision.image_grid_thw.shape[0] == min(t, k) + 1  # k earlier turns + the current one
        assert [int(img[0, 0, 0]) for img in context.images] == [40 * j for j in range(start, t + 1)]


def test_visgym_history_exact_context_on_a_hand_made_trajectory(formatter):
    """Turn 3 with k=2: turns 1, 2, 3; turn 1 rewritten to instructions + its step text (no separator)."""
    eos = formatter.eos_id
    trajectory = _visgym_trajectory(formatter, 4)
    assert observation_text(trajectory, 1, True, 2) == (
        "Find the red goal.This is step 2. You are allowed to take 18 more steps."
    )
    context = context_tokens(formatter, trajectory, 3, 2)

    def observation(j: int, text: str, first: bool) -> list[int]:
        if first:
            prefix, suffix = formatter.first_prefix, formatter.first_suffix
        else:  # the previous reply ended with EOS, so the template's own end-of-turn is left out
            prefix, suffix = formatter.next_prefix.removeprefix(formatter.eos_text), formatter.next_suffix
        batch = formatter.processor(text=[prefix + text + suffix], images=[Image.fromarray(trajectory.turns[j].image)])
        return list(batch["input_ids"][0])

    expected = (
        observation(1, "Find the red goal.This is step 2. You are allowed to take 18 more steps.", True)
        + [102, eos]
        + observation(2, "Environment feedback: Cannot move into a wall.\n\n" + _step(2), False)
        + [103, eos]
        + observation(3, "Environment feedback: Cannot move into a wall.\n\n" + _step(3), False)
    )
    assert context.token_ids == expected
    assert sum(context.loss_mask) == 0 and len(context.loss_mask) == len(expected)

    # last_k with k=2: turns 2 and 3, the first keeping its feedback after the task prompt
    trajectory = _visgym_trajectory(formatter, 4, style="last_k")
    assert observation_text(trajectory, 2, True, 2) == "Find the red goal.\n" + FEEDBACK + _step(2)
    assert context_tokens(formatter, trajectory, 3, 2).vision.image_grid_thw.shape[0] == 2


def test_visgym_history_window_zero_rebuilds_each_turn_as_a_first_turn(formatter):
    trajectory = _visgym_trajectory(formatter, 3)
    context = context_tokens(formatter, trajectory, 2, 0)
    assert observation_text(trajectory, 2, True, 0) == "Find the red goal.\n" + _step(2)  # feedback dropped
    assert context.vision.image_grid_thw.shape[0] == 1


def test_trainer_scores_the_visgym_context_the_engine_saw(formatter):
    trajectory = _visgym_trajectory(formatter, 5)
    sequences = training_sequences(formatter, trajectory, history_window=2)
    assert len(sequences) == 5
    for t, sequence in enumerate(sequences):
        context = context_tokens(formatter, trajectory, t, 2)
        assert sequence.token_ids == context.token_ids + trajectory.turns[t].response_ids
        assert [tok for tok, m in zip(sequence.token_ids, sequence.loss_mask) if m] == trajectory.turns[t].response_ids


def test_unknown_history_style_is_refused():
    with pytest.raises(ValueError, match="visgym.*last_k"):
        Trajectory(maze_index=0, sample_index=0, task_prompt="x", history_style="all")


@pytest.mark.parametrize("side", [288, 225])
def test_a_turn_tokenizes_and_patchifies_as_the_processor_does(formatter, tiny_processor, side):
    """288 px is kept as a uint8 frame and patchified where the model runs; 225 px (which the processor
    resizes) takes the processor's path. Both give the processor's own ids and patches, bit for bit."""
    import torch

    image = np.random.default_rng(side).integers(0, 256, (side, side, 3), dtype=np.uint8)
    turn = Turn(image=image, text="This is step 1.")
    segment = formatter.encode(turn, "Find the red goal.\nThis is step 1.", first=True, after_eos=False)
    text = formatter.first_prefix + "Find the red goal.\nThis is step 1." + formatter.first_suffix
    reference = tiny_processor(text=[text], images=[Image.fromarray(image)], return_tensors="pt")
    assert segment.token_ids == reference["input_ids"][0].tolist()
    assert (segment.vision.frames is not None) == (side == 288)
    pixel_values, grid = segment.vision.tensors("cpu")
    assert torch.equal(grid, reference["image_grid_thw"])
    assert torch.equal(pixel_values, reference["pixel_values"])
