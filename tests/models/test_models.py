"""The tiny Qwen3-VL end to end: build, Auto-class loading, chat template + processor, forward,
generate, LoRA on the language model only, adapter save/load, the adapter-off reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from rlexp.algorithms.grpo import selective_log_softmax
from rlexp.models import (
    apply_lora,
    build_tiny_model,
    count_parameters,
    load_model_and_processor,
    reference_model,
    resolve_model_path,
    tiny_model_path,
)
from rlexp.models.tiny import SPECIAL_TOKENS

PROMPT = "This is step 3. You are allowed to take 17 more steps. Answer with ('move', d) or ('stop', 'stop')."


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tiny_model_path(cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    return load_model_and_processor(str(tiny_dir))


def maze_image(seed: int = 0, size: int = 225) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def encode(processor, n_turns: int = 1):
    messages = []
    for k in range(n_turns):
        messages.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]})
        if k < n_turns - 1:
            messages.append({"role": "assistant", "content": "('move', 0)"})
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [maze_image(k) for k in range(n_turns)]
    return text, processor(text=[text], images=images, return_tensors="pt")


def perturb_lora(model, seed: int = 0) -> None:
    """LoRA B starts at zero (adapter = identity); give it values so the adapter changes outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


# ------------------------------------------------------------------------------------ build


def test_build_is_deterministic(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=0)
    b = build_tiny_model(tmp_path / "b", seed=0)
    c = build_tiny_model(tmp_path / "c", seed=1)
    wa, wb, wc = (load_file(d / "model.safetensors") for d in (a, b, c))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
    for name in ("tokenizer.json", "config.json", "chat_template.jinja", "processor_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_cached_build_is_reused_and_atomic(tiny_dir, monkeypatch):
    assert tiny_dir.name.startswith("tiny-qwen3-vl-")
    assert [p.name for p in tiny_dir.parent.iterdir()] == [tiny_dir.name]  # no temp dirs left

    def boom(*a, **k):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr("rlexp.models.tiny.build_tiny_model", boom)
    assert tiny_model_path(cache_dir=tiny_dir.parent) == tiny_dir
    monkeypatch.setenv("RLEXP_CACHE", str(tiny_dir.parent))
    assert resolve_model_path("tiny") == str(tiny_dir)


def test_resolve_and_load_errors(tmp_path, tiny_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing"))
    assert resolve_model_path("rlexp-test/no-such-model", local_files_only=False) == "rlexp-test/no-such-model"
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache"):
        load_model_and_processor("rlexp-test/no-such-model", local_files_only=True)
    with pytest.raises(ValueError, match="dtype"):
        load_model_and_processor(str(tiny_dir), dtype="float8")


def test_hub_id_loads_from_local_hf_cache_without_network(tiny_dir, tmp_path, monkeypatch):
    import shutil

    import huggingface_hub.constants

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--rlexp-test--tiny-vl"
    shutil.copytree(tiny_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_path("rlexp-test/tiny-vl", local_files_only=True) == str(repo / "snapshots" / commit)
    model, processor = load_model_and_processor("rlexp-test/tiny-vl", dtype="bfloat16", local_files_only=True)
    assert model.dtype == torch.bfloat16
    assert type(processor).__name__ == "Qwen3VLProcessor"


# ------------------------------------------------------------------------------------ load + run


def test_auto_classes_and_token_ids(loaded):
    model, processor = loaded
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert type(processor).__name__ == "Qwen3VLProcessor"
    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert len(set(ids.values())) == len(SPECIAL_TOKENS)
    cfg = model.config
    assert cfg.image_token_id == ids["<|image_pad|>"]
    assert cfg.video_token_id == ids["<|video_pad|>"]
    assert cfg.vision_start_token_id == ids["<|vision_start|>"]
    assert cfg.vision_end_token_id == ids["<|vision_end|>"]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert cfg.text_config.vocab_size == len(tok)
    # English prompt text and actions stay short in tokens
    assert len(tok(PROMPT).input_ids) <= 45
    for action in ("('move', 0)", "('stop', 'stop')", "<action>left</action>"):
        assert len(tok(action).input_ids) <= 8, action
        assert tok.decode(tok(action).input_ids) == action


def test_chat_template_and_processor_output(loaded):
    model, processor = loaded
    text, enc = encode(processor, n_turns=2)
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>This is step 3.")
    assert "<|im_end|>\n<|im_start|>assistant\n('move', 0)<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # 225 x 225 -> 224 x 224 -> 14 x 14 patches of 16 px -> 7 x 7 = 49 merged tokens per image
    assert enc["image_grid_thw"].tolist() == [[1, 14, 14], [1, 14, 14]]
    assert (enc["input_ids"] == model.config.image_token_id).sum().item() == 2 * 49
    assert tuple(enc["pixel_values"].shape) == (2 * 196, 3 * 2 * 16 * 16)
    assert enc["input_ids"].shape == enc["attention_mask"].shape


def test_forward_and_generate(loaded):
    model, processor = loaded
    _, enc = encode(processor)
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], len(processor.tokenizer))
    assert torch.isfinite(logits).all()
    out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    new = out[0, enc["input_ids"].shape[1] :]
    assert 1 <= new.numel() <= 4
    assert isinstance(processor.batch_decode(out[:, enc["input_ids"].shape[1] :])[0], str)
    # per-token log-probs of the prompt under the model, chunked == full log-softmax
    labels = enc["input_ids"][:, 1:]
    lp, _ = selective_log_softmax(logits[:, :-1], labels, chunk_size=16)
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------ LoRA


def test_lora_targets_language_model_linears_only(tiny_dir):
    model, _ = load_model_and_processor(str(tiny_dir))
    peft_model = apply_lora(model, rank=4, alpha=8, dropout=0.0)
    adapted = sorted(n.removesuffix(".lora_A") for n, _ in peft_model.named_modules() if n.endswith(".lora_A"))
    assert len(adapted) == 2 * 7  # 2 decoder layers x (q, k, v, o, gate, up, down)
    assert all(".language_model.layers." in n for n in adapted)
    assert not any("visual" in n or "lm_head" in n or "embed" in n for n in adapted)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    n_train, n_total = count_parameters(peft_model)
    assert 0 < n_train < n_total
    # explicit list: only q_proj and v_proj (suffix semantics), still not the vision tower
    model2, _ = load_model_and_processor(str(tiny_dir))
    pm2 = apply_lora(model2, rank=2, alpha=2, target_modules=["q_proj", "v_proj"])
    assert sum(n.endswith(".lora_A") for n, _ in pm2.named_modules()) == 4


def test_lora_backward_save_reload_and_reference(tiny_dir, tmp_path):
    from peft import PeftModel

    model, processor = load_model_and_processor(str(tiny_dir), gradient_checkpointing=True)
    _, enc = encode(processor)
    with torch.no_grad():
        base_logits = model(**enc).logits

    policy = apply_lora(model, rank=4, alpha=8, dropout=0.0)
    perturb_lora(policy)
    policy.train()
    out = policy(**enc)
    labels = enc["input_ids"][:, 1:]
    lp, _ = selective_log_softmax(out.logits[:, :-1], labels)
    (-lp.mean()).backward()
    with_grad = {n for n, p in policy.named_parameters() if p.grad is not None}
    assert with_grad and all("lora_" in n for n in with_grad)
    assert all(p.grad.abs().sum() > 0 for n, p in policy.named_parameters() if "lora_B" in n)
    policy.eval()

    with torch.no_grad():
        lora_logits = policy(**enc).logits
    assert not torch.allclose(lora_logits, base_logits, atol=1e-4)

    with reference_model(policy) as ref:
        ref_logits = ref(**enc).logits
    assert not ref_logits.requires_grad
    torch.testing.assert_close(ref_logits, base_logits, atol=1e-6, rtol=0)
    with torch.no_grad():  # the adapter is back on after the context
        torch.testing.assert_close(policy(**enc).logits, lora_logits, atol=0, rtol=0)
    gen = policy.generate(**enc, max_new_tokens=3, do_sample=False)
    assert gen.shape[1] > enc["input_ids"].shape[1]

    policy.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["lora_alpha"] == 8
    fresh, _ = load_model_and_processor(str(tiny_dir))
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**enc).logits, lora_logits, atol=1e-6, rtol=0)


def test_qwen2_5_vl_loads_through_the_same_path_and_lora_skips_its_vision_mlp(tmp_path):
    # Qwen2.5-VL's vision blocks also have gate_proj/up_proj/down_proj: they must stay un-adapted.
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    from rlexp.models.tiny import CHAT_TEMPLATE, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    ids = tok.convert_tokens_to_ids
    text = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[1], window_size=112,
    )  # fmt: skip
    cfg = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        bos_token_id=None,
        eos_token_id=ids("<|im_end|>"),
    )
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(tmp_path)
    Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(tmp_path)

    model, processor = load_model_and_processor(str(tmp_path))
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert any(n.startswith("model.visual.") and n.endswith("mlp.gate_proj") for n, _ in model.named_modules())
    peft_model = apply_lora(model, rank=2, alpha=2)
    adapted = [n for n, _ in peft_model.named_modules() if n.endswith(".lora_A")]
    assert len(adapted) == 2 * 7 and not any("visual" in n for n in adapted)
    _, enc = encode(processor)
    with torch.no_grad():
        assert torch.isfinite(peft_model(**enc).logits).all()


def test_reference_model_requires_peft(loaded):
    model, _ = loaded
    with pytest.raises(TypeError, match="peft"):
        with reference_model(model):
            pass
