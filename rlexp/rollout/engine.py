"""The inference-engine contract shared by the ``hf`` and ``vllm`` engines, and how an engine is built.

Token ids go in and come out, so that what the trainer later scores is exactly what the engine saw.
Each request carries its frames (RGB arrays, in the order their ``<|image_pad|>`` runs appear in the
prompt), so that each engine processes images its own way; a request may also carry those frames
already processed by the policy's processor, which an in-process engine can use as they are.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch


@dataclass
class VisionInputs:
    """Processed images of one request: patches and one (t, h, w) grid row per image.

    Either the patches are held (``pixel_values``), or the uint8 ``frames`` are, and ``patcher``
    (``rlexp.models.vision.FramePatcher``) makes the same patches where the model runs: 8x fewer bytes
    to keep for training and to move, and no image processing on the CPU.
    """

    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor
    #: uint8 (N, H, W, 3), when ``pixel_values`` is None.
    frames: torch.Tensor | None = None
    patcher: Any = None

    def tensors(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """``pixel_values`` and ``image_grid_thw`` on ``device``."""
        if self.pixel_values is None:
            pixel_values = self.patcher.pixel_values(self.frames, device)
        else:
            pixel_values = self.pixel_values.to(device)
        return pixel_values, self.image_grid_thw.to(device)

    @staticmethod
    def concat(parts: "list[VisionInputs]") -> "VisionInputs | None":
        if not parts:
            return None
        grid = torch.cat([p.image_grid_thw for p in parts])
        first = parts[0]
        if all(p.frames is not None and p.patcher is first.patcher and p.frames.shape[1:] == first.frames.shape[1:] for p in parts):
            return VisionInputs(None, grid, frames=torch.cat([p.frames for p in parts]), patcher=first.patcher)
        return VisionInputs(torch.cat([p.tensors("cpu")[0] for p in parts]), grid)


@dataclass
class GenerationRequest:
    prompt_token_ids: list[int]
    #: the frames of the prompt, [H, W, 3] uint8 each.
    images: list[np.ndarray] = field(default_factory=list)
    #: the same frames through the policy's image processor, where the caller has them.
    vision: VisionInputs | None = None


@dataclass
class SamplingParams:
    #: 0 = greedy.
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    #: generation ends after any of these strings (the EOS token always ends it).
    stop: list[str] = field(default_factory=list)


@dataclass
class GenerationOutput:
    token_ids: list[int]
    #: log-probability of each generated token under softmax(logits / temperature) over the tokens the
    #: engine may emit (``rlexp.models.never_generated_ids`` masked), before any top-p truncation.
    logprobs: list[float]
    text: str
    #: "stop" (EOS or a stop string) or "length" (hit max_new_tokens).
    finish_reason: str


class InferenceEngine(Protocol):
    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[GenerationOutput]:
        """Generate one next turn for each request."""

    def load_weights(self, adapter_path: str | Path | None = None) -> None:
        """Serve the policy's current weights. An engine in the trainer's process shares them (nothing to
        do); one in another process gets the LoRA adapter through files, written to ``adapter_path`` (a
        fresh dir each sync; a dir of its own when None)."""

    def sleep(self) -> None:
        """Release accelerator memory for the trainer's update (colocated engines)."""

    def wake_up(self) -> None:
        """Take back what ``sleep`` released, with the weights it held."""


def build_engine(engine_cfg, **objects) -> InferenceEngine:
    """The engine ``rollout.engine._target_`` names, built with ``objects`` (the policy and its processor)
    and the options set for it: ``rollout.engine`` holds every engine's options, and one left null is not
    passed (``rlexp.config.validate`` refuses an option set for an engine that does not read it)."""
    from hydra.utils import instantiate

    return instantiate({key: value for key, value in engine_cfg.items() if value is not None}, **objects)


def stop_token_ids(model, tokenizer) -> list[int]:
    """The ids that end a reply in every engine: the checkpoint's EOS ids, ``<|im_end|>`` and the tokenizer's EOS."""
    configured = model.generation_config.eos_token_id if model.generation_config else None
    ids = configured if isinstance(configured, list) else [configured]
    ids = [i for i in ids if i is not None]
    for token in ("<|im_end|>", tokenizer.eos_token):
        token_id = tokenizer.convert_tokens_to_ids(token) if token else None
        if token_id is not None and token_id != tokenizer.unk_token_id and token_id not in ids:
            ids.append(token_id)
    return ids
