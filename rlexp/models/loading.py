"""Load a vision-language model and its processor by path, through the transformers Auto classes.

One code path for every model: the tiny local Qwen3-VL (``path="tiny"``), a local directory
(e.g. a downloaded Qwen3-VL-8B or Qwen2.5-VL), or a hub id such as ``Qwen/Qwen3-VL-8B-Instruct``.
A hub id is looked up in the local Hugging Face cache first; it is only downloaded where downloads
are allowed (``local_files_only=False`` and ``HF_HUB_OFFLINE`` unset).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["TINY_MODEL", "DTYPES", "resolve_model_path", "load_model_and_processor", "load_processor"]

TINY_MODEL = "tiny"
"""Special ``model.path`` value: the locally built tiny Qwen3-VL (see :mod:`rlexp.models.tiny`)."""

DTYPES = ("float32", "bfloat16", "float16")


def _looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or os.path.exists(os.path.expanduser(path))


def resolve_model_path(path: str | os.PathLike) -> str:
    """Map ``"tiny"`` to the cached tiny build (built on first use); expand ``~`` in local paths.

    Anything else that is not an existing local path is returned unchanged (a hub id).
    Raises ``FileNotFoundError`` for a path that is clearly local (absolute or relative with ``./``)
    but does not exist.
    """
    path = str(path)
    if path == TINY_MODEL:
        from rlexp.models.tiny import tiny_model_path

        return str(tiny_model_path())
    if _looks_local(path):
        local = Path(path).expanduser()
        if not local.exists():
            raise FileNotFoundError(f"model path {path!r} does not exist")
        return str(local)
    return path


def _torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {DTYPES}")
    return getattr(torch, dtype)


def _offline_default(local_files_only: bool | None) -> bool:
    if local_files_only is not None:
        return local_files_only
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _from_pretrained(cls: Any, path: str, local_files_only: bool | None, what: str, **kwargs: Any):
    """``cls.from_pretrained`` with a clear error; hub ids try the local HF cache before the network."""
    if _looks_local(path):
        return cls.from_pretrained(path, **kwargs)
    try:
        return cls.from_pretrained(path, local_files_only=True, **kwargs)
    except OSError as cache_err:
        if _offline_default(local_files_only):
            raise FileNotFoundError(
                f"cannot load {what} {path!r}: it is not a local directory and not in the Hugging Face "
                f"cache ({cache_err.__class__.__name__}: {cache_err}). Downloads are off here "
                "(local_files_only / HF_HUB_OFFLINE): pass a local path, or pre-download it with "
                f"`hf download {path}` on a machine with access to the hub."
            ) from cache_err
    try:
        return cls.from_pretrained(path, **kwargs)
    except OSError as err:
        raise FileNotFoundError(
            f"cannot load {what} {path!r}: not a local directory, not in the Hugging Face cache, and "
            f"the download failed ({err}). Pass a local path or pre-download the model."
        ) from err


def load_processor(path: str, local_files_only: bool | None = None):
    """The model's processor (tokenizer + image/video processors + chat template)."""
    from transformers import AutoProcessor

    return _from_pretrained(AutoProcessor, resolve_model_path(path), local_files_only, "processor")


def load_model_and_processor(
    path: str,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    device: str = "cpu",
    local_files_only: bool | None = None,
):
    """Load ``(model, processor)`` with ``AutoModelForImageTextToText`` / ``AutoProcessor``.

    Args:
        path: ``"tiny"``, a local directory, or a hub id (see the module docstring).
        dtype: ``float32`` | ``bfloat16`` | ``float16``.
        attn_implementation: ``sdpa`` | ``eager`` | ``flash_attention_2`` | ... (passed through).
        gradient_checkpointing: enable non-reentrant activation checkpointing (works with frozen
            base weights + LoRA without ``enable_input_require_grads``).
        device: where to put the model (``cpu``, ``cuda``, ``cuda:1`` ...).
        local_files_only: never reach the hub; ``None`` follows ``HF_HUB_OFFLINE``.

    Qwen3-VL and Qwen2.5-VL (and other image-text-to-text models) load through the same code.
    The model is returned in eval mode; the trainer switches it to train mode.
    """
    from transformers import AutoModelForImageTextToText

    resolved = resolve_model_path(path)
    model = _from_pretrained(
        AutoModelForImageTextToText,
        resolved,
        local_files_only,
        "model",
        dtype=_torch_dtype(dtype),
        attn_implementation=attn_implementation,
    )
    model.to(device)
    model.eval()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, load_processor(resolved, local_files_only)
