"""Multi-turn conversations as token ids: one home for how an episode becomes what the model sees.

The rollout driver builds each generation context with :func:`context_tokens`, and the trainer
builds each training sequence with the same function, so the policy is trained on exactly the
tokens it was sampled from. The chat template's pieces are read once from the processor's own
template, so any Qwen-style checkpoint gets its own formatting.
"""

from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from rlexp.envs import HISTORY_STYLES, drop_feedback, history_head
from rlexp.models.vision import FramePatcher
from rlexp.rollout.engine import VisionInputs

_TEXT = "\x00TEXT\x00"
_REPLY = "\x00REPLY\x00"


@dataclass
class Segment:
    token_ids: list[int]
    vision: VisionInputs | None = None


@dataclass
class Turn:
    """One observation (image + text) and the model's reply to it."""

    #: the frame as the model saw it (after the ``env.image_format`` round trip).
    image: np.ndarray
    text: str
    #: the agent's (row, col) when this observation was made.
    position: tuple[int, int] = (0, 0)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    response_text: str = ""
    valid: bool = False
    #: tokenized observation, by (first in context, previous reply ended with EOS, its text).
    encoded: dict = field(default_factory=dict, repr=False)


@dataclass
class Trajectory:
    maze_index: int
    sample_index: int
    #: the task instructions (VisGym's ``get_prompt()``, plus the elicitation suffix when asked).
    task_prompt: str
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    success: bool = False
    num_invalid: int = 0
    #: the agent's (row, col) after the last turn.
    final_position: tuple[int, int] = (0, 0)
    #: how a history window cuts this conversation (``env.history_style``): "visgym" or "last_k".
    history_style: str = "last_k"

    def __post_init__(self):
        if self.history_style not in HISTORY_STYLES:
            raise ValueError(f"unknown history_style {self.history_style!r}; choose one of {HISTORY_STYLES}")

    @property
    def num_turns(self) -> int:
        return len(self.turns)


class TurnFormatter:
    """Tokenizes observations with the processor, in the chat template's format."""

    def __init__(self, processor):
        self.processor = processor
        tokenizer = processor.tokenizer
        first = self._template([_user(_TEXT)])
        self.first_prefix, self.first_suffix = first.split(_TEXT)
        later = self._template([_user("a"), {"role": "assistant", "content": [{"type": "text", "text": _REPLY}]}, _user(_TEXT)])
        self.next_prefix, self.next_suffix = later.split(_REPLY)[1].split(_TEXT)
        self.image_token = processor.image_token
        self.patcher = FramePatcher(processor.image_processor)
        self.eos_text = "<|im_end|>"
        self.eos_id = tokenizer.convert_tokens_to_ids(self.eos_text)

    def _template(self, messages) -> str:
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode(self, turn: Turn, text: str, first: bool, after_eos: bool) -> Segment:
        key = (first, after_eos, text)
        if key not in turn.encoded:
            if first:
                prefix, suffix = self.first_prefix, self.first_suffix
            else:
                prefix, suffix = self.next_prefix, self.next_suffix
                if after_eos and prefix.startswith(self.eos_text):
                    prefix = prefix[len(self.eos_text):]
            turn.encoded[key] = self._segment(prefix + text + suffix, turn.image)
        return turn.encoded[key]

    def _segment(self, text: str, image: np.ndarray) -> Segment:
        """The text with its one image: the frame kept as uint8 for ``FramePatcher`` where the processor
        would not resize it (the processor's own token ids and patches, tested), else the processor's output."""
        height, width = image.shape[:2]
        if self.patcher.handles(height, width):
            expanded = text.replace(self.image_token, self.image_token * self.patcher.num_tokens(height, width))
            frames = torch.from_numpy(np.ascontiguousarray(image))[None]
            vision = VisionInputs(None, self.patcher.grid_thw(height, width), frames=frames, patcher=self.patcher)
            return Segment(self.processor.tokenizer(expanded)["input_ids"], vision)
        batch = self.processor(text=[text], images=[Image.fromarray(image)], return_tensors="pt")
        return Segment(batch["input_ids"][0].tolist(), VisionInputs(batch["pixel_values"], batch["image_grid_thw"]))


def _user(text: str) -> dict:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


def window_start(trajectory: Trajectory, turn_index: int, history_window: int | None) -> int:
    """The first turn in the context of ``turn_index``.

    ``None``: the whole episode. k with ``last_k``: the last k turns (k >= 1). k with ``visgym``: k
    earlier turns and the current one, as VisGym's ``prune_conversation_history(k)`` keeps the last
    2k messages (k user/assistant pairs) before the current user message is added (k >= 0).
    """
    if history_window is None:
        return 0
    if trajectory.history_style == "visgym":
        return max(0, turn_index - history_window)
    return max(0, turn_index - history_window + 1)


def observation_text(
    trajectory: Trajectory, turn_index: int, first_in_context: bool, history_window: int | None = None
) -> str:
    """The turn's text as the model reads it; the first turn of a context always carries the task prompt.

    The episode's first turn reads ``task_prompt + "\\n" + step text`` in every style. A later turn
    that opens a cut context reads ``task_prompt + "\\n" + its text`` with ``last_k``; with
    ``visgym`` it is VisGym's rewrite, ``history_head`` (its feedback dropped, the instructions put in
    front with no separator), and with a window of 0 (VisGym rebuilds each turn as a first turn)
    ``task_prompt + "\\n" + step text``, without the feedback.
    """
    text = trajectory.turns[turn_index].text
    if not first_in_context:
        return text
    if turn_index == 0 or trajectory.history_style == "last_k":
        return f"{trajectory.task_prompt}\n{text}"
    if history_window == 0:
        return f"{trajectory.task_prompt}\n{drop_feedback(text)}"
    return history_head(trajectory.task_prompt, text)


@dataclass
class Sequence:
    """A token sequence with its images and a loss mask over the replies trained on."""

    token_ids: list[int]
    loss_mask: list[int]
    engine_logprobs: list[float]
    vision: VisionInputs | None
    #: the frames behind ``vision``, in prompt order (what an engine that processes images itself gets).
    images: list[np.ndarray] = field(default_factory=list)


def context_tokens(
    formatter: TurnFormatter,
    trajectory: Trajectory,
    turn_index: int,
    history_window: int | None,
    include_reply: bool = False,
    train_all_replies: bool = False,
) -> Sequence:
    """The context the model saw at ``turn_index`` (plus that turn's reply when ``include_reply``).

    With a history window of k, the context starts where ``window_start`` says (by the trajectory's
    ``history_style``) and its first observation carries the task prompt (``observation_text``).
    Loss mask: 1 on the last reply, and on earlier replies too when ``train_all_replies`` (valid only
    with the full history, where every earlier context is a prefix).
    """
    start = window_start(trajectory, turn_index, history_window)
    token_ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    visions: list[VisionInputs] = []
    images: list[np.ndarray] = []
    for j in range(start, turn_index + 1):
        turn = trajectory.turns[j]
        first = j == start
        after_eos = not first and bool(trajectory.turns[j - 1].response_ids) and trajectory.turns[j - 1].response_ids[-1] == formatter.eos_id
        segment = formatter.encode(turn, observation_text(trajectory, j, first, history_window), first, after_eos)
        token_ids += segment.token_ids
        mask += [0] * len(segment.token_ids)
        logprobs += [0.0] * len(segment.token_ids)
        if segment.vision is not None:
            visions.append(segment.vision)
            images.append(turn.image)
        if j < turn_index or include_reply:
            trained = j == turn_index or train_all_replies
            token_ids += turn.response_ids
            mask += [int(trained)] * len(turn.response_ids)
            logprobs += turn.logprobs if trained else [0.0] * len(turn.response_ids)
    return Sequence(token_ids, mask, logprobs, VisionInputs.concat(visions), images)


def training_sequences(formatter: TurnFormatter, trajectory: Trajectory, history_window: int | None) -> list[Sequence]:
    """Full history: one sequence per trajectory. A window: one sequence per turn, with its own context."""
    last = trajectory.num_turns - 1
    if last < 0:
        return []
    if history_window is None:
        return [context_tokens(formatter, trajectory, last, None, include_reply=True, train_all_replies=True)]
    return [context_tokens(formatter, trajectory, t, history_window, include_reply=True) for t in range(last + 1)]
