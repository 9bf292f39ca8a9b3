"""Model loading (Auto classes, by path), the policy (base + LoRA), model inputs, and the tiny Qwen3-VL factory."""

from rlexp.models.inputs import mm_token_type_ids, never_generated_ids
from rlexp.models.loading import TINY_MODEL, load_model_and_processor, load_processor, resolve_model_path
from rlexp.models.lora import ALL_LINEAR_LANGUAGE, apply_lora, count_parameters, reference_model
from rlexp.models.policy import load_policy
from rlexp.models.tiny import build_tiny_model, tiny_model_path

__all__ = [
    "ALL_LINEAR_LANGUAGE",
    "TINY_MODEL",
    "apply_lora",
    "build_tiny_model",
    "count_parameters",
    "load_model_and_processor",
    "load_policy",
    "mm_token_type_ids",
    "never_generated_ids",
    "load_processor",
    "reference_model",
    "resolve_model_path",
    "tiny_model_path",
]
