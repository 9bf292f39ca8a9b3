"""Action parsing (both formats), its tolerance and robustness, and the prompt wording."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlexp.envs.actions import ACTION_FORMATS, format_action, parse_action
from rlexp.envs.maze import MOVE_DOWN, MOVE_LEFT, MOVE_RIGHT, MOVE_UP, STOP
from rlexp.envs.prompts import PROMPTS, instructions, step_text, task_prompt, turn_text

TUPLE, TAG = "visgym_tuple", "action_tag"


@pytest.mark.parametrize("fmt", ACTION_FORMATS)
@pytest.mark.parametrize("action", range(5))
def test_format_then_parse_round_trip(fmt, action):
    assert parse_action(format_action(action, fmt), fmt) == (action, None)


def test_expert_strings_are_visgyms():
    assert [format_action(a, TUPLE) for a in range(5)] == [
        "('move', 0)",
        "('move', 1)",
        "('move', 2)",
        "('move', 3)",
        "('stop', 'stop')",
    ]
    assert format_action(MOVE_LEFT, TAG) == "<action>left</action>"


def test_unknown_format_names_the_choices():
    for call in (lambda: parse_action("x", "json"), lambda: format_action(0, "json")):
        with pytest.raises(ValueError, match="visgym_tuple.*action_tag"):
            call()
    with pytest.raises(ValueError):
        format_action(5, TUPLE)


@pytest.mark.parametrize(
    "text, action",
    [
        ("('move', 0)", MOVE_RIGHT),
        ("```python\n('move', 3)\n```", MOVE_DOWN),
        ("`('move', 1)`", MOVE_UP),
        ("```\n('stop', 'stop')\n```", STOP),
        ('("move", 2)', MOVE_LEFT),
        ("Action: (move, 2)", MOVE_LEFT),  # bare name gets quoted, as VisGym does
        ("( 'move' ,\n 3 )", MOVE_DOWN),
        ("I could go ('move', 1) but ('move', 0) is better.", MOVE_RIGHT),  # last wins
        ("(('move', 0), 'x')", MOVE_RIGHT),  # the inner span starts last
        ("<think>('move', 1)</think><answer>('move', 2)</answer>", MOVE_LEFT),
        # without elicitation <answer> is ordinary text (VisGym): the last tuple decides
        ("<answer>('move', 1)</answer> text <answer>('stop', 'stop')</answer>", STOP),
        ("<answer>```('move', 3)```", MOVE_DOWN),  # unclosed answer: read to the end
        ("<|begin_of_box|>('move', 0)<|end_of_box|>", MOVE_RIGHT),
        ("('stop', 'now')", STOP),  # VisGym's stop payload is Text(4): 1-4 alphanumerics
    ],
)
def test_tuple_parser_tolerance(text, action):
    assert parse_action(text, TUPLE) == (action, None)


@pytest.mark.parametrize(
    "text, error",
    [
        ("hello", "Cannot parse action string 'hello' so the action is invalid."),
        ("", "Cannot parse action string '' so the action is invalid."),
        ("('move', 7)", "The action 7 is not in the valid action space of move so nothing is executed."),
        ("('move', '0')", "The action 0 is not in the valid action space of move so nothing is executed."),
        ("('stop', 'please')", "The action please is not in the valid action space of stop so nothing is executed."),
        ("('jump', 1)", "The action name 'jump' is not recognized in the available action space."),
        ("('move',)", "The action format is invalid. The action should be a tuple of two elements"),
        ("('move', 0, 1)", "The action format is invalid."),
        # The last action-shaped tuple decides, valid or not (VisGym): no fallback to ('move', 0).
        ("('move', 0) then ('move', 9)", "The action 9 is not in the valid action space of move"),
        ("__import__('os').system('echo hi')", "Cannot parse action string"),
        ("open('/etc/passwd').read()", "Cannot parse action string"),
    ],
)
def test_tuple_parser_errors_use_visgym_feedback(text, error):
    action, feedback = parse_action(text, TUPLE)
    assert action is None and feedback.startswith(error)


@pytest.mark.parametrize(
    "text, action",
    [
        ("'move', 0", MOVE_RIGHT),
        ("'stop', 'stop'", STOP),
        ("  'move', 3\n", MOVE_DOWN),
        ('"move", 1', MOVE_UP),
    ],
)
def test_tuple_parser_accepts_a_bare_tuple_as_visgyms_env_does(text, action):
    """VisGym's parse_output finds no (...) span and passes the text on; its env's literal_eval reads a tuple."""
    assert parse_action(text, TUPLE) == (action, None)
    assert parse_action(f"<answer>{text}</answer>", TUPLE, elicit=True) == (action, None)


@pytest.mark.parametrize(
    "text, error",
    [
        ("move, 0", "Cannot parse action string 'move, 0' so the action is invalid."),  # no quoting without (...)
        ("0", "The action format is invalid."),
        ("'move'", "The action format is invalid."),
        ("'move', 0, 1", "The action format is invalid."),
        ("'move', 9", "The action 9 is not in the valid action space of move"),
        ("1, 2", "The action name '1' is not recognized"),
        ("'move', " + " " * 300 + "0", "Cannot parse action string"),  # longer than any action: not evaluated
    ],
)
def test_bare_tuple_errors_use_visgym_feedback(text, error):
    action, feedback = parse_action(text, TUPLE)
    assert action is None and feedback.startswith(error)


@pytest.mark.parametrize(
    "text, action",
    [
        ("<think>maybe ('move', 3)</think><answer>('move', 0)</answer>", MOVE_RIGHT),
        ("<answer>('move', 1)</answer> text <answer>('stop', 'stop')</answer>", MOVE_UP),  # the FIRST answer
        ("<think>go ('move', 1)?</think><answer>('move', 2)", MOVE_LEFT),  # unclosed: read to the end
        ("no tags at all: ('move', 2) then ('move', 3)", MOVE_DOWN),  # no <answer>: the whole text
        ("<answer>`('move', 1)`</answer>", MOVE_UP),
    ],
)
def test_elicitation_reads_the_first_answer(text, action):
    assert parse_action(text, TUPLE, elicit=True) == (action, None)


@pytest.mark.parametrize(
    "text, error",
    [
        ("<answer>no tuple here</answer> ('move', 0)", "Cannot parse action string 'no tuple here'"),
        ("<think><answer>x</answer></think><answer>('move', 0)</answer>", "Cannot parse action string 'x'"),
        ("<answer></answer>('move', 0)", "Cannot parse action string ''"),
    ],
)
def test_elicitation_errors_come_from_the_first_answer(text, error):
    action, feedback = parse_action(text, TUPLE, elicit=True)
    assert action is None and feedback.startswith(error)
    assert parse_action(text, TUPLE)[0] == MOVE_RIGHT  # without elicitation the tags mean nothing


def test_elicitation_applies_to_the_tag_format_too():
    text = "<answer><action>left</action></answer> <action>stop</action>"
    assert parse_action(text, TAG, elicit=True) == (MOVE_LEFT, None)
    assert parse_action(text, TAG) == (STOP, None)


def test_feedback_clips_long_outputs():
    _, feedback = parse_action("word " * 10_000, TUPLE)
    assert feedback.startswith("Cannot parse action string 'word word") and len(feedback) < 300


@pytest.mark.parametrize(
    "text, action",
    [
        ("<action>left</action>", MOVE_LEFT),
        ("<ACTION>Up</Action>", MOVE_UP),
        ("<action> down </action>", MOVE_DOWN),
        ("think... <action>right</action> no wait <action>stop</action>", STOP),
    ],
)
def test_tag_parser(text, action):
    assert parse_action(text, TAG) == (action, None)


@pytest.mark.parametrize("text", ["left", "<action>jump</action>", "<action>up down</action>", "('move', 0)", ""])
def test_tag_parser_errors_use_skyrl_feedback(text):
    action, feedback = parse_action(text, TAG)
    assert action is None and feedback.startswith("Action parsing failed. Could not find a valid action")


def test_tag_parser_last_tag_decides():
    assert parse_action("<action>up</action> <action>jump</action>", TAG)[0] is None


@settings(max_examples=300, deadline=None)
@given(text=st.text(), fmt=st.sampled_from(ACTION_FORMATS), elicit=st.booleans())
def test_parser_never_raises_on_any_text(text, fmt, elicit):
    action, feedback = parse_action(text, fmt, elicit)
    assert (action is None) != (feedback is None)
    assert action is None or 0 <= action <= 4


_fragments = st.sampled_from(
    [
        "(",
        ")",
        "('move', ",
        "0",
        "9",
        "'stop'",
        "'move', 0",
        ",",
        "<answer>",
        "</answer>",
        "`",
        "```",
        "[",
        "{",
        "'",
        '"',
        "\\",
        "\x00",
        "é",
        "1e9999",
        "move",
        " ",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(_fragments, max_size=200),
    repeat=st.integers(1, 50),
    fmt=st.sampled_from(ACTION_FORMATS),
    elicit=st.booleans(),
)
def test_parser_never_raises_on_adversarial_text(parts, repeat, fmt, elicit):
    action, feedback = parse_action("".join(parts) * repeat, fmt, elicit)
    assert (action is None) != (feedback is None)


HUGE_INPUTS = {
    "open_parens": "(" * 200_000,
    "balanced_parens": "(" * 5_000 + ")" * 5_000,
    "deep_nested_tuple": "(" * 100 + "'move', 0" + ")" * 100,
    "huge_int": "('move', " + "9" * 100_000 + ")",
    "3MB_prefix": "x" * 3_000_000 + "('move', 1)",
    "many_tuples": "('move', 1)" * 100_000,
    "many_answer_tags": "<answer>" * 100_000,
    "huge_answer": "<answer>" + "('move', 1) " * 300_000 + "</answer>",
    "bare_padded": "'move', 0" + " " * 3_000_000,
    "nested_lists": "[" * 10_000 + "]" * 10_000,
}


@pytest.mark.parametrize("text", HUGE_INPUTS.values(), ids=HUGE_INPUTS.keys())
def test_parser_is_bounded_on_huge_inputs(text):
    start = time.perf_counter()
    for fmt in ACTION_FORMATS:
        for elicit in (False, True):
            action, feedback = parse_action(text, fmt, elicit)
            assert (action is None) != (feedback is None)
    assert time.perf_counter() - start < 2.0


def test_non_string_input_is_invalid_not_an_error():
    assert parse_action(None, TUPLE)[0] is None  # type: ignore[arg-type]


# VisGym maze_2d get_prompt() for a 9x9 maze in rgb_array mode, assembled by hand from its source.
VISGYM_9x9_PROMPT = (
    "You are navigating a 9x9 maze. "
    "The maze consists of walls (gray) and paths (white). "
    "You are represented by a blue circle, and your goal is to reach the red target square."
    "\n\nAvailable actions:\n"
    "1. 'move': Move in one of four directions. Format: `('move', direction)` where direction is an integer:\n"
    "   - 0=right, 1=up, 2=left, 3=down"
    "\n"
    "2. 'stop': End the navigation session. Format: `('stop', 'stop')`"
    "\n\nSuccess: You succeed if you reach the red target square."
    "\n\nPlease respond with exactly one action and its arguments in the specified format. For example:\n"
    "- To move right: `('move', 0)`\n"
    "- To move up: `('move', 1)`\n"
    "- To move left: `('move', 2)`\n"
    "- To move down: `('move', 3)`\n"
    "- To stop: `('stop', 'stop')`"
)


def test_visgym_prompt_matches_visgym_exactly():
    assert instructions("visgym", TUPLE, 9) == VISGYM_9x9_PROMPT
    first_turn = task_prompt("visgym", TUPLE, 20, size=9)
    assert first_turn == VISGYM_9x9_PROMPT + "\nThis is step 1. You are allowed to take 19 more steps."
    assert "You are navigating a 11x11 maze." in task_prompt("visgym", TUPLE, 30, size=11)


def test_elicitation_prompt_is_visgyms_xml_prompt():
    """VisGym's run_episode: instructions += Interactor._xml_prompt(), then + "\\n" + the step text."""
    xml = "\n\nVerbalize your reasoning in <think>…</think> and give the final result in <answer>…</answer>."
    assert instructions("visgym", TUPLE, 9, elicit=True) == VISGYM_9x9_PROMPT + xml
    assert task_prompt("visgym", TUPLE, 20, size=9, elicit=True) == (
        VISGYM_9x9_PROMPT + xml + "\nThis is step 1. You are allowed to take 19 more steps."
    )


def test_step_and_turn_text_follow_visgym_counting():
    assert step_text(0, 20) == "This is step 1. You are allowed to take 19 more steps."
    assert step_text(19, 20) == "This is step 20. You are allowed to take 0 more steps."
    assert turn_text("Cannot move into a wall.", 3, 30) == (
        "Environment feedback: Cannot move into a wall.\n\nThis is step 4. You are allowed to take 26 more steps."
    )


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("fmt", ACTION_FORMATS)
def test_every_prompt_shows_its_action_format(prompt, fmt):
    text = task_prompt(prompt, fmt, 20, size=9)
    for action in range(5):
        assert format_action(action, fmt) in text
    other = TAG if fmt == TUPLE else TUPLE
    assert format_action(MOVE_LEFT, other) not in text
    assert ("IMPORTANT:" in text) == (prompt == "skyrl_instruct")


def test_unknown_prompt_names_the_choices():
    with pytest.raises(ValueError, match="visgym.*skyrl_instruct"):
        task_prompt("chatty", TUPLE, 20, size=9)


@pytest.mark.parametrize("text", ["('move', 0or 1)", "(1in (1,))", "('stop', 1and 2)", "1is 1"])
def test_model_text_python_warns_about_is_parsed_silently(text, recwarn):
    for fmt in ACTION_FORMATS:
        action, feedback = parse_action(text, fmt)
        assert action is None and feedback
    assert not [w for w in recwarn if issubclass(w.category, SyntaxWarning)]
