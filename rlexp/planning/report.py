"""The plan as a table (``task=plan``) and as the one-line refusal training gives for a shape that cannot fit."""

from rlexp.config import ConfigError
from rlexp.planning.memory import GB, LOGIT_COPIES, USABLE, MemoryPlan, estimate, run_shape, suggestions, without_checkpointing


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} k"


def _gb(value: float) -> str:
    return f"{value / GB:8.2f}"


def render(plan: MemoryPlan, price_per_hour: float | None = None, step_time_s: float | None = None, total_steps: int = 1) -> str:
    s, m = plan.shape, plan.model
    where = "per GPU" if s.on_gpu else "host (CPU run)"
    shard = f"sharded /{s.world}" if s.world > 1 else "not sharded"
    gpus = f"{s.nodes} node(s) x {s.gpus_per_node} GPU(s) of {s.gpu_memory_gb:g} GB" if s.on_gpu else f"CPU, {s.cpu_memory_gb:g} GB host memory"
    ckpt = "on" if s.checkpointing else "off"
    lines = [
        f"plan: {s.model_path} ({_count(m.params)} params, {s.dtype}; LoRA r{s.lora_rank}: {_count(plan.lora_params)}) "
        f"on {s.cluster}: {gpus}; world size {s.world}{', FSDP2' if s.world > 1 else ''}",
        f"  model config: {m.source}",
        f"  longest sequence: {plan.sequence_tokens:,} tokens ({s.prompt_tokens} prompt + {s.context_turns} of {s.turns} turns in context x "
        f"({s.turn_text_tokens} text + {s.reply_tokens} reply + {plan.image_tokens} image)); micro-batch {s.micro_batch} "
        f"-> {s.micro_batch * plan.sequence_tokens:,} tokens per forward",
        f"  {'memory ' + where:<66}{'GB':>8}",
        f"  {'base parameters (' + s.dtype + ', ' + shard + ')':<66}{_gb(plan.base_params)}",
        f"  {'FSDP2 all-gather buffers (2 unsharded blocks)':<66}{_gb(plan.fsdp_gather)}",
        f"  {'LoRA params + grads + AdamW moments (fp32, ' + shard + ')':<66}{_gb(plan.lora_state)}",
        f"  {'activations, checkpointing on' + (' <- chosen' if s.checkpointing else ''):<66}{_gb(plan.activations_checkpointed)}",
        f"  {'activations, checkpointing off' + ('' if s.checkpointing else ' <- chosen'):<66}{_gb(plan.activations_full)}",
        f"  {f'logits ({LOGIT_COPIES} x scored tokens x {m.vocab:,} vocab)':<66}{_gb(plan.logits)}",
    ]
    if s.engine == "vllm":
        state = f"asleep (level {s.level_when_asleep})" if plan.must_sleep else "awake"
        lines += [
            f"  {f'vLLM engine during training: {state}':<66}{_gb(plan.engine_during_training)}",
            f"  {'= training peak':<66}{_gb(plan.train_peak)}",
            f"  {f'vLLM share at gpu_memory_utilization={s.gpu_memory_utilization}':<66}{_gb(plan.vllm_share)}",
            f"  {'  of which weights (full copy, TP=1)':<66}{_gb(plan.vllm_weights)}",
            f"  {'  of which KV cache':<66}{_gb(plan.vllm_kv)}",
        ]
        kv_per_token = m.kv_bytes_per_token(2)
        needed = s.rollout_sequences * plan.sequence_tokens
        held = max(plan.vllm_kv, 0) / kv_per_token
        lines.append(
            f"  KV cache holds {held:,.0f} tokens; the batch's {s.rollout_sequences} contexts need up to {needed:,} "
            f"({'all at once' if held >= needed else 'vLLM queues the rest'}); engine must sleep while training: "
            f"{'yes' if plan.must_sleep else 'no'}"
        )
    else:
        lines += [
            f"  {'= training peak':<66}{_gb(plan.train_peak)}",
            f"  {'hf engine: the rest of the weights, gathered for generation':<66}{_gb(plan.base_params * (s.world - 1))}",
            f"  {f'hf engine KV cache ({max(s.rollout_sequences, 0)} episodes a rank, at the longest context)':<66}{_gb(plan.rollout_kv)}",
            f"  {'hf engine prefill (one layer: activations and attention scores)':<66}{_gb(plan.rollout_prefill)}",
        ]
    lines += [
        f"  {'= rollout peak':<66}{_gb(plan.rollout_peak)}",
        f"  {'usable' + (f' ({s.gpu_memory_gb:g} GB x {USABLE})' if s.on_gpu else ''):<66}{_gb(plan.capacity)}",
        f"  engines: {s.world} {s.engine} engine(s), one per {'GPU' if s.on_gpu else 'process'} "
        f"x world size {s.world}; checkpointing {ckpt}",
    ]
    if plan.fits:
        lines.append(f"  FITS: peak {plan.peak / GB:.1f} GB of {plan.capacity / GB:.1f} GB usable")
        if faster := without_checkpointing(plan):
            lines.append(
                f"  faster: model.gradient_checkpointing=false fits too (peak {faster.peak / GB:.1f} GB) and skips the "
                "recompute of every layer (1.4-1.5x faster updates at 8B, BENCHMARKS.md)"
            )
    else:
        lines.append(f"  DOES NOT FIT: {'; '.join(plan.problems)}")
        hints = suggestions(plan)
        lines.append("  to fit: " + ("; ".join(hints) if hints else "no single change found (fewer turns, shorter replies, a smaller model)"))
    if price_per_hour is not None:
        lines.append(_cost_line(s.nodes, s.world, price_per_hour, step_time_s, total_steps))
    lines.append(summary_row(plan))
    return "\n".join(lines)


def _cost_line(nodes: int, gpus: int, price_per_hour: float, step_time_s: float | None, total_steps: int) -> str:
    per_hour = nodes * price_per_hour
    text = f"  cost: {gpus} GPU-hours and ${per_hour:,.2f} per hour"
    if step_time_s is None:
        return text + " (set plan.step_time_s for per step and per run)"
    step_hours = step_time_s / 3600
    return (
        text + f"; per step ({step_time_s:g} s): {gpus * step_hours:.3f} GPU-hours, ${per_hour * step_hours:,.2f}; "
        f"per run ({total_steps} steps): {gpus * step_hours * total_steps:.1f} GPU-hours, ${per_hour * step_hours * total_steps:,.2f}"
    )


def summary_row(plan: MemoryPlan) -> str:
    """One Markdown row: the cluster, its GPUs, the two peaks, the verdict."""
    s = plan.shape
    gpus = f"{s.world} x {s.gpu_memory_gb:g} GB" if s.on_gpu else f"CPU {s.cpu_memory_gb:g} GB"
    verdict = "fits" if plan.fits else "does not fit; " + ("; ".join(suggestions(plan)) or "no single change")
    return f"| {s.cluster} | {gpus} | {plan.train_peak / GB:.1f} | {plan.rollout_peak / GB:.1f} | {plan.capacity / GB:.1f} | {verdict} |"


def check_fit(cfg, cluster_name: str = "custom") -> MemoryPlan:
    """Refuse, in one line with the numbers, a run whose shape cannot fit its machines."""
    try:
        plan = estimate(run_shape(cfg, cluster_name))
    except FileNotFoundError as error:
        raise ConfigError(str(error)) from None
    if plan.fits:
        return plan
    hints = suggestions(plan)
    raise ConfigError(
        f"this run does not fit cluster={cluster_name}: {'; '.join(plan.problems)} (parameters {plan.base_params / GB:.1f}, "
        f"LoRA+AdamW {plan.lora_state / GB:.1f}, activations {plan.activations / GB:.1f}, logits {plan.logits / GB:.1f}, "
        f"rollout {(plan.rollout_peak - plan.resident) / GB:.1f} GB, at {plan.sequence_tokens:,} tokens a sequence); "
        f"to fit: {'; '.join(hints) if hints else 'shorter sequences or a smaller model'}; `rlexp task=plan` shows the table"
    )
