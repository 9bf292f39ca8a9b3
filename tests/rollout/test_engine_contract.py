"""One contract for every inference engine (``rollout.engine``), run on each: ``hf`` everywhere, ``vllm`` where
vLLM and a CUDA GPU are (elsewhere its cases skip, saying why).

On the tiny Qwen3-VL in float32 (vLLM serves it in bfloat16: its LoRA kernels take no float32), with LoRA: the
same prompts give well-formed replies with one log-prob per token; the log-probs are the trainer's
(``rollout/logprob_gap`` at T=0.7 under a stated bound per engine); greedy replies equal the ``hf`` engine's,
or differ first where the trainer itself sees a near tie; a weight sync changes the replies to the updated
policy's; sleep and wake keep the weights; and the prompt ids vLLM consumes are the trainer's, images expanded
alike (the engine checks this on every request).

On the H200, with vLLM carried as the README of ``shared/tools/vllm-offline`` says:
``VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m pytest tests/rollout/test_engine_contract.py -v``
"""

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, compose_config
from engine_support import assert_same_or_near_tie, next_token_logprobs
from rlexp.envs import ExpertPolicy, load_pinned
from rlexp.models import apply_lora, load_model_and_processor, never_generated_ids, resolve_model_path
from rlexp.rollout.conversation import TurnFormatter, context_tokens, training_sequences
from rlexp.rollout.driver import run_rollouts, scripted_trajectories
from rlexp.rollout.engine import GenerationRequest, SamplingParams
from rlexp.rollout.hf_engine import HFEngine
from rlexp.rollout.vllm_engine import check_prompt, collapse_image_runs, engine_dtype, vllm_missing
from rlexp.training.update import PolicyUpdate, Sample

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ENV = compose_config("name=test", "env.history_window=null").env
#: mean |engine - trainer| log-prob over sampled tokens at T=0.7, the trainer in float32: the hf engine runs
#: the trainer's own forward; vLLM serves the float32 policy in bfloat16 (its LoRA kernels take 16-bit
#: weights only: ``engine_dtype``), so its bound is bfloat16 rounding through the whole model.
GAP_BOUND = {"hf": 1e-5, "vllm": 5e-2}
#: greedy replies may part where the trainer's two best tokens are closer than this (vLLM's bfloat16 rounding).
NEAR_TIE = 1e-1
VLLM_SKIP = vllm_missing()
ENGINES = ["hf", pytest.param("vllm", marks=pytest.mark.skipif(VLLM_SKIP is not None, reason=str(VLLM_SKIP)))]


def _policy(seed: int = 0):
    """A fresh tiny policy (LoRA r8) of its own, so that tests may change its weights."""
    model, processor = load_model_and_processor(resolve_model_path("tiny"), device=DEVICE)
    torch.manual_seed(seed)
    return apply_lora(model, 8, 16, 0.0, "all-linear-language"), processor


def _build(name: str, model, processor, sleep_level: str = "0"):
    if name == "hf":
        return HFEngine(model, processor)
    from rlexp.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(
        model, processor, gpu_memory_utilization=0.1, sleep_level=sleep_level, max_model_len=4096,
        max_images_per_prompt=4, seed=0, enforce_eager=True,
    )


def _perturb(model, seed: int) -> None:
    """What an optimizer step does to the policy, made large enough to change greedy replies."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


@pytest.fixture(scope="module", params=ENGINES)
def setup(request, tmp_path_factory):
    """(engine name, engine, policy, processor): one engine per name for the module; tests that change the
    policy restore it."""
    model, processor = _policy()
    engine = _build(request.param, model, processor)
    yield request.param, engine, model, processor
    _close(engine)


def _close(engine) -> None:
    if hasattr(engine, "close"):
        engine.close()


def _requests(processor, mazes: int = 2, turns: int = 3) -> list[GenerationRequest]:
    """Fixed multi-turn contexts (the expert's moves, whole history, one frame a turn)."""
    formatter = TurnFormatter(processor)
    trajectories = scripted_trajectories(ExpertPolicy(), load_pinned("maze_easy")[:mazes], ENV, 1, turns, formatter)
    out = []
    for t in trajectories:
        for turn in range(t.num_turns):
            context = context_tokens(formatter, t, turn, None)
            out.append(GenerationRequest(context.token_ids, context.images, context.vision))
    return out


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


def test_replies_are_well_formed_with_one_logprob_per_token(setup):
    name, engine, model, processor = setup
    requests = _requests(processor)
    outputs = engine.generate(requests, SamplingParams(temperature=0.7, max_new_tokens=8))
    assert len(outputs) == len(requests) and any(len(r.images) == 3 for r in requests)
    eos = set(engine.eos_ids)
    for out in outputs:
        assert 1 <= len(out.token_ids) <= 8 and len(out.logprobs) == len(out.token_ids)
        assert all(lp <= 0 and lp > float("-inf") for lp in out.logprobs)
        assert not set(out.token_ids) & set(never_generated_ids(processor.tokenizer))
        assert out.finish_reason == ("stop" if out.token_ids[-1] in eos else "length")
        assert not set(out.token_ids[:-1]) & eos, "a reply runs past its EOS"
        assert out.text == processor.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_logprob_gap_at_temperature_0_7_is_below_the_bound(setup):
    name, engine, model, processor = setup
    formatter = TurnFormatter(processor)
    trajectories = run_rollouts(
        engine, formatter, load_pinned("maze_easy")[:2], ENV, 3, SamplingParams(0.7, 1.0, 8, []), max_turns=3
    )
    samples = [
        Sample(sequence, 1.0, group=t.maze_index, trajectory=i)
        for i, t in enumerate(trajectories)
        for sequence in training_sequences(formatter, t, None)
    ]
    assert sum(sum(s.sequence.loss_mask) for s in samples) > 20
    algo = type("Algo", (), {"micro_batch_size": 4})
    scorer = PolicyUpdate(model, None, None, algo, processor.tokenizer.pad_token_id, never_generated_ids(processor.tokenizer), lambda: 0)
    gap = scorer.score(samples, temperature=0.7, reference=False)["rollout/logprob_gap"]
    print(f"{name}: rollout/logprob_gap at T=0.7 = {gap:.2e} (bound {GAP_BOUND[name]:.0e})")
    assert gap < GAP_BOUND[name]


@pytest.mark.skipif(VLLM_SKIP is not None, reason=str(VLLM_SKIP))
def test_greedy_replies_equal_the_hf_engines_or_part_at_a_near_tie(setup):
    name, engine, model, processor = setup
    if name == "hf":
        pytest.skip("the reference itself")
    requests = _requests(processor)
    ours = engine.generate(requests, GREEDY)
    reference = HFEngine(model, processor).generate(requests, GREEDY)
    same = assert_same_or_near_tie(model, processor, requests, ours, reference, NEAR_TIE)
    print(f"greedy: {same}/{len(requests)} replies identical to the hf engine's")


def test_a_weight_sync_serves_the_updated_policy(setup, tmp_path):
    name, engine, model, processor = setup
    requests = _requests(processor, mazes=1)
    before = [o.token_ids for o in engine.generate(requests, GREEDY)]
    saved = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    try:
        _perturb(model, seed=1)
        engine.load_weights(tmp_path / "global_step_1" / "policy")
        after = engine.generate(requests, GREEDY)
        assert [o.token_ids for o in after] != before, "the sync did not change the replies"
        # and the replies are the updated policy's: the trainer agrees with their log-probs
        for request, out in zip(requests, after):
            trainer = [float(next_token_logprobs(model, processor, request, out.token_ids[:i])[t]) for i, t in enumerate(out.token_ids)]
            torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(trainer), atol=GAP_BOUND[name] * 10, rtol=0)
        if name == "vllm":
            engine.load_weights(tmp_path / "global_step_2" / "policy")
            assert (tmp_path / "global_step_2" / "policy" / "adapter_model.safetensors").is_file()
            assert not (tmp_path / "global_step_1").exists(), "the previous adapter stays on disk"
            assert set(engine.llm.llm_engine.list_loras()) == {engine._lora.lora_int_id}
    finally:
        model.load_state_dict(saved, strict=False)
        engine.load_weights(tmp_path / "restored" / "policy")
    assert [o.token_ids for o in engine.generate(requests, GREEDY)] == before


@pytest.mark.parametrize("level", ["1", "auto"])
def test_sleep_and_wake_keep_the_weights(setup, level):
    name, engine, model, processor = setup
    if name == "vllm":
        engine = _build(name, model, processor, sleep_level=level)
    elif level != "1":
        pytest.skip("the hf engine has no sleep levels")
    try:
        requests = _requests(processor, mazes=1)
        before = engine.generate(requests, GREEDY)
        engine.sleep()
        held = torch.empty(2**28, dtype=torch.uint8, device=DEVICE)  # the update's memory (256 MiB)
        del held
        engine.wake_up()
        after = engine.generate(requests, GREEDY)
        assert [o.token_ids for o in after] == [o.token_ids for o in before]
        torch.testing.assert_close(
            torch.tensor([lp for o in after for lp in o.logprobs]), torch.tensor([lp for o in before for lp in o.logprobs])
        )
        if level == "auto" and name == "vllm":
            assert engine.sleep_level == "0", "256 MiB of update fit beside a 10% engine: auto should stop sleeping"
    finally:
        if name == "vllm":
            _close(engine)


def test_prompt_ids_collapse_to_one_pad_per_image_and_a_mismatch_is_named(tiny_processor):
    """vLLM expands one ``<|image_pad|>`` per image itself; the engine sends that form and checks what came back."""
    pad = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    request = _requests(tiny_processor, mazes=1, turns=2)[-1]
    collapsed = collapse_image_runs(request.prompt_token_ids, pad)
    assert collapsed.count(pad) == len(request.images) == 2
    assert [t for t in collapsed if t != pad] == [t for t in request.prompt_token_ids if t != pad]
    check_prompt(request.prompt_token_ids, list(request.prompt_token_ids))
    with pytest.raises(RuntimeError, match="first difference at position 5"):
        check_prompt(request.prompt_token_ids, request.prompt_token_ids[:5] + [pad] + request.prompt_token_ids[5:])


def test_vllm_serves_a_float32_lora_policy_in_bfloat16_and_refuses_float32_with_lora():
    """vLLM 0.22's LoRA kernels take 16-bit weights only (its first H200 run stopped on a float32 adapter)."""
    assert engine_dtype("auto", torch.float32, lora=True) == "bfloat16"
    assert engine_dtype("auto", torch.float32, lora=False) == "float32"
    assert engine_dtype("auto", torch.bfloat16, lora=True) == "bfloat16"
    assert engine_dtype("float16", torch.float32, lora=True) == "float16"
    with pytest.raises(ValueError, match="dtype=float32 with a LoRA adapter"):
        engine_dtype("float32", torch.float32, lora=True)
    with pytest.raises(ValueError, match="valid: auto, bfloat16, float16, float32"):
        engine_dtype("fp8", torch.float32, lora=False)


@pytest.mark.skipif(VLLM_SKIP is not None, reason=str(VLLM_SKIP))
def test_rollout_vllm_trains_from_the_entrypoint(tmp_path):
    """A real tiny GRPO run with ``rollout=vllm``: every step sleeps, wakes and syncs the adapter."""
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "rlexp", "rollout=vllm", "cluster=gpu_1x", "cluster.gpu_memory_gb=0", "cluster.cpu_memory_gb=0",
         "logger=none", "total_steps=2", "eval.num_mazes=2", "rollout.max_turns=3", "rollout.max_new_tokens_per_turn=8",
         "rollout.engine.gpu_memory_utilization=0.2", "rollout.engine.max_model_len=4096", "rollout.engine.enforce_eager=true",
         f"hydra.run.dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "timing/sync_s" in m]
    assert len(steps) == 2 and all(m["timing/generate_tokens_per_s"] > 0 for m in steps)
    assert all(m["rollout/logprob_gap"] < GAP_BOUND["vllm"] for m in steps)
    assert (run_dir / "global_step_2" / "policy" / "adapter_config.json").is_file() and not (run_dir / "global_step_1").exists()
    print({k: round(v, 3) for k, v in steps[-1].items() if k.startswith("timing/")})
