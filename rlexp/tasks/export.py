"""``task=export``: a trained LoRA checkpoint made ready for serving.

``rlexp task=export checkpoint=<run>/checkpoints/global_step_N`` loads the checkpoint's base model (its
``config.yaml``'s ``model`` settings, as ``task=eval`` does) with its adapter and writes, in the run dir:

- ``merged/``: the adapter merged into the base weights (peft's ``merge_and_unload``), saved as a standard
  Hugging Face checkpoint with its processor (tokenizer, image processor, chat template): what
  ``from_pretrained`` or ``vllm serve`` loads with no peft involved;
- ``adapter/``: the adapter alone, in peft's format, for serving it dynamically over the base model
  (vLLM's ``--enable-lora`` / ``LoRARequest``).
"""

import logging
from pathlib import Path

from omegaconf import DictConfig

from rlexp.models import load_policy
from rlexp.runtime import run_dir_of
from rlexp.tasks.eval import checkpoint_adapter, with_checkpoint_config

log = logging.getLogger(__name__)


def export(cfg: DictConfig) -> str:
    """Returns the merged checkpoint's directory."""
    checkpoint = Path(cfg.checkpoint)
    adapter = checkpoint_adapter(checkpoint)
    cfg = with_checkpoint_config(cfg, checkpoint)
    out = run_dir_of(cfg)
    model, processor = load_policy(cfg.model, cfg.cluster.device, adapter=adapter, trainable=False, new_adapter=False)
    model.save_pretrained(out / "adapter")
    merged = model.merge_and_unload()
    merged.save_pretrained(out / "merged")
    processor.save_pretrained(out / "merged")
    log.info("exported %s: merged model in %s, adapter alone in %s", adapter, out / "merged", out / "adapter")
    return str(out / "merged")
