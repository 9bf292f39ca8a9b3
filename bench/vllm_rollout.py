"""``rollout=vllm`` inside rlexp's own train step, on a Qwen3-VL-8B-shaped model with random bf16 weights.

    VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=. python3 bench/vllm_rollout.py [--model-dir DIR] [--out DIR]

The model is built on the GPU from the real Qwen3-VL-8B sizes (DESIGN.md: text hidden 4096 × 36 layers, 32 heads,
8 KV heads, intermediate 12288, vocab 151,936; vision depth 27, hidden 1152; 8.77 B parameters) with the tiny
model's tokenizer and processor (its special-token ids), saved once (``--model-dir``, reused when it holds a
model), and then everything goes through rlexp's own path: the composed config (``rollout=vllm
cluster=gpu_1x model.path=DIR model.dtype=bfloat16``, LoRA r32), ``TrainingRun`` (the policy, the engine
built from ``rollout.engine``), ``run_rollouts`` and ``GRPOStep``. The work is the issue's: maze images, the
whole image history, 3 turns of 64 new tokens (random weights almost never emit EOS, so replies run to 64).

Prints: engine start; rollout tokens/s at B=64 and B=256 episodes (8 samples per maze); then two GRPO steps of
32 mazes × 8 samples (the seed's shape at 3 turns × 64 tokens, so that it fits a 10-minute command) broken down
into generate / sleep / old log-probs / update / wake / sync, the first with ``sleep_level=auto`` still
measuring (it sleeps at level 1), the second after its decision; and a greedy eval of the pinned 64 mazes.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

TURNS, TOKENS, SAMPLES = 3, 64, 8
#: Qwen3-VL-8B's sizes (DESIGN.md, "Hardware facts").
TEXT_8B = {
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6, "vocab_size": 151936,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True},
}
VISION_8B = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "hidden_act": "gelu_pytorch_tanh",
    "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24], "out_hidden_size": 4096,
}


def build_8b(out_dir: Path) -> Path:
    """The 8B-shaped model with random bf16 weights (initialised on the GPU) and the tiny processor, saved."""
    from transformers import AutoConfig, AutoProcessor, GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from rlexp.models import tiny_model_path

    if (out_dir / "config.json").is_file():
        return out_dir
    tiny = tiny_model_path()
    ids = AutoConfig.from_pretrained(tiny)
    config = Qwen3VLConfig(
        text_config=dict(TEXT_8B, pad_token_id=ids.pad_token_id), vision_config=VISION_8B,
        image_token_id=ids.image_token_id, video_token_id=ids.video_token_id,
        vision_start_token_id=ids.vision_start_token_id, vision_end_token_id=ids.vision_end_token_id,
        tie_word_embeddings=False,
    )
    config.eos_token_id, config.pad_token_id = ids.eos_token_id, ids.pad_token_id
    start = time.perf_counter()
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = Qwen3VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(default)
    model.generation_config = GenerationConfig.from_pretrained(tiny)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out_dir)
    AutoProcessor.from_pretrained(tiny).save_pretrained(out_dir)
    del model
    torch.cuda.empty_cache()
    print(f"built {params / 1e9:.2f} B parameters (bf16, random) into {out_dir} in {time.perf_counter() - start:.0f} s")
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "qwen3vl-8b-random")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")), help="where vllm_rollout.json goes")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256], help="rollout batch sizes (episodes)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir

    from rlexp.cli import CONF_DIR, prepare
    from rlexp.config import register_configs
    from rlexp.rollout.driver import run_rollouts, stop_strings
    from rlexp.rollout.engine import SamplingParams
    from rlexp.tasks.train_grpo import GRPOStep
    from rlexp.tracking import build_trackers
    from rlexp.training.loop import TrainingRun, timed

    model_dir = build_8b(args.model_dir)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-vllm-run-"))  # the synced adapters go here, not to --out
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[
            "rollout=vllm", "cluster=gpu_1x", "cluster.gpu_memory_gb=0", "cluster.cpu_memory_gb=0", "logger=none",
            f"model.path={model_dir}", "model.dtype=bfloat16", "model.gradient_checkpointing=true",
            "model.lora.rank=32", "model.lora.alpha=32", "env.history_window=null",
            f"rollout.max_turns={TURNS}", f"rollout.max_new_tokens_per_turn={TOKENS}", "rollout.temperature=0.7",
            f"rollout.engine.gpu_memory_utilization={args.gpu_memory_utilization}", "rollout.engine.max_model_len=8192",
            f"algorithm.n_samples_per_prompt={SAMPLES}", "algorithm.train_batch_size=32", "algorithm.policy_mini_batch_size=16",
            "algorithm.micro_batch_size=4", "total_steps=2", "eval.num_mazes=64", "name=bench_vllm", "run_name=bench",
        ])
    prepare(cfg)
    print(f"machine: {torch.cuda.get_device_name(0)}, torch {torch.__version__}; vLLM {__import__('vllm').__version__}")

    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    run = TrainingRun(cfg, run_dir, build_trackers(cfg.logger, run_dir, cfg))
    print(f"policy load + vLLM engine start: {time.perf_counter() - start:.0f} s")
    sampling = SamplingParams(cfg.rollout.temperature, 1.0, TOKENS, stop_strings(cfg.env.action_format.value))
    run_rollouts(run.engine, run.formatter, run.stream.next_batch(1), cfg.env, SAMPLES, sampling, 1)  # warm-up

    figures = {}

    def record(key, value):
        figures[key] = value
        (args.out / "vllm_rollout.json").write_text(json.dumps(figures, indent=2) + "\n")

    for batch in args.batches:
        trajectories, seconds = timed(
            run_rollouts, run.engine, run.formatter, run.stream.next_batch(batch // SAMPLES), cfg.env, SAMPLES, sampling, TURNS
        )
        tokens = sum(len(turn.response_ids) for t in trajectories for turn in t.turns)
        record(f"rollout_B{batch}_tok_per_s", tokens / seconds)
        print(f"rollout B={batch} x {TURNS} turns: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:,.0f} tok/s")

    step = GRPOStep(run)
    for index in (1, 2):
        level = run.engine.sleep_level
        start = time.perf_counter()
        metrics = step()
        run.step += 1
        metrics.update(run.sync_engine())
        wall = time.perf_counter() - start
        parts = {k: metrics.get(f"timing/{k}", 0.0) for k in ("generate_s", "sleep_s", "score_s", "train_s", "wake_s", "sync_s")}
        colocation = parts["sleep_s"] + parts["wake_s"] + parts["sync_s"]
        print(
            f"GRPO step {index} (32 mazes x {SAMPLES}, sleep_level {level} -> {run.engine.sleep_level}): {wall:.1f} s = "
            + " / ".join(f"{k[:-2]} {v:.1f}" for k, v in parts.items())
            + f" s; {metrics.get('timing/generate_tokens_per_s', 0.0):,.0f} tok/s; colocation (sleep + wake + sync) "
            f"{colocation:.1f} s = {colocation / wall:.1%} of the step; logprob_gap {metrics.get('rollout/logprob_gap', float('nan')):.2e}"
        )
        record(f"grpo_step{index}", {**parts, "wall_s": wall, "colocation_share": colocation / wall, **{
            k: metrics[k] for k in ("timing/generate_tokens_per_s", "rollout/logprob_gap") if k in metrics}})
    _, seconds = timed(run.evaluate)
    print(f"eval of the pinned 64 (greedy, <= {TURNS} turns): {seconds:.1f} s")
    record("eval_s", seconds)
    run.engine.close()


if __name__ == "__main__":  # vLLM starts its engine process with spawn, which re-imports this module
    main()
