"""``task=export``: the merged checkpoint is a plain Hugging Face model that replies as base + adapter did, and
the adapter alone is written beside it; on a machine with vLLM, vLLM serves both the same way."""

import json

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from conftest import compose_config
from engine_support import assert_same_or_near_tie
from rlexp.config import ConfigError, validate
from rlexp.envs import ExpertPolicy, load_pinned
from rlexp.models import apply_lora, load_model_and_processor, resolve_model_path
from rlexp.rollout.conversation import TurnFormatter, context_tokens
from rlexp.rollout.driver import scripted_trajectories
from rlexp.rollout.engine import GenerationRequest, SamplingParams
from rlexp.rollout.hf_engine import HFEngine
from rlexp.rollout.vllm_engine import vllm_missing
from rlexp.tasks.export import export

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A LoRA checkpoint whose adapter moves the replies (its B matrices drawn, not zero), and its export."""
    root = tmp_path_factory.mktemp("export")
    model, processor = load_model_and_processor(resolve_model_path("tiny"))
    policy = apply_lora(model, 8, 16, 0.0, "all-linear-language")
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    checkpoint = root / "checkpoints" / "global_step_1"
    policy.save_pretrained(checkpoint / "policy")
    cfg = compose_config("task=export", f"checkpoint={checkpoint}", "name=test", "run_name=exported")
    validate(cfg)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)  # the run dir, outputs/test/exported, as a user's working dir has it
        merged = root / export(cfg)
    return checkpoint, merged, merged.parent / "adapter"


def _requests(processor) -> list[GenerationRequest]:
    formatter = TurnFormatter(processor)
    trajectories = scripted_trajectories(ExpertPolicy(), load_pinned("maze_easy")[:2], compose_config("name=t").env, 1, 3, formatter)
    return [
        GenerationRequest(c.token_ids, c.images, c.vision)
        for t in trajectories
        for c in (context_tokens(formatter, t, turn, None) for turn in range(t.num_turns))
    ]


def test_the_merged_model_replies_as_base_plus_adapter(exported):
    checkpoint, merged, adapter = exported
    assert not (merged / "adapter_config.json").exists(), "the merged checkpoint still needs peft"
    assert {"config.json", "model.safetensors", "processor_config.json", "tokenizer.json", "chat_template.jinja"} <= {p.name for p in merged.iterdir()}
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8
    assert (adapter / "adapter_model.safetensors").is_file()

    from peft import PeftModel

    base, processor = load_model_and_processor(resolve_model_path("tiny"))
    with_adapter = PeftModel.from_pretrained(base, str(checkpoint / "policy"))
    plain, _ = load_model_and_processor(resolve_model_path("tiny"))
    model = AutoModelForImageTextToText.from_pretrained(merged)
    requests = _requests(AutoProcessor.from_pretrained(merged))
    expected = HFEngine(with_adapter, processor).generate(requests, GREEDY)
    got = HFEngine(model, AutoProcessor.from_pretrained(merged)).generate(requests, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    torch.testing.assert_close(
        torch.tensor([lp for o in got for lp in o.logprobs]), torch.tensor([lp for o in expected for lp in o.logprobs]), atol=1e-4, rtol=0
    )
    # and the adapter matters: the base model alone replies otherwise
    assert [o.token_ids for o in HFEngine(plain, processor).generate(requests, GREEDY)] != [o.token_ids for o in expected]


def test_export_needs_a_checkpoint():
    with pytest.raises(ConfigError, match="task=export needs checkpoint="):
        validate(compose_config("task=export", "name=test"))


@pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing()))
def test_vllm_serves_the_merged_model_and_the_adapter_alike(exported):
    """The merged checkpoint loaded by vLLM as a plain model, and the base with the adapter served dynamically
    (a ``LoRARequest``), give the same greedy replies, both in bfloat16 (vLLM's LoRA kernels take no float32),
    or part first where the float32 merged model sees a near tie (the two paths round differently)."""
    from peft import PeftModel

    from rlexp.rollout.vllm_engine import VLLMEngine

    checkpoint, merged, adapter = exported
    options = {"gpu_memory_utilization": 0.1, "sleep_level": "0", "max_model_len": 4096, "max_images_per_prompt": 4, "enforce_eager": True,
               "dtype": "bfloat16"}
    model = AutoModelForImageTextToText.from_pretrained(merged)
    processor = AutoProcessor.from_pretrained(merged)
    requests = _requests(processor)
    replies = []
    base, _ = load_model_and_processor(resolve_model_path("tiny"))
    for policy in (model, PeftModel.from_pretrained(base, str(adapter))):
        engine = VLLMEngine(policy, processor, **options)
        try:
            replies.append(engine.generate(requests, GREEDY))
        finally:
            engine.close()
    from_merged, dynamic = replies
    same = assert_same_or_near_tie(model, processor, requests, from_merged, dynamic, near_tie=1e-1)
    print(f"{same}/{len(requests)} greedy replies identical from the merged model and the dynamic adapter")

