"""Load a vision-language model and its processor by path, through the transformers Auto classes.

One code path for every model: the tiny local Qwen3-VL (``path="tiny"``), a local directory
(e.g. a downloaded Qwen3-VL-8B or Qwen2.5-VL), or a hub id such as ``Qwen/Qwen3-VL-8B-Instruct``.
A hub id is resolved to its snapshot in the local Hugging Face cache without any network call; only
if it is not cached is it handed to ``from_pretrained`` to download, and only where downloads are
allowed (``local_files_only`` not set and ``HF_HUB_OFFLINE`` unset).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = [
    "TINY_MODEL",
    "DTYPES",
    "resolve_model_path",
    "load_model_and_processor",
    "load_processor",
    "enable_activation_checkpointing",
]

TINY_MODEL = "tiny"
"""Special ``model.path`` value: the locally built tiny Qwen3-VL (see :mod:`rlexp.models.tiny`)."""

DTYPES = ("float32", "bfloat16", "float16")


def _looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or os.path.exists(os.path.expanduser(path))


def _offline(local_files_only: bool | None) -> bool:
    if local_files_only is not None:
        return local_files_only
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def resolve_model_path(path: str | os.PathLike, local_files_only: bool | None = None) -> str:
    """Turn ``model.path`` into what ``from_pretrained`` should get, without touching the network.

    * ``"tiny"`` -> the cached tiny build (built on first use, see :func:`tiny_model_path`);
    * a local path (absolute, ``./``, ``../``, ``~``, or existing) -> that directory, which must exist;
    * a hub id found in the local Hugging Face cache -> its snapshot directory;
    * a hub id not in the cache -> unchanged (``from_pretrained`` will download it), or
      ``FileNotFoundError`` when downloads are off (``local_files_only`` / ``HF_HUB_OFFLINE``).
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
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(path, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError) as err:
        if _offline(local_files_only):
            raise FileNotFoundError(
                f"model {path!r} is not a local directory and not in the Hugging Face cache, and "
                "downloads are off (local_files_only / HF_HUB_OFFLINE). Pass a local path, or "
                f"pre-download it with `hf download {path}` where the hub is reachable."
            ) from err
    return path


def _torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {DTYPES}")
    return getattr(torch, dtype)


def _from_pretrained(cls: Any, path: str, what: str, **kwargs: Any):
    try:
        return cls.from_pretrained(path, **kwargs)
    except OSError as err:
        raise FileNotFoundError(f"cannot load the {what} from {path!r}: {err}") from err


def load_processor(path: str, local_files_only: bool | None = None):
    """The model's processor (tokenizer + image/video processors + chat template)."""
    from transformers import AutoProcessor

    return _from_pretrained(AutoProcessor, resolve_model_path(path, local_files_only), "processor")


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
        gradient_checkpointing: enable non-reentrant activation checkpointing (fine with frozen
            base weights + LoRA; it only takes effect in train mode).
        device: where to put the model (``cpu``, ``cuda``, ``cuda:1`` ...).
        local_files_only: never reach the hub; ``None`` follows ``HF_HUB_OFFLINE``.

    Qwen3-VL and Qwen2.5-VL (and other image-text-to-text models) load through the same code.
    The model is returned in eval mode; the trainer switches it to train mode.
    """
    from transformers import AutoModelForImageTextToText

    torch_dtype = _torch_dtype(dtype)
    resolved = resolve_model_path(path, local_files_only)
    model = _from_pretrained(
        AutoModelForImageTextToText,
        resolved,
        "model",
        dtype=torch_dtype,
        attn_implementation=attn_implementation,
    )
    model.to(device)
    model.eval()
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    return model, load_processor(resolved, local_files_only)


def enable_activation_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing (transformers >= 5.2x name, or the older alias)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
