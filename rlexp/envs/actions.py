"""Parsing model text into maze actions, and the inverse.

``visgym_tuple`` follows VisGym: its interactor's ``parse_output`` (strip code fences, backticks,
box/think markers and "Action:" labels; quote a bare first identifier, ``(move, 0)``; take the
last parenthesised span that ``ast.literal_eval`` turns into a tuple whose first item is a str)
and then its env's validation of that tuple, with the same feedback strings. So the last
*action-shaped* tuple decides: ``('move', 0) ... ('move', 9)`` is invalid, as in VisGym. When no
span is action-shaped, ``parse_output`` hands the text on unchanged and the env's ``step`` calls
``ast.literal_eval`` on it, so a bare ``'move', 0`` (no parentheses) is the action ``('move', 0)``
and ``0`` or ``'move', 0, 1`` get the env's tuple-shape error.

With ``elicit=True`` (VisGym's ``--elicit-verbalization``) only the text inside the FIRST
``<answer>`` is read (to the end of the text when it is not closed), as VisGym's
``vlm_out.split("<answer>")[1].split("</answer>")[0]``; text without ``<answer>`` is read whole.
Without elicitation ``<answer>`` tags are ordinary text, as in VisGym.

``action_tag`` follows SkyRL's instruct recipe: the last ``<action>word</action>`` (case-insensitive)
decides; an unknown word makes the action invalid.

Parsing never raises on model text. Cost is bounded for any input: only the last 8 KiB of the
relevant text is scanned, spans longer than 256 characters are skipped (no action is that long),
at most 64 spans are given to ``ast.literal_eval`` (never ``eval``), and the bare-tuple reading
is tried only on text of at most 8 KiB that holds at most 256 characters besides surrounding
whitespace.
"""

from __future__ import annotations

import ast
import re
import warnings

from rlexp.envs.maze import MOVE_DOWN, MOVE_LEFT, MOVE_RIGHT, MOVE_UP, STOP
from rlexp.envs.prompts import (
    ACTION_FORMATS,
    INVALID_ACTION,
    TAG_PARSE_ERROR,
    TUPLE_SHAPE_ERROR,
    cannot_parse,
    not_in_action_space,
    unknown_action_name,
)

__all__ = ["ACTION_FORMATS", "answer_region", "parse_action", "format_action", "check_action_format"]

_MAX_SCAN_CHARS = 8192
_MAX_SPAN_CHARS = 256
_MAX_LITERAL_EVALS = 64

_KEYWORDS = {"right": MOVE_RIGHT, "up": MOVE_UP, "left": MOVE_LEFT, "down": MOVE_DOWN, "stop": STOP}
_KEYWORD_OF = {v: k for k, v in _KEYWORDS.items()}
_TAG_RE = re.compile(r"<action>\s*(\w+)\s*</action>", re.IGNORECASE)
_FENCE_RE = re.compile(r"```[\w-]*")
_ACTION_LABEL_RE = re.compile(r"\bAction\s*:\s*", re.IGNORECASE)
_SPACE_RE = re.compile(r"\s+")
_PAREN_RE = re.compile(r"[()]")
_BARE_NAME_RE = re.compile(r"^\(\s*([A-Za-z_]\w*)(\s*,)")
_MARKERS = ("<|begin_of_box|>", "<|end_of_box|>", "\u25c1think\u25b7", "\u25c1/think\u25b7")
_STOP_PAYLOAD_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def check_action_format(action_format: str) -> None:
    if action_format not in ACTION_FORMATS:
        raise ValueError(f"unknown action_format {action_format!r}; choose one of {ACTION_FORMATS}")


def parse_action(text: str, action_format: str, elicit: bool = False) -> tuple[int | None, str | None]:
    """``(action, None)`` for a valid action, else ``(None, feedback)`` with the env's error text.

    ``elicit``: the prompt asked for ``<think>…</think><answer>…</answer>``; read the first answer.
    Raises ValueError only for an unknown ``action_format``; any ``text`` is safe.
    """
    check_action_format(action_format)
    if not isinstance(text, str):
        return None, INVALID_ACTION
    if elicit:
        text = answer_region(text)
    if action_format == "action_tag":
        return _parse_tag(text)
    return _parse_tuple(text)


def answer_region(text: str) -> str:
    """VisGym's answer extraction: inside the first ``<answer>`` (to the end if unclosed), else all."""
    opening = text.find("<answer>")
    if opening < 0:
        return text
    region = text[opening + len("<answer>") :]
    closing = region.find("</answer>")
    return region if closing < 0 else region[:closing]


def format_action(action: int, action_format: str) -> str:
    """What an expert writes for ``action``; ``parse_action`` inverts it."""
    check_action_format(action_format)
    if action not in _KEYWORD_OF:
        raise ValueError(f"action must be one of 0..4, got {action!r}")
    if action_format == "action_tag":
        return f"<action>{_KEYWORD_OF[action]}</action>"
    return "('stop', 'stop')" if action == STOP else f"('move', {action})"


def _parse_tag(text: str) -> tuple[int | None, str | None]:
    matches = _TAG_RE.findall(text[-_MAX_SCAN_CHARS:])
    if not matches:
        return None, TAG_PARSE_ERROR
    action = _KEYWORDS.get(matches[-1].lower())
    return (action, None) if action is not None else (None, TAG_PARSE_ERROR)


def _parse_tuple(text: str) -> tuple[int | None, str | None]:
    action_tuple = _last_action_tuple(_normalize(text[-_MAX_SCAN_CHARS:]))
    if action_tuple is None:
        return _parse_bare(text)
    return _validate(action_tuple)


def _parse_bare(text: str) -> tuple[int | None, str | None]:
    """VisGym's env ``step``: ``ast.literal_eval`` of the text itself, so ``'move', 0`` is a tuple."""
    if len(text) > _MAX_SCAN_CHARS or len(text.strip()) > _MAX_SPAN_CHARS:
        return None, cannot_parse(text)
    try:
        value = _literal(text)
    except Exception:  # VisGym: "Cannot parse action string ..."
        return None, cannot_parse(text)
    if not isinstance(value, tuple) or len(value) != 2:
        return None, TUPLE_SHAPE_ERROR
    return _validate(value)


def _normalize(text: str) -> str:
    text = _FENCE_RE.sub("", text).replace("`", "")
    for marker in _MARKERS:
        text = text.replace(marker, "")
    text = _ACTION_LABEL_RE.sub(" ", text)
    return _SPACE_RE.sub(" ", text).strip()


def _last_action_tuple(text: str) -> tuple | None:
    """The action-shaped tuple of the balanced ``(...)`` span that starts last."""
    spans, open_at = [], []
    for match in _PAREN_RE.finditer(text):
        i = match.start()
        if text[i] == "(":
            open_at.append(i)
        elif open_at:
            start = open_at.pop()
            if i + 1 - start <= _MAX_SPAN_CHARS:
                spans.append((start, i + 1))
    spans.sort(reverse=True)
    for start, end in spans[:_MAX_LITERAL_EVALS]:
        candidate = _BARE_NAME_RE.sub(r"('\1'\2", text[start:end], count=1)
        try:
            value = _literal(candidate)
        except Exception:  # any malformed literal just means "not an action"
            continue
        if isinstance(value, tuple) and value and isinstance(value[0], str):
            return value
    return None


def _literal(text: str):
    """``ast.literal_eval`` without the SyntaxWarnings Python prints for text like ``0or 1`` (model output
    would fill the log with them); errors still raise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        return ast.literal_eval(text)


def _validate(action_tuple: tuple) -> tuple[int | None, str | None]:
    """VisGym's env check: ``move`` takes Discrete(4), ``stop`` takes Text(4) (1-4 alphanumerics)."""
    if len(action_tuple) != 2:
        return None, TUPLE_SHAPE_ERROR
    name, payload = action_tuple
    if name == "move":
        if isinstance(payload, int) and 0 <= payload <= 3:
            return int(payload), None
        return None, not_in_action_space(payload, name)
    if name == "stop":
        if isinstance(payload, str) and 1 <= len(payload) <= 4 and set(payload) <= _STOP_PAYLOAD_CHARS:
            return STOP, None
        return None, not_in_action_space(payload, name)
    return None, unknown_action_name(name)
