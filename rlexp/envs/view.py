"""How the model sees the env: the frames it gets, whether it is asked to reason aloud, how history is cut.

Three settings, each VisGym's own behaviour where ``prompt=visgym`` (``auto``) and SkyRL's otherwise:

- ``image_format``: ``jpeg`` = the frame after VisGym's JPEG round trip. Its interactor's
  ``_image_to_b64`` calls ``pil.save(buf, format="JPEG")`` (``inference/run_inference.py`` passes no
  ``image_quality``), i.e. PIL's defaults, quality 75 with 4:2:0 chroma subsampling; the model's
  loader decodes that with PIL. About 16% of a maze frame's pixels change (anti-aliasing around the
  red goal and the blue agent). ``png`` = the rendered pixels (PNG is lossless), as SkyRL sends them.
  Only the model's copy is encoded: the env's state and its buffer stay exact.
- ``elicit_verbalization``: VisGym's ``--elicit-verbalization``: the task prompt ends with
  :data:`~rlexp.envs.prompts.ELICIT_SUFFIX` and the action is read inside the first ``<answer>``.
- ``history_style``: what ``history_window=k`` keeps (see ``rlexp.rollout.conversation``).
  ``visgym`` = VisGym's ``num_interaction_history=k``: k earlier turns plus the current one, the
  oldest kept turn rewritten to carry the task prompt; ``last_k`` = the last k turns.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

IMAGE_FORMATS = ("jpeg", "png")
HISTORY_STYLES = ("visgym", "last_k")
AUTO = "auto"
#: PIL's default JPEG quality, which VisGym's ``Image.save(buf, format="JPEG")`` uses.
JPEG_QUALITY = 75
#: PIL's default chroma subsampling at that quality: 4:2:0 (PIL's code 2).
JPEG_SUBSAMPLING = "4:2:0"


def encode_frame(image: np.ndarray, image_format: str) -> bytes:
    """The bytes a VisGym (``jpeg``) or SkyRL (``png``) pipeline sends for an (H, W, 3) uint8 frame."""
    _check(image_format, IMAGE_FORMATS, "image_format")
    buf = io.BytesIO()
    if image_format == "jpeg":
        Image.fromarray(image).save(buf, format="JPEG", quality=JPEG_QUALITY, subsampling=JPEG_SUBSAMPLING)
    else:
        Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def model_frame(image: np.ndarray, image_format: str) -> np.ndarray:
    """The frame as the model sees it: a new (H, W, 3) uint8 array, decoded from ``encode_frame``.

    ``png`` is lossless, so that is a copy of ``image`` (no codec is run).
    """
    _check(image_format, IMAGE_FORMATS, "image_format")
    if image_format == "png":
        return np.array(image, dtype=np.uint8, copy=True)
    with Image.open(io.BytesIO(encode_frame(image, image_format))) as decoded:
        return np.asarray(decoded.convert("RGB")).copy()


@dataclass(frozen=True)
class ModelView:
    """The three settings with ``auto`` resolved: VisGym's choices for ``prompt=visgym``, else SkyRL's."""

    image_format: str = "png"
    history_style: str = "last_k"
    elicit_verbalization: bool = False

    def __post_init__(self):
        _check(self.image_format, IMAGE_FORMATS, "image_format")
        _check(self.history_style, HISTORY_STYLES, "history_style")

    @classmethod
    def resolve(
        cls, prompt: str, image_format: str = AUTO, history_style: str = AUTO, elicit_verbalization: bool | None = None
    ) -> ModelView:
        visgym = prompt == "visgym"
        return cls(
            image_format=("jpeg" if visgym else "png") if image_format == AUTO else image_format,
            history_style=("visgym" if visgym else "last_k") if history_style == AUTO else history_style,
            elicit_verbalization=visgym if elicit_verbalization is None else bool(elicit_verbalization),
        )

    @classmethod
    def from_config(cls, env_cfg) -> ModelView:
        """From an ``EnvConfig`` (enum values or their strings)."""
        return cls.resolve(
            _value(env_cfg.prompt),
            _value(env_cfg.image_format),
            _value(env_cfg.history_style),
            env_cfg.elicit_verbalization,
        )


def _value(option):
    return getattr(option, "value", option)


def _check(value: str, choices: tuple[str, ...], name: str) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of {choices}")
