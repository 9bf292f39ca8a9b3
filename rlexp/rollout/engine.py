"""The inference-engine contract shared by the ``hf`` engine (and a vLLM engine to come).

Token ids go in and come out, so that what the trainer later scores is exactly what the engine saw.
Each request carries its frames (RGB arrays, in the order their ``<|image_pad|>`` runs appear in the
prompt), so that each engine processes images its own way; a request may also carry those frames
already processed by the policy's processor, which an in-process engine can use as they are.
"""

from dataclasses import dataclass, field
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

    def load_weights(self, adapter_path: str | None = None, adapter_id: int | None = None) -> None:
        """Make the engine serve the current policy (a no-op where weights are shared in-process)."""

    def sleep(self) -> None:
        """Release accelerator memory for the trainer (colocated engines)."""

    def wake_up(self) -> None:
        """Take back what ``sleep`` released."""
