"""Every string the model reads: task instructions, per-turn text, environment feedback.

Wording is VisGym ``maze_2d``'s (``get_prompt``, ``step``) and its interactor's
(``run_episode``); the ``skyrl_instruct`` style appends the format instruction of SkyRL's
``examples/train/visgym`` recipes. A conversation is built as VisGym builds it:

- first user turn (with the first image): ``task_prompt(...)`` = instructions + "\\n" + step text;
- every later user turn (with the new image): ``turn_text(feedback, step, max_steps)``;
- with ``elicit=True`` (VisGym's ``--elicit-verbalization``) the instructions end with ``ELICIT_SUFFIX``;
- when VisGym's history window cuts the conversation, the oldest kept turn becomes
  ``history_head(instructions, text)``.
"""

from __future__ import annotations

import re

PROMPTS = ("visgym", "skyrl_instruct")
#: also exported by ``actions``; defined here so this module depends on nothing.
ACTION_FORMATS = ("visgym_tuple", "action_tag")

# --- environment feedback (VisGym's exact strings) -------------------------------------------
ACTION_EXECUTED = "Action executed successfully."
WALL_BUMP = "Cannot move into a wall."
TUPLE_SHAPE_ERROR = (
    "The action format is invalid. The action should be a tuple of two elements with the first "
    "element being the action name and the second element being the action payload."
)
#: given for ``None`` actions passed to the env (the caller's parser already failed)
INVALID_ACTION = "Cannot parse action string so the action is invalid."
#: SkyRL's instruct-recipe parse error (``<action>`` format)
TAG_PARSE_ERROR = (
    "Action parsing failed. Could not find a valid action in your response.\n"
    "Please end your response with <action>ACTION</action> where ACTION is one of: down, left, right, stop, up"
)

_CLIP_CHARS = 200


def _clip(text: str) -> str:
    return text if len(text) <= _CLIP_CHARS else text[:_CLIP_CHARS] + "..."


def cannot_parse(text: str) -> str:
    """VisGym's parse failure, without the Python exception text (it varies by Python version)
    and with the echoed model output clipped to 200 characters."""
    return f"Cannot parse action string {_clip(repr(text))} so the action is invalid."


def not_in_action_space(payload: object, name: str) -> str:
    return f"The action {_clip(str(payload))} is not in the valid action space of {name} so nothing is executed."


def unknown_action_name(name: object) -> str:
    return f"The action name '{_clip(str(name))}' is not recognized in the available action space."


# --- task instructions --------------------------------------------------------------------------
_SCENE = (
    "You are navigating a {size}x{size} maze. The maze consists of walls (gray) and paths (white). "
    "You are represented by a blue circle, and your goal is to reach the red target square."
)

_ACTIONS = {
    "visgym_tuple": (
        "Available actions:\n"
        "1. 'move': Move in one of four directions. Format: `('move', direction)` where direction is an integer:\n"
        "   - 0=right, 1=up, 2=left, 3=down\n"
        "2. 'stop': End the navigation session. Format: `('stop', 'stop')`"
    ),
    "action_tag": (
        "Available actions:\n"
        "1. 'move': Move in one of four directions. Format: `<action>direction</action>` where direction is one of:\n"
        "   - right, up, left, down\n"
        "2. 'stop': End the navigation session. Format: `<action>stop</action>`"
    ),
}

_SUCCESS = "Success: You succeed if you reach the red target square."

_EXAMPLES = {
    "visgym_tuple": (
        "Please respond with exactly one action and its arguments in the specified format. For example:\n"
        "- To move right: `('move', 0)`\n"
        "- To move up: `('move', 1)`\n"
        "- To move left: `('move', 2)`\n"
        "- To move down: `('move', 3)`\n"
        "- To stop: `('stop', 'stop')`"
    ),
    "action_tag": (
        "Please respond with exactly one action in the specified format. For example:\n"
        "- To move right: `<action>right</action>`\n"
        "- To move up: `<action>up</action>`\n"
        "- To move left: `<action>left</action>`\n"
        "- To move down: `<action>down</action>`\n"
        "- To stop: `<action>stop</action>`"
    ),
}

# SkyRL visgym recipes: from-SFT (tuples) and from-instruct (keyword tags).
_SKYRL_FORMAT_INSTRUCTION = {
    "visgym_tuple": (
        "\n\nIMPORTANT: Respond with exactly one action as a Python tuple, e.g. ('move', 0) or ('stop', 'stop'). "
        "Do not wrap the action in backticks, code blocks, or other formatting."
    ),
    "action_tag": (
        "\n\nIMPORTANT: You must end your response with your chosen action in this exact format: "
        "<action>ACTION</action> where ACTION is one of: left, right, up, down, stop."
    ),
}


#: VisGym's ``Interactor._xml_prompt()``, appended to the instructions with ``--elicit-verbalization``.
ELICIT_SUFFIX = "\n\nVerbalize your reasoning in <think>…</think> and give the final result in <answer>…</answer>."


def instructions(prompt: str, action_format: str, size: int, elicit: bool = False) -> str:
    """The task description alone (VisGym's ``get_prompt()`` for ``visgym`` + ``visgym_tuple``),
    plus ``ELICIT_SUFFIX`` when ``elicit``."""
    if prompt not in PROMPTS:
        raise ValueError(f"unknown prompt {prompt!r}; choose one of {PROMPTS}")
    if action_format not in ACTION_FORMATS:
        raise ValueError(f"unknown action_format {action_format!r}; choose one of {ACTION_FORMATS}")
    text = "\n\n".join((_SCENE.format(size=size), _ACTIONS[action_format], _SUCCESS, _EXAMPLES[action_format]))
    if prompt == "skyrl_instruct":
        text += _SKYRL_FORMAT_INSTRUCTION[action_format]
    return (text + ELICIT_SUFFIX) if elicit else text


def step_text(step: int, max_steps: int) -> str:
    """VisGym's per-turn budget line. ``step`` = actions already taken (0 before the first).

    E.g. ``step_text(0, 20)`` = "This is step 1. You are allowed to take 19 more steps."
    """
    return f"This is step {step + 1}. You are allowed to take {max_steps - step - 1} more steps."


def task_prompt(prompt: str, action_format: str, max_steps: int, *, size: int, elicit: bool = False) -> str:
    """The complete text of the first user turn: instructions + "\\n" + ``step_text(0, max_steps)``."""
    return instructions(prompt, action_format, size, elicit) + "\n" + step_text(0, max_steps)


def turn_text(feedback: str, step: int, max_steps: int) -> str:
    """Text of a later user turn (VisGym with ``include_env_feedback``); ``step`` as in ``step_text``."""
    return f"Environment feedback: {feedback}\n\n{step_text(step, max_steps)}"


_FEEDBACK_RE = re.compile(r"(?s)Environment feedback:.*?(?=This is step)")


def history_head(instructions_text: str, text: str) -> str:
    """The oldest turn VisGym keeps once ``num_interaction_history`` cuts the conversation.

    VisGym's ``BaseVLM.prune_conversation_history`` rewrites that user message in place: unless it
    already holds the instructions, it deletes ``Environment feedback: … `` up to "This is step" and
    puts the instructions in front, with no separator (so "…`('stop', 'stop')`This is step 3. …").
    """
    if instructions_text in text:
        return text
    return instructions_text + drop_feedback(text)


def drop_feedback(text: str) -> str:
    """``text`` without its "Environment feedback: …" part (VisGym's regex, up to "This is step")."""
    return _FEEDBACK_RE.sub("", text)
