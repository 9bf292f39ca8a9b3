"""The policy: a base model by path with a LoRA adapter (saved, fresh from config, or none)."""

from pathlib import Path

import torch
from omegaconf import DictConfig
from peft import PeftModel

from rlexp.models.loading import load_model_and_processor, resolve_model_path
from rlexp.models.lora import apply_lora


def load_policy(
    model_cfg: DictConfig, device: str, adapter: Path | None = None, trainable: bool = True, new_adapter: bool = True
):
    """The base model with a LoRA adapter: the one saved at ``adapter``, else a fresh one from config
    (``new_adapter``), else none (evaluating the base model)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("cluster.device=cuda but no CUDA device is visible; use cluster=local_cpu")
    model, processor = load_model_and_processor(
        resolve_model_path(model_cfg.path),
        dtype=model_cfg.dtype.value,
        attn_implementation=model_cfg.attn_implementation,
        gradient_checkpointing=model_cfg.gradient_checkpointing,
        device=device,
    )
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter), is_trainable=trainable)
    elif new_adapter:
        lora = model_cfg.lora
        target = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
        model = apply_lora(model, lora.rank, lora.alpha, lora.dropout, target)
    return model, processor
