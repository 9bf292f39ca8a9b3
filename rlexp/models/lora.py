"""LoRA on the language model of a VLM (peft), and the base model as the KL reference.

Default targets (``target_modules="all-linear-language"``): every linear layer of the language
model's decoder blocks -- ``q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj`` under
``model.language_model.layers.N``. The vision tower (including Qwen2.5-VL's vision MLP, whose
layers are also called ``gate_proj/up_proj/down_proj``), the vision-to-text mergers, the embeddings
and ``lm_head`` are neither adapted nor trained. This is the adapter vLLM can serve for Qwen-VL
models (language-model LoRA).

The reference policy for a KL term is the same model with the adapter switched off
(:func:`reference_model`), so no second copy of the weights is held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

__all__ = [
    "ALL_LINEAR_LANGUAGE",
    "LANGUAGE_LINEAR_REGEX",
    "LANGUAGE_LINEAR_NAMES",
    "apply_lora",
    "reference_model",
    "count_parameters",
]

ALL_LINEAR_LANGUAGE = "all-linear-language"
"""Sentinel for ``model.lora.target_modules``: all linear layers of the language model only."""

LANGUAGE_LINEAR_NAMES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)

# peft full-matches a string target against each module's qualified name (e.g.
# "model.language_model.layers.3.self_attn.q_proj", or with a "base_model.model." prefix).
LANGUAGE_LINEAR_REGEX = (
    r"(.*\.)?language_model\.layers\.\d+\."
    r"(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))"
)


def _resolve_targets(target_modules: str | Sequence[str]) -> str | list[str]:
    if isinstance(target_modules, str):
        return LANGUAGE_LINEAR_REGEX if target_modules == ALL_LINEAR_LANGUAGE else target_modules
    targets = list(target_modules)
    if not targets:
        raise ValueError("target_modules is empty")
    return targets


def apply_lora(
    model: torch.nn.Module,
    rank: int = 32,
    alpha: float = 32,
    dropout: float = 0.0,
    target_modules: str | Sequence[str] = ALL_LINEAR_LANGUAGE,
):
    """Wrap ``model`` in a peft ``PeftModel`` with a LoRA adapter; only LoRA weights train.

    Args:
        rank, alpha, dropout: LoRA ``r``, ``lora_alpha`` (scale = alpha / rank), ``lora_dropout``.
        target_modules: ``"all-linear-language"`` (default, see module docstring), any other
            string (a regex peft full-matches against module names, or peft's ``"all-linear"``), or
            an explicit list of module-name suffixes (peft's list semantics).

    The base weights are frozen by peft. Raises ``ValueError`` if no module matched.
    """
    from peft import LoraConfig, get_peft_model

    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
    config = LoraConfig(
        r=int(rank),
        lora_alpha=alpha,
        lora_dropout=float(dropout),
        target_modules=_resolve_targets(target_modules),
        bias="none",
    )
    return get_peft_model(model, config)


@contextlib.contextmanager
def reference_model(model) -> Iterator[torch.nn.Module]:
    """Context in which ``model`` (a ``PeftModel``) acts as the frozen reference: adapter off, no grad.

    ``with reference_model(policy) as ref: ref_logits = ref(**batch).logits``
    """
    if not hasattr(model, "disable_adapter"):
        raise TypeError(
            f"reference_model needs a peft model (LoRA) to switch its adapter off, got "
            f"{type(model).__name__}; a full fine-tune needs a separate frozen reference copy"
        )
    with model.disable_adapter(), torch.no_grad():
        yield model


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
