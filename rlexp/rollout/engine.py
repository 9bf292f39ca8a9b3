"""The inference-engine contract shared by the ``hf`` engine (and a vLLM engine to come).

Token ids go in and come out, so that what the trainer later scores is exactly what the engine saw.
Images travel with each request as the model's processed vision inputs, in the order their
``<|image_pad|>`` runs appear in the prompt.
"""

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class VisionInputs:
    """Processed images of one request: patches and one (t, h, w) grid row per image."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    @staticmethod
    def concat(parts: "list[VisionInputs]") -> "VisionInputs | None":
        if not parts:
            return None
        return VisionInputs(
            torch.cat([p.pixel_values for p in parts]), torch.cat([p.image_grid_thw for p in parts])
        )


def mm_token_type_ids(input_ids: torch.Tensor, model_config) -> torch.Tensor:
    """0 for text, 1 for image and 2 for video placeholders: Qwen-VL models need it for M-RoPE.

    Without it, transformers silently gives image tokens plain 1-D text positions.
    """
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == model_config.image_token_id] = 1
    types[input_ids == model_config.video_token_id] = 2
    return types


@dataclass
class GenerationRequest:
    prompt_token_ids: list[int]
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
    #: log-probability of each generated token under softmax(logits / temperature), no top-p truncation.
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
