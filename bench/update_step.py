"""rlexp's policy update against the plain transformers + peft step, in one process, on the same batches.

    PYTHONPATH=. python3 bench/update_step.py --size 8b [--model-dir DIR] [--out DIR]   # on the GPU
    PYTHONPATH=. python3 bench/update_step.py --size tiny                               # CPU: numerics only

The model is rlexp's own policy (``TrainingRun``: LoRA on every linear layer of the language model,
activation checkpointing on), at ``--size 8b`` the Qwen3-VL-8B-shaped model with random bf16 weights of
``bench/vllm_rollout.py`` (LoRA r32), at ``--size tiny`` the tiny test model in fp32. The work is the
issue's: ``--sequences`` full-history conversations of ``--turns`` maze turns, each reply ``--reply`` tokens
(random ids ending in EOS; the images are real maze frames), with ±1 advantages, one optimizer step over
all of them in micro-batches of ``--micro`` (sorted by length: ``PolicyUpdate.micro_batches``).

Variants, each timed over ``--steps`` steps after one warm-up, with its peak GPU memory:

* ``plain``: what a plain step does -- a no-grad forward for the old log-probs, then a forward whose full
  ``[B, T, V]`` logits are taken to fp32 for the log-softmax, the clipped-ratio loss, backward, AdamW;
* ``rlexp_scored``: ``PolicyUpdate.score`` + ``PolicyUpdate.run`` (the vocabulary projected at the loss-masked
  positions only), as a step with several mini-batches runs;
* ``rlexp_on_policy``: ``PolicyUpdate.run`` alone, the exactly-on-policy step (no old-log-prob pass);
* ``rlexp_on_policy_fused`` (CUDA only): the same with ``AdamW(fused=True)``;
* ``rlexp_on_policy_fused_no_ckpt`` (CUDA only): the same without activation checkpointing
  (``model.gradient_checkpointing=false``; ``task=plan`` says whether a shape fits so).

Prints tokens/s (non-pad tokens), MFU at 4·N FLOP per token (forward plus activation gradients; recompute
not counted) against ``--peak-tflops`` (790 for bf16 on H100/H200), the padding share, the ratio of each
variant to ``plain``, and the gap between rlexp's and the plain log-probs on the first micro-batch.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

EOS_TEXT = "<|im_end|>"


def compose(size: str, model_dir: Path | None, turns: int, reply: int, sequences: int, micro: int):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from rlexp.cli import CONF_DIR
    from rlexp.config import register_configs

    overrides = [
        "logger=none", "name=bench_update", "run_name=bench", "env.history_window=null",
        f"rollout.max_turns={turns}", f"rollout.max_new_tokens_per_turn={reply}", "rollout.temperature=0.7",
        "model.gradient_checkpointing=true", f"algorithm.micro_batch_size={micro}",
        # one group of every sequence, one mini-batch: the step is exactly on policy
        f"algorithm.n_samples_per_prompt={sequences}", "algorithm.train_batch_size=1", "algorithm.policy_mini_batch_size=1",
    ]
    if size == "8b":
        overrides += [
            "cluster=gpu_1x", "cluster.gpu_memory_gb=0", "cluster.cpu_memory_gb=0", f"model.path={model_dir}",
            "model.dtype=bfloat16", "model.lora.rank=32", "model.lora.alpha=32",
        ]
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def work(run, turns: int, reply: int, sequences: int, reply_min: int | None = None, seed: int = 0):
    """Samples of the issue's shape: real maze frames and prompts, random replies of ``reply`` tokens
    (of ``reply_min`` to ``reply`` where given, as sampled replies that stop at EOS are)."""
    from rlexp.envs import ExpertPolicy, load_pinned
    from rlexp.rollout.conversation import training_sequences
    from rlexp.rollout.driver import scripted_trajectories
    from rlexp.training.update import Sample

    cfg, tokenizer = run.cfg, run.processor.tokenizer
    generator = torch.Generator().manual_seed(seed)
    added = set(tokenizer.get_added_vocab().values())  # the special and image tokens among them
    vocab = [i for i in range(min(len(tokenizer), 20_000)) if i not in added]
    eos = tokenizer.convert_tokens_to_ids(EOS_TEXT)
    (maze,) = load_pinned(cfg.env.pinned_set)[:1]
    trajectories = scripted_trajectories(ExpertPolicy(), [maze], cfg.env, sequences, turns, run.formatter)
    samples = []
    for index, trajectory in enumerate(trajectories):
        for turn in trajectory.turns:
            length = reply if reply_min is None else int(torch.randint(reply_min, reply + 1, (1,), generator=generator))
            picks = torch.randint(len(vocab), (length - 1,), generator=generator).tolist()
            turn.response_ids = [vocab[p] for p in picks] + [eos]
            turn.logprobs = [0.0] * length
            turn.encoded.clear()
        (sequence,) = training_sequences(run.formatter, trajectory, None)
        samples.append(Sample(sequence, 1.0 if index % 2 else -1.0, group=0, trajectory=index))
    return samples


def padding_share(lengths: list[int], micro: int) -> float:
    """The share of padding in right-padded micro-batches of ``micro`` sequences taken in this order."""
    chunks = [lengths[i : i + micro] for i in range(0, len(lengths), micro)]
    padded = sum(max(c) * len(c) for c in chunks)
    return 1 - sum(lengths) / padded


def plain_logprobs(model, batch, temperature: float):
    """Every position's logits over the whole vocabulary, in fp32, as a plain step computes them."""
    inputs = {k: v for k, v in batch.items() if k != "loss_mask"}
    logits = model(**inputs, use_cache=False).logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)


def plain_step(run, micro_batches, temperature: float, eps: float = 0.2) -> None:
    model, optimizer = run.model, run.optimizer
    model.eval()
    with torch.no_grad():
        old = [plain_logprobs(model, m.batch, temperature) for m in micro_batches]
    model.train()
    optimizer.zero_grad(set_to_none=True)
    tokens = sum(int(m.batch["loss_mask"].sum()) for m in micro_batches)
    for micro, old_logprobs in zip(micro_batches, old):
        logprobs = plain_logprobs(model, micro.batch, temperature)
        advantages = torch.tensor([s.advantage for s in micro.samples], device=logprobs.device)[:, None]
        ratio = torch.exp(logprobs - old_logprobs)
        surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - eps, 1 + eps) * advantages)
        (-(surrogate * micro.batch["loss_mask"]).sum() / tokens).backward()
    torch.nn.utils.clip_grad_norm_(run.update.params, run.cfg.algorithm.max_grad_norm)
    optimizer.step()


def timed_steps(step, steps: int, device: torch.device) -> dict[str, float]:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"step_s": statistics.median(times), "peak_gib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["tiny", "8b"], default="tiny")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "qwen3vl-8b-random")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--reply", type=int, default=64)
    parser.add_argument("--reply-min", type=int, default=None, help="vary reply lengths from this to --reply")
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=790.0)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")), help="where update_step.json goes")
    args = parser.parse_args()

    from rlexp.cli import prepare
    from rlexp.tasks.train_grpo import GRPOStep
    from rlexp.tracking import Trackers
    from rlexp.training.batching import token_logprobs
    from rlexp.training.loop import TrainingRun

    model_dir = None
    if args.size == "8b":
        from vllm_rollout import build_8b

        model_dir = build_8b(args.model_dir)
    cfg = compose(args.size, model_dir, args.turns, args.reply, args.sequences, args.micro)
    prepare(cfg)
    run = TrainingRun(cfg, Path(tempfile.mkdtemp(prefix="bench-update-run-")), Trackers([]))
    device = run.update.device
    machine = torch.cuda.get_device_name(0) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"machine: {machine}, torch {torch.__version__}; model {args.size}, dtype {cfg.model.dtype}")
    samples = work(run, args.turns, args.reply, args.sequences, args.reply_min)
    recipe = GRPOStep(run)
    temperature = cfg.rollout.temperature
    micro_batches = run.update.micro_batches(samples)
    masks = [m.batch["attention_mask"] for m in micro_batches]
    tokens = sum(int(m.sum()) for m in masks)
    padding = 1 - tokens / sum(m.numel() for m in masks)
    scored = sum(int(m.batch["loss_mask"].sum()) for m in micro_batches)
    lengths = [len(s.sequence.token_ids) for s in samples]
    unsorted_padding = padding_share(lengths, args.micro)
    print(f"work: {len(samples)} sequences, {min(lengths)}-{max(lengths)} tokens ({tokens} in all), "
          f"{scored} scored (loss-masked); padding {padding:.1%} of the micro-batches "
          f"({unsorted_padding:.1%} in rollout order, unsorted)")

    run.model.eval()
    with torch.no_grad():
        first = micro_batches[0].batch
        plain = plain_logprobs(run.model, first, temperature)
        fast, _ = token_logprobs(run.model, first, temperature)
    mask = first["loss_mask"].bool()
    gap = (fast - plain)[mask].abs()
    print(f"log-probs, rlexp vs plain (first micro-batch): max |diff| {gap.max():.2e}, mean {gap.mean():.2e}")

    def rlexp_step(score: bool):
        def step():
            for sample in samples:
                sample.old_logprobs = None
            if score:
                run.update.score(samples, temperature, reference=False)
            run.update.run(samples, recipe.loss, temperature, measure_gap=not score)
        return step

    variants = {
        "plain": lambda: plain_step(run, micro_batches, temperature),
        "rlexp_scored": rlexp_step(score=True),
        "rlexp_on_policy": rlexp_step(score=False),
    }
    params = sum(p.numel() for p in run.model.parameters())
    results = {}
    for name, step in variants.items():
        results[name] = timed_steps(step, args.steps, device)
    if device.type == "cuda":
        run.optimizer = run.update.optimizer = torch.optim.AdamW(run.update.params, lr=cfg.algorithm.lr, fused=True)
        results["rlexp_on_policy_fused"] = timed_steps(rlexp_step(score=False), args.steps, device)
        # what model.gradient_checkpointing=false trains with (transformers >= 5.2x name, or the older one)
        (getattr(run.model, "activation_checkpointing_disable", None) or run.model.gradient_checkpointing_disable)()
        try:
            results["rlexp_on_policy_fused_no_ckpt"] = timed_steps(rlexp_step(score=False), args.steps, device)
        except torch.cuda.OutOfMemoryError:
            print(f"rlexp_on_policy_fused_no_ckpt: out of GPU memory at micro-batch {args.micro}")
    for name, figures in results.items():
        figures["tokens_per_s"] = tokens / figures["step_s"]
        figures["mfu"] = 4 * params * figures["tokens_per_s"] / (args.peak_tflops * 1e12)
        figures["vs_plain"] = results["plain"]["step_s"] / figures["step_s"]
        print(f"{name:>22}: {figures['step_s']:.3f} s/step, {figures['tokens_per_s']:,.0f} tok/s, "
              f"MFU {figures['mfu']:.1%}, peak {figures['peak_gib']:.1f} GiB, {figures['vs_plain']:.2f}x plain")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": machine, "torch": torch.__version__, "size": args.size, "params": params, "sequences": len(samples),
        "tokens": tokens, "scored_tokens": scored, "padding_share": padding,
        "padding_share_unsorted": unsorted_padding, "micro_batch_size": args.micro,
        "logprob_max_abs_diff": float(gap.max()), "logprob_mean_abs_diff": float(gap.mean()), "variants": results,
    }
    (args.out / "update_step.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
