"""A real Qwen3-VL at toy size, built locally: no weights or tokenizer come from the hub.

`build_tiny_model` makes a `Qwen3VLForConditionalGeneration` from a `Qwen3VLConfig` (text: hidden 64,
2 layers; vision: depth 2, hidden 64), a byte-level BPE tokenizer trained deterministically on a small
built-in maze corpus, and a `Qwen3VLProcessor` with a Qwen-style chat template, and saves them with
`save_pretrained` so that the ordinary loading path (`AutoModelForImageTextToText`, `AutoProcessor`)
is what tests and CPU runs exercise. Same seed -> byte-identical weights and tokenizer.

Image size: patch 16, merge 2 -> one LLM token per 32x32 pixels; a 225x225 maze image is resized to
224x224 and becomes 7x7 = 49 image tokens (275x275 -> 288x288 -> 81 tokens).

`tiny_model_path()` caches one build per spec under ``$RLEXP_CACHE`` (default ``~/.cache/rlexp``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = [
    "TINY_TEXT_CONFIG",
    "TINY_VISION_CONFIG",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "tiny_config",
    "tiny_model_path",
    "tiny_spec_hash",
]

# Bump when the build code changes in a way that changes the saved files.
_BUILD_VERSION = 1

TINY_TEXT_CONFIG: dict = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    # head_dim 16 -> 8 rotary frequencies, split T/H/W = 4/2/2 and interleaved as in Qwen3-VL
    # (the 8B uses [24, 20, 20] of 64).
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5_000_000.0,
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    },
}

TINY_VISION_CONFIG: dict = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 4,
    "hidden_act": "gelu_pytorch_tanh",
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,  # 48 x 48 grid, as the real model; interpolated per image
    "deepstack_visual_indexes": [0],  # output of vision block 0 is added to text layer 0
}

# Image processor limits, in pixels after resizing (one merged token = 32 x 32 px): at least
# 2 x 2 tokens, at most 16 x 16 tokens per image.
_MIN_PIXELS = 4 * 32 * 32
_MAX_PIXELS = 256 * 32 * 32
_IMAGE_MEAN = [0.5, 0.5, 0.5]  # Qwen3-VL's normalisation
_IMAGE_STD = [0.5, 0.5, 0.5]

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_BPE_VOCAB_SIZE = 1024  # byte alphabet (256) + merges; the special tokens come after these

# Qwen2/Qwen3 pre-tokenizer pattern: words, single digits, punctuation runs, whitespace.
_QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen-VL style chat template (as Qwen3-VL-Instruct, without tools): string or list content, list
# items of type image / video / text; no default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif content['type'] == 'video' or 'video' in content -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in content -%}"
    "{{- content['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


#: Every complete action is one token, so that even the untrained toy policy emits a valid action now
#: and then: with a format-reward share, GRPO then has a learning signal on a CPU from step one.
ACTION_TOKENS = (
    *(f"('move', {d})" for d in range(4)),
    "('stop', 'stop')",
    *(f"<action>{name}</action>" for name in ("right", "up", "left", "down", "stop")),
)


def _corpus() -> list[str]:
    """Deterministic training text for the BPE: the words maze prompts, feedback and actions use."""
    base = [
        "You are an agent in a 2D maze. The blue circle is you and the red square is the goal.",
        "White cells are open paths and gray cells are walls. Move to the goal and then stop.",
        "Navigate the maze shown in the image. Reach the red goal cell, then output the stop action.",
        "The image shows the current state of the maze. Choose the next action.",
        "Available actions: ('move', 0) moves right, ('move', 1) moves up, ('move', 2) moves left, "
        "('move', 3) moves down, and ('stop', 'stop') ends the episode.",
        "Answer with exactly one action tuple, for example ('move', 0) or ('stop', 'stop').",
        "Think step by step, then give your answer inside <answer></answer> tags.",
        "<answer>('move', 3)</answer>",
        "Respond with one action in the form <action>left</action>, <action>right</action>, "
        "<action>up</action>, <action>down</action> or <action>stop</action>.",
        "Action executed successfully.",
        "Cannot move into a wall.",
        "Cannot parse action string. Please answer with a valid action.",
        "The action is not in the valid action space.",
        "You reached the goal. You did not reach the goal. The episode has ended.",
        "Your position is row 1, column 1. The goal is at row 7, column 7.",
        "The agent is at the top left corner and the goal is at the bottom right corner.",
        "The previous action was ('move', 2). The environment feedback is shown below.",
        "system user assistant image text step steps turn turns left right up down stop move",
        "```python\n('move', 1)\n```",
        "I will move right. I will move down. I should stop now because I am on the goal.",
    ]
    lines: list[str] = []
    for _ in range(4):
        lines.extend(base)
    for k in range(1, 31):
        n = 30 - k
        lines.append(f"This is step {k}. You are allowed to take {n} more steps.")
        lines.append(f"Step {k}: ('move', {k % 4}) -> Action executed successfully.")
    for d in range(4):
        for name in ("left", "right", "up", "down", "stop"):
            lines.append(f"('move', {d}) <action>{name}</action> ('stop', 'stop')")
    lines.extend(str(i) for i in range(100))
    return lines


def build_tiny_tokenizer():
    """The tiny model's tokenizer: byte-level BPE (vocab ~1k) + Qwen special tokens, made locally."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ACTION_TOKENS])

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=TINY_TEXT_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def _spec() -> dict:
    import transformers

    return {
        "build_version": _BUILD_VERSION,
        "transformers": transformers.__version__,
        "text": TINY_TEXT_CONFIG,
        "vision": TINY_VISION_CONFIG,
        "pixels": [_MIN_PIXELS, _MAX_PIXELS, _IMAGE_MEAN, _IMAGE_STD],
        "specials": list(SPECIAL_TOKENS),
        "action_tokens": list(ACTION_TOKENS),
        "bpe_vocab": _BPE_VOCAB_SIZE,
        "split": _QWEN_SPLIT_PATTERN,
        "template": CHAT_TEMPLATE,
        "corpus": hashlib.sha256("\n".join(_corpus()).encode()).hexdigest(),
    }


def tiny_spec_hash(seed: int = 0) -> str:
    """Short hash of everything that determines the tiny build (config, code version, seed)."""
    payload = json.dumps({"spec": _spec(), "seed": seed}, sort_keys=True).encode()
    return hashlib.sha256(payload).hexdigest()[:12]


def tiny_config(tokenizer=None, text: dict | None = None, vision: dict | None = None):
    """The tiny model's ``Qwen3VLConfig`` (what ``task=plan`` reads; no weights are made); ``text`` and
    ``vision`` replace entries of ``TINY_TEXT_CONFIG`` / ``TINY_VISION_CONFIG`` for a scaled-up variant."""
    from transformers import Qwen3VLConfig

    tokenizer = tokenizer or build_tiny_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text_config = dict(TINY_TEXT_CONFIG, **(text or {}), vocab_size=len(tokenizer), pad_token_id=ids[PAD_TOKEN])
    vision_config = dict(TINY_VISION_CONFIG, **(vision or {}), out_hidden_size=text_config["hidden_size"])
    config = Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.eos_token_id = ids[EOS_TOKEN]
    config.pad_token_id = ids[PAD_TOKEN]
    return config


def build_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Build the tiny Qwen3-VL model + processor and `save_pretrained` both into ``out_dir``.

    Weights are initialised under ``torch.manual_seed(seed)`` inside a forked RNG (the caller's RNG
    state is left as it was). Returns ``out_dir``.
    """
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2VLImageProcessor,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tiny_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = tiny_config(tokenizer)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(config).to(torch.float32)
    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=[ids[EOS_TOKEN], ids[PAD_TOKEN]],
        pad_token_id=ids[PAD_TOKEN],
        do_sample=False,
    )

    size = {"shortest_edge": _MIN_PIXELS, "longest_edge": _MAX_PIXELS}
    patches = dict(
        patch_size=16, merge_size=2, temporal_patch_size=2, size=size, image_mean=_IMAGE_MEAN, image_std=_IMAGE_STD
    )
    image_processor = Qwen2VLImageProcessor(**patches)
    video_processor = Qwen3VLVideoProcessor(**patches)
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )

    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    (out_dir / "rlexp_tiny.json").write_text(
        json.dumps({"seed": seed, "spec_hash": tiny_spec_hash(seed)}, indent=2) + "\n"
    )
    return out_dir


def _cache_root(cache_dir: Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("RLEXP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "rlexp"


def tiny_model_path(cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Path of the cached tiny build for the current spec, building it (atomically) if missing.

    The directory is ``<cache>/tiny-qwen3-vl-<hash>``; ``<cache>`` is ``cache_dir``, else
    ``$RLEXP_CACHE``, else ``~/.cache/rlexp``. The build goes to a temporary sibling directory that
    is renamed into place, so a concurrent or interrupted build never leaves a half-written model.
    """
    root = _cache_root(cache_dir)
    final = root / f"tiny-qwen3-vl-{tiny_spec_hash(seed)}"
    if (final / "rlexp_tiny.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        build_tiny_model(tmp, seed=seed)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first (the target exists and is not empty): use theirs.
            if not (final / "rlexp_tiny.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
