"""The memory planner: shapes read from configs with no weights, the per-GPU terms behave as the trainer
does (sharding divides, checkpointing saves, micro-batches scale), a shape that does not fit comes with a
change that makes it fit, and training refuses such a shape before anything loads."""

import dataclasses

import pytest

from conftest import compose_config
from rlexp.cli import prepare
from rlexp.config import ConfigError
from rlexp.planning import GB, check_fit, estimate, render, run_shape, suggestions
from rlexp.planning.shapes import lora_params, model_shape

EIGHT_B = "Qwen/Qwen3-VL-8B-Instruct"


def shape_of(*overrides: str, cluster: str = "custom"):
    return run_shape(compose_config(*overrides), cluster)


def test_8b_shape_from_the_bundled_config_matches_the_published_model():
    shape = model_shape(EIGHT_B)
    assert shape.params == 8_767_123_696  # 8.77 B (DESIGN.md)
    assert (shape.layers, shape.hidden, shape.intermediate, shape.kv_dim, shape.vocab) == (36, 4096, 12288, 1024, 151936)
    # rank 32 on q, k, v, o, gate, up, down of 36 layers: 32 x (in + out) each
    per_layer = (4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 2 * (4096 + 12288) + (12288 + 4096)
    assert lora_params(EIGHT_B, 32, "all-linear-language") == 36 * 32 * per_layer


def test_sharding_divides_parameters_and_optimizer_state_and_adds_gather_buffers():
    one = estimate(shape_of("experiment=visgym_maze_grpo", "cluster=gpu_1x"))
    two = estimate(dataclasses.replace(one.shape, gpus_per_node=2))
    assert two.base_params == pytest.approx(one.base_params / 2)
    assert two.lora_state == pytest.approx(one.lora_state / 2)
    assert one.fsdp_gather == 0 < two.fsdp_gather
    assert two.shape.rollout_sequences == one.shape.rollout_sequences / 2  # each rank plays half the mazes
    assert one.base_params == model_shape(EIGHT_B).params * 2  # bf16


def test_checkpointing_saves_activations_and_micro_batch_scales_them():
    plan = estimate(shape_of("experiment=visgym_maze_grpo", "cluster=gpu_1x"))
    assert plan.activations_checkpointed < plan.activations_full / 10
    half = estimate(dataclasses.replace(plan.shape, micro_batch=plan.shape.micro_batch // 2))
    assert half.activations_full == pytest.approx(plan.activations_full / 2)
    assert half.logits == pytest.approx(plan.logits / 2)
    longer = estimate(dataclasses.replace(plan.shape, reply_tokens=plan.shape.reply_tokens * 2))
    assert longer.sequence_tokens > plan.sequence_tokens and longer.rollout_kv > plan.rollout_kv


def test_a_shape_that_does_not_fit_names_a_change_that_fits():
    plan = estimate(shape_of(
        "experiment=visgym_maze_grpo", "cluster=gpu_1x", "plan.reply_tokens=64", "rollout.max_turns=3",
        "algorithm.train_batch_size=8", "algorithm.policy_mini_batch_size=8",
    ))
    assert plan.fits
    tight = estimate(dataclasses.replace(plan.shape, micro_batch=64, gpu_memory_gb=40))
    assert not tight.fits and "per GPU" in tight.problems[0]
    hints = suggestions(tight)
    micro = next(h for h in hints if h.startswith("algorithm.micro_batch_size="))
    size = int(micro.split("=")[1].split()[0])
    assert estimate(dataclasses.replace(tight.shape, micro_batch=size)).fits
    assert not estimate(dataclasses.replace(tight.shape, micro_batch=size + 1)).fits  # the largest that fits
    text = render(tight, price_per_hour=4.0, step_time_s=360, total_steps=10)
    assert "DOES NOT FIT" in text and micro in text
    assert "per step (360 s): 0.100 GPU-hours, $0.40; per run (10 steps): 1.0 GPU-hours, $4.00" in text


def test_a_shape_that_fits_without_checkpointing_says_so_and_one_that_does_not_stays_quiet():
    plan = estimate(shape_of(
        "experiment=visgym_maze_grpo", "cluster=gpu_1x", "model.gradient_checkpointing=true", "plan.reply_tokens=64",
        "rollout.max_turns=3", "algorithm.train_batch_size=8", "algorithm.policy_mini_batch_size=8",
    ))
    assert plan.fits and plan.shape.checkpointing
    off = estimate(dataclasses.replace(plan.shape, checkpointing=False))
    assert off.fits
    assert f"model.gradient_checkpointing=false fits too (peak {off.peak / GB:.1f} GB)" in render(plan)
    # a GPU just large enough with checkpointing: no such line (and none for a plan that already runs without)
    snug = estimate(dataclasses.replace(plan.shape, gpu_memory_gb=plan.peak / GB / 0.92 + 1))
    assert snug.fits and not estimate(dataclasses.replace(snug.shape, checkpointing=False)).fits
    assert "gradient_checkpointing=false" not in render(snug)
    assert "gradient_checkpointing=false" not in render(off)


def test_training_refuses_a_shape_that_cannot_fit_before_loading(monkeypatch):
    def refuse(*args, **kwargs):
        pytest.fail("a model was loaded")

    monkeypatch.setattr("rlexp.models.policy.load_model_and_processor", refuse)
    cfg = compose_config("model=qwen3_vl_8b")  # 17.5 GB of weights on the 4 GB local_cpu
    with pytest.raises(ConfigError) as error:
        prepare(cfg)
    message = str(error.value)
    assert "\n" not in message and "does not fit" in message and "parameters 17.5" in message, message
    with pytest.raises(ConfigError, match="model.path=/no/such/model"):
        check_fit(compose_config("model.path=/no/such/model"))
    assert check_fit(compose_config()).fits  # the default tiny run


def test_vllm_engine_share_and_sleep():
    plan = estimate(shape_of("experiment=visgym_maze_grpo", "cluster=gpu_1x", "plan.reply_tokens=64"))
    vllm = estimate(dataclasses.replace(plan.shape, engine="vllm", gpu_memory_utilization=0.45))
    assert vllm.vllm_share == pytest.approx(0.45 * 141 * GB)
    assert vllm.vllm_kv == pytest.approx(vllm.vllm_share - vllm.vllm_weights - 2 * GB)
    cramped = estimate(dataclasses.replace(vllm.shape, gpu_memory_gb=48, gpus_per_node=8, cpu_memory_gb=1024, sleep_level="0", micro_batch=16))
    assert cramped.must_sleep and not cramped.fits and cramped.train_peak > cramped.vllm_share
    assert any(h.startswith("rollout.engine.sleep_level=1") for h in suggestions(cramped))


def test_the_vllm_options_auto_sleep_is_planned_as_the_engine_runs_it():
    """``rollout=vllm`` composes ``sleep_level: auto``; where the engine must sleep, auto sleeps at level 1 (it
    frees all but its asleep remainder), and where it need not, the engine stays awake with its whole share."""
    overrides = ("experiment=visgym_maze_grpo", "rollout=vllm", "plan.reply_tokens=64")
    cramped = estimate(shape_of(*overrides, "cluster=g6e_12xlarge", "algorithm.micro_batch_size=16"))
    assert cramped.shape.sleep_level == "auto" and cramped.must_sleep and cramped.fits
    assert cramped.engine_during_training < 0.1 * cramped.vllm_share
    assert "vLLM engine during training: asleep (level 1)" in render(cramped)
    roomy = estimate(shape_of(*overrides, "cluster=gpu_1x"))
    assert not roomy.must_sleep and roomy.engine_during_training == roomy.vllm_share
    assert check_fit(compose_config(*overrides, "cluster=g6e_12xlarge", "algorithm.micro_batch_size=16")).fits
