"""Model inputs that Qwen-VL models need beside the token ids."""

import torch


def mm_token_type_ids(input_ids: torch.Tensor, model_config) -> torch.Tensor:
    """0 for text, 1 for image and 2 for video placeholders: Qwen-VL models need it for M-RoPE.

    Without it, transformers silently gives image tokens plain 1-D text positions.
    """
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == model_config.image_token_id] = 1
    types[input_ids == model_config.video_token_id] = 2
    return types


#: placeholder tokens a reply must never hold: they would desynchronise tokens and image features.
VISION_PLACEHOLDERS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def never_generated_ids(tokenizer) -> list[int]:
    """Token ids every engine masks out when sampling, and the trainer masks out when scoring, so that
    both use one distribution."""
    vocab = tokenizer.get_vocab()
    return [vocab[token] for token in VISION_PLACEHOLDERS if token in vocab]
