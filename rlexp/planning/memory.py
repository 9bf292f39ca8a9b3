"""Per-GPU memory of a run's shape, from the config and the model's shape alone, and whether it fits.

The estimate follows what rlexp's trainer and engines hold (bytes per GPU; GB = 1e9 bytes):

* base parameters: every frozen weight in ``model.dtype``, divided by the world size under FSDP2, plus
  two unsharded blocks (the one computing and the one prefetched) while FSDP2 all-gathers;
* LoRA: fp32 parameters (peft keeps adapters in fp32), their fp32 gradients and AdamW's two moments,
  16 bytes per parameter, divided by the world size under FSDP2;
* activations of one micro-batch (``micro_batch_size`` × the longest sequence): with checkpointing, each
  decoder layer's input plus one layer recomputed in backward; without it, every layer's saved tensors
  (the norms' fp32 internals, q/k/v and the attention output, the MLP's four intermediates, scaled by
  ``SAVED_TENSORS_SCALE`` for what autograd keeps beyond them);
* the logits: ``LOGIT_COPIES`` tensors of scored tokens × vocabulary in ``model.dtype``. The update
  projects the vocabulary only where the loss reads it (``token_logprobs``): every reply of a full-history
  sequence, the last one of a windowed one. With checkpointing they are freed before backward reaches the
  recomputed layers, so the peak holds the larger of the two, not both;
* the rollout: with the in-process ``hf`` engine, the weights unsharded (under FSDP2 each rank gathers
  them for generation, which then needs no collectives), the KV cache of every episode a rank plays at
  once (rank 0 plays the whole eval set) at the longest context, plus one layer's prefill activations and
  ``PREFILL_SCORE_BYTES`` per head and (query, key) pair of the prefill; with a colocated vLLM engine (one per
  GPU), its ``gpu_memory_utilization`` share, of which the KV cache is what its weights leave. The
  engine must sleep when that share and the trainer's peak do not fit together.

The longest sequence is the prompt, then every turn in the context (all, or the history window's) with
its image, text and reply at ``plan.reply_tokens`` (``rollout.max_new_tokens_per_turn`` when null: the worst case); text is counted
at ``CHARS_PER_TOKEN``. ``bench/plan_calibration.py`` measures the same terms on a GPU.
"""

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from rlexp.envs.prompts import WALL_BUMP, instructions, turn_text
from rlexp.planning.shapes import ModelShape, lora_params, model_shape

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: English text through a byte-level BPE of Qwen's size.
CHARS_PER_TOKEN = 4
#: chat-template tokens of one message (<|im_start|>role\n … <|im_end|>\n, vision start/end).
TEMPLATE_TOKENS = 8
#: tensors of scored tokens × vocab alive at the loss's peak (the bf16 logits, their masked copy and its gradient,
#: less what the chunked fp32 log-softmax frees): 2.53–2.97 measured on the H200, 2B and 8B shapes,
#: 2026-12-06 (bench/plan_calibration.py, BENCHMARKS.md).
LOGIT_COPIES = 2.75
#: autograd's saved tensors of one decoder layer against those ``estimate`` counts (LoRA's inputs and rank-r
#: outputs, SDPA's extras and the rotary copies are not counted one by one): 1.36–1.40 measured, as above.
SAVED_TENSORS_SCALE = 1.38
#: the hf engine's prefill holds this many bytes per attention head and (query, key) pair beyond the
#: per-token activations: fitted to the 2B and 8B rollouts of bench/plan_calibration.py (within 1.2% with it,
#: −12% to −26% without); what holds them inside transformers' SDPA call is not traced.
PREFILL_SCORE_BYTES = 1
#: share of a GPU's memory the caching allocator can hand out (the rest: CUDA context, fragmentation).
USABLE = 0.92
#: vLLM's own use inside its share besides weights and KV cache (CUDA graphs, sampler, activations).
VLLM_OVERHEAD_GB = 2.0
#: what a sleeping vLLM engine keeps on the GPU (level 1 moves its weights to host memory).
VLLM_ASLEEP_GB = 0.5
#: the cluster options (conf/cluster/*.yaml), for "another instance type" suggestions.
CLUSTER_DIR = Path(__file__).resolve().parent.parent / "conf" / "cluster"


@dataclass(frozen=True)
class RunShape:
    """The config values the estimate reads, flat, so that a suggestion is one ``dataclasses.replace``."""

    model_path: str
    dtype: str
    checkpointing: bool
    lora_rank: int
    lora_targets: str | tuple[str, ...]
    micro_batch: int
    #: mazes per step and samples per maze: each rank plays its share of them at once.
    train_batch: int
    group_size: int
    eval_sequences: int
    prompt_tokens: int
    turns: int
    #: turns in the longest context: all of them, or the history window's (``env.history_window``).
    context_turns: int
    #: turns a history window of k keeps: k + 1 (VisGym's style: k earlier turns and the current one) or k.
    window_extra: int
    turn_text_tokens: int
    reply_tokens: int
    image_side_px: int
    engine: str
    gpu_memory_utilization: float
    #: ``rollout.engine.sleep_level``: auto | 0 | 1.
    sleep_level: str
    cluster: str
    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float
    cpu_memory_gb: float

    @property
    def level_when_asleep(self) -> int:
        """The level the engine sleeps at when it must: ``auto`` sleeps at 1 (``rlexp.rollout.vllm_engine``)."""
        return 1 if self.sleep_level == "auto" else int(self.sleep_level)

    @property
    def world(self) -> int:
        return max(1, self.nodes * self.gpus_per_node)

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def rollout_sequences(self) -> int:
        """Episodes one rank plays at once: its share of the step's mazes, each ``group_size`` times."""
        return math.ceil(self.train_batch / self.world) * self.group_size


def visible_gpu_gb(device: str) -> float:
    """Memory of this machine's ``device`` (GB), 0 where it has none: what ``cluster.gpu_memory_gb=0`` plans with
    on a GPU cluster."""
    import torch

    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return 0.0
    return torch.cuda.get_device_properties(int(str(device).partition(":")[2] or 0)).total_memory / GB


def run_shape(cfg, cluster_name: str = "custom") -> RunShape:
    """The shape of the run ``cfg`` describes (the composed config; nothing is loaded); ``cluster_name``: the
    ``cluster`` option it came from, left out of "another instance type" suggestions."""
    env, rollout, algo, cluster = cfg.env, cfg.rollout, cfg.algorithm, cfg.cluster
    turns = min(env.max_steps, rollout.max_turns)
    window = env.history_window
    style = env.history_style.value if env.history_style.value != "auto" else ("visgym" if env.prompt.value == "visgym" else "last_k")
    window_extra = 1 if style == "visgym" else 0
    elicit = env.elicit_verbalization if env.elicit_verbalization is not None else env.prompt.value == "visgym"
    prompt = instructions(env.prompt.value, env.action_format.value, env.size, elicit)
    engine = OmegaConf.select(cfg, "rollout.engine._target_")
    targets = model_targets(cfg.model.lora.target_modules)
    return RunShape(
        model_path=cfg.model.path,
        dtype=cfg.model.dtype.value,
        checkpointing=cfg.model.gradient_checkpointing,
        lora_rank=cfg.model.lora.rank,
        lora_targets=targets,
        micro_batch=algo.micro_batch_size,
        train_batch=algo.train_batch_size,
        group_size=algo.n_samples_per_prompt,
        eval_sequences=cfg.eval.num_mazes * cfg.eval.samples_per_maze,
        prompt_tokens=math.ceil(len(prompt) / CHARS_PER_TOKEN) + TEMPLATE_TOKENS,
        turns=turns,
        context_turns=turns if window is None else min(turns, window + window_extra),
        window_extra=window_extra,
        turn_text_tokens=math.ceil(len(turn_text(WALL_BUMP, turns, env.max_steps)) / CHARS_PER_TOKEN) + TEMPLATE_TOKENS,
        reply_tokens=cfg.plan.reply_tokens or rollout.max_new_tokens_per_turn,
        image_side_px=env.size * env.cell_px,
        engine="vllm" if "vllm" in engine.lower() else "hf",
        gpu_memory_utilization=OmegaConf.select(cfg, "rollout.engine.gpu_memory_utilization", default=0.45),
        sleep_level=str(OmegaConf.select(cfg, "rollout.engine.sleep_level", default="0")),
        cluster=cluster_name,
        nodes=cluster.nodes,
        gpus_per_node=cluster.gpus_per_node,
        gpu_memory_gb=cluster.gpu_memory_gb or (visible_gpu_gb(cluster.device) if cluster.gpus_per_node else 0.0),
        cpu_memory_gb=cluster.cpu_memory_gb,
    )


def model_targets(target_modules) -> str | tuple[str, ...]:
    return target_modules if isinstance(target_modules, str) else tuple(target_modules)


@dataclass
class MemoryPlan:
    shape: RunShape
    model: ModelShape
    lora_params: int
    image_tokens: int
    sequence_tokens: int
    #: bytes per GPU (per process on CPU).
    base_params: float
    fsdp_gather: float
    lora_state: float
    #: each decoder layer's input (what checkpointing keeps) and one layer's saved tensors.
    layer_inputs: float
    layer_saved: float
    activations_full: float
    logits: float
    rollout_kv: float
    rollout_prefill: float
    vllm_share: float
    vllm_weights: float
    vllm_kv: float
    must_sleep: bool
    capacity: float

    @property
    def activations_checkpointed(self) -> float:
        return self.layer_inputs + self.layer_saved

    @property
    def activations(self) -> float:
        return self.activations_checkpointed if self.shape.checkpointing else self.activations_full

    @property
    def activations_and_logits(self) -> float:
        """The update's peak beyond the resident state: with checkpointing the logits are gone before the
        first layer is recomputed, without it every layer's tensors are alive beside them."""
        if self.shape.checkpointing:
            return self.layer_inputs + max(self.layer_saved, self.logits)
        return self.activations_full + self.logits

    @property
    def resident(self) -> float:
        """What the trainer holds between phases: weights, FSDP buffers, LoRA and optimizer state."""
        return self.base_params + self.fsdp_gather + self.lora_state

    @property
    def train_peak(self) -> float:
        return self.resident + self.activations_and_logits + self.engine_during_training

    @property
    def engine_during_training(self) -> float:
        if self.shape.engine != "vllm":
            return 0.0
        return VLLM_ASLEEP_GB * GB if self.must_sleep and self.shape.level_when_asleep > 0 else self.vllm_share

    @property
    def rollout_peak(self) -> float:
        if self.shape.engine == "vllm":
            return self.resident + self.vllm_share
        unsharded = self.base_params * (self.shape.world - 1) if self.shape.world > 1 else 0.0
        return self.resident + unsharded + self.rollout_kv + self.rollout_prefill

    @property
    def peak(self) -> float:
        return max(self.train_peak, self.rollout_peak)

    @property
    def problems(self) -> list[str]:
        """Why the shape cannot run (empty: it fits)."""
        found = []
        where = "per GPU" if self.shape.on_gpu else "of host memory"
        if self.peak > self.capacity:
            found.append(f"needs {self.peak / GB:.1f} GB {where}, {self.capacity / GB:.1f} GB usable")
        if self.shape.engine == "vllm":
            if self.vllm_kv <= 0:
                found.append(
                    f"vLLM's share ({self.vllm_share / GB:.1f} GB at gpu_memory_utilization={self.shape.gpu_memory_utilization}) "
                    "leaves no KV cache after its weights"
                )
            host = self.vllm_weights * self.shape.gpus_per_node if self.must_sleep and self.shape.level_when_asleep == 1 else 0.0
            if host > self.shape.cpu_memory_gb * GB:
                found.append(f"sleep level 1 offloads {host / GB:.0f} GB of weights per node to {self.shape.cpu_memory_gb:.0f} GB of host memory")
        return found

    @property
    def fits(self) -> bool:
        return not self.problems


def estimate(shape: RunShape, sequence_tokens: int | None = None, scored_tokens: int | None = None) -> MemoryPlan:
    """``sequence_tokens``: the longest sequence where it is known (a benchmark's), else from the turns;
    ``scored_tokens``: the loss-masked tokens of each sequence where known, else its replies'."""
    model = model_shape(shape.model_path)
    dtype = DTYPE_BYTES[shape.dtype]
    lora = lora_params(shape.model_path, shape.lora_rank, shape.lora_targets)
    sharded = shape.world > 1
    image_tokens = max(1, round(shape.image_side_px / model.pixels_per_token)) ** 2
    sequence = sequence_tokens or (
        shape.prompt_tokens
        + shape.context_turns * (shape.turn_text_tokens + shape.reply_tokens + TEMPLATE_TOKENS + image_tokens)
    )
    tokens = shape.micro_batch * sequence
    # full history: one sequence per episode, every reply trained; a window: one sequence per turn, its reply
    replies = shape.context_turns if shape.context_turns == shape.turns else 1
    scored = shape.micro_batch * (scored_tokens if scored_tokens is not None else replies * shape.reply_tokens)
    h, q, kv, inter = model.hidden, model.q_dim, model.kv_dim, model.intermediate
    # saved for backward by one decoder layer, per token: model-dtype tensors (normed inputs, q/k/v and the
    # attention output, the MLP's gate, up, act(gate) and product) and the RMSNorms' fp32 internals
    per_layer = (dtype * (2 * h + 2 * q + 2 * kv + 4 * inter) + 4 * 2 * (2 * h + q + kv)) * SAVED_TENSORS_SCALE
    rollout_batch = max(shape.rollout_sequences, shape.eval_sequences)
    kv_bytes = model.kv_bytes_per_token(dtype)
    vllm_share = shape.gpu_memory_utilization * shape.gpu_memory_gb * GB if shape.engine == "vllm" else 0.0
    vllm_weights = model.params * dtype + lora * dtype
    capacity = (shape.gpu_memory_gb * USABLE if shape.on_gpu else shape.cpu_memory_gb) * GB
    plan = MemoryPlan(
        shape=shape,
        model=model,
        lora_params=lora,
        image_tokens=image_tokens,
        sequence_tokens=sequence,
        base_params=model.params * dtype / (shape.world if sharded else 1),
        fsdp_gather=2 * model.largest_block * dtype if sharded else 0.0,
        lora_state=lora * 16 / (shape.world if sharded else 1),
        layer_inputs=model.layers * tokens * h * dtype,
        layer_saved=tokens * per_layer,
        activations_full=model.layers * tokens * per_layer,
        logits=LOGIT_COPIES * scored * model.vocab * dtype,
        rollout_kv=rollout_batch * sequence * kv_bytes if shape.engine == "hf" else 0.0,
        rollout_prefill=rollout_batch * sequence * ((2 * h + 5 * inter) * dtype + model.heads * sequence * PREFILL_SCORE_BYTES)
        if shape.engine == "hf"
        else 0.0,
        vllm_share=vllm_share,
        vllm_weights=vllm_weights if shape.engine == "vllm" else 0.0,
        vllm_kv=vllm_share - vllm_weights - VLLM_OVERHEAD_GB * GB if shape.engine == "vllm" else 0.0,
        must_sleep=False,
        capacity=capacity,
    )
    if shape.engine == "vllm":
        plan.must_sleep = plan.resident + plan.activations_and_logits + plan.vllm_share > capacity
    return plan


def cluster_options() -> dict[str, dict]:
    """The ``cluster`` group's options with a GPU: name -> its values."""
    options = {p.stem: OmegaConf.to_container(OmegaConf.load(p)) for p in sorted(CLUSTER_DIR.glob("*.yaml"))}
    return {name: values for name, values in options.items() if values.get("gpus_per_node", 0) > 0}


def without_checkpointing(plan: MemoryPlan) -> MemoryPlan | None:
    """The same shape on a GPU with activation checkpointing off, where that fits too: it skips the recompute of
    every decoder layer (at 8B on an H100 the update ran 1.4-1.5x faster so, BENCHMARKS.md); else None."""
    if not (plan.fits and plan.shape.checkpointing and plan.shape.on_gpu):
        return None
    trial = estimate(dataclasses.replace(plan.shape, checkpointing=False))
    return trial if trial.fits else None


def suggestions(plan: MemoryPlan) -> list[str]:
    """Changes that would make a shape that does not fit fit, each with the peak it would have; the
    first that works of each kind: checkpointing, micro-batch, history window, engine sleep, more nodes,
    another instance type."""
    shape = plan.shape
    found = []

    def fits(**changes) -> MemoryPlan | None:
        trial = estimate(dataclasses.replace(shape, **changes))
        return trial if trial.fits else None

    if not shape.checkpointing and (trial := fits(checkpointing=True)):
        found.append(f"model.gradient_checkpointing=true (peak {trial.peak / GB:.1f} GB)")
    for micro in range(shape.micro_batch - 1, 0, -1):
        if trial := fits(micro_batch=micro):
            found.append(f"algorithm.micro_batch_size={micro} (peak {trial.peak / GB:.1f} GB)")
            break
    for turns in range(shape.context_turns - 1, shape.window_extra, -1):  # history_window >= 1
        if trial := fits(context_turns=turns):
            found.append(f"env.history_window={turns - shape.window_extra} (peak {trial.peak / GB:.1f} GB)")
            break
    if shape.engine == "vllm" and shape.sleep_level == "0" and (trial := fits(sleep_level="1")):
        found.append(f"rollout.engine.sleep_level=1 (peak {trial.peak / GB:.1f} GB)")
    if shape.on_gpu:
        for nodes in range(shape.nodes + 1, 33):
            if trial := fits(nodes=nodes):
                found.append(f"cluster.nodes={nodes} ({nodes * shape.gpus_per_node} GPUs; peak {trial.peak / GB:.1f} GB)")
                break
    others = []
    for name, values in cluster_options().items():
        if name == shape.cluster:
            continue
        keys = ("nodes", "gpus_per_node", "gpu_memory_gb", "cpu_memory_gb")
        if fits(cluster=name, **{key: values[key] for key in keys}):
            others.append(f"cluster={name}")
    if others:
        found.append(" or ".join(others))
    return found
