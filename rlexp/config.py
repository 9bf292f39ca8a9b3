"""Typed schemas for every config group, registered in Hydra's ConfigStore.

The YAML files in ``conf/`` fill these in. Because the root config is this structured schema, a
misspelt key or a value of the wrong type fails at composition, naming the key; enum-typed fields
list their valid values. Units (see DESIGN.md): ``train_batch_size`` and ``policy_mini_batch_size``
count mazes, ``micro_batch_size`` counts trajectories per GPU per forward.
"""

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


class Task(str, Enum):
    train = "train"
    eval = "eval"
    plan = "plan"
    report = "report"
    export = "export"
    manifest = "manifest"


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class ActionFormat(str, Enum):
    visgym_tuple = "visgym_tuple"
    action_tag = "action_tag"


class PromptStyle(str, Enum):
    visgym = "visgym"
    skyrl_instruct = "skyrl_instruct"


class LossReduction(str, Enum):
    token_mean = "token_mean"
    sequence_mean = "sequence_mean"
    seq_mean_token_sum_norm = "seq_mean_token_sum_norm"


class AlgorithmName(str, Enum):
    grpo = "grpo"
    sft = "sft"


class Launcher(str, Enum):
    local = "local"
    torchrun = "torchrun"
    ray = "ray"


class EvalPolicy(str, Enum):
    """What ``task=eval`` runs: the model (optionally with ``checkpoint``), or a scripted baseline."""

    model = "model"
    random = "random"
    expert = "expert"
    noisy_expert = "noisy_expert"


#: attention kernels transformers accepts by name.
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
#: W&B run modes (null: ``$WANDB_MODE``, else by credentials).
WANDB_MODES = ("online", "offline", "disabled")
#: ``cluster.device``: the trainer's torch device.
DEVICE_PATTERN = r"cpu|cuda(:[0-9]+)?"


def ranged(default: Any, interval: str | None = None, *, choices: tuple[str, ...] | None = None, pattern: str | None = None):
    """A field whose valid values live beside it: ``interval`` as in maths (``"(0, 1]"``, ``"[1, inf)"``),
    or ``choices`` / a regex ``pattern`` for strings. ``validate`` checks every one (null passes)."""
    metadata = {key: value for key, value in (("range", interval), ("choices", choices), ("pattern", pattern)) if value}
    return field(default=default, metadata=metadata)


@dataclass
class LoraConfig:
    rank: int = ranged(32, "[1, 1024]")
    #: the update is scaled by alpha / rank.
    alpha: int = ranged(32, "[1, 4096]")
    #: must be 0 with GRPO (old log-probs are scored without dropout); SFT may use it.
    dropout: float = ranged(0.0, "[0, 1)")
    #: "all-linear-language" = every linear layer of the language model (vision tower frozen), or a list of names.
    target_modules: Any = "all-linear-language"


@dataclass
class ModelConfig:
    #: a local directory or hub id; "tiny" builds the toy Qwen3-VL locally (no download).
    path: str = MISSING
    dtype: DType = DType.float32
    attn_implementation: str = ranged("sdpa", choices=ATTN_IMPLEMENTATIONS)
    gradient_checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


class ImageFormat(str, Enum):
    auto = "auto"
    jpeg = "jpeg"
    png = "png"


class HistoryStyle(str, Enum):
    auto = "auto"
    visgym = "visgym"
    last_k = "last_k"


@dataclass
class EnvConfig:
    #: maze side in cells, outer wall ring included (odd); must match the pinned set's mazes.
    size: int = ranged(9, "[5, 31]")
    #: step limit of one episode; ``stop`` counts as a step. At least ``min_expert_steps(size)``.
    max_steps: int = ranged(20, "[1, 1000]")
    #: pixels per cell. At least 8 (the agent's circle stays a visible blob and a 5x5 maze still spans
    #: the vision tower's 32 px merged patch); at most 64 (an 11x11 image is then 704 px, 484 vision
    #: tokens per turn, 4x the seed's 25 px; beyond that only memory grows).
    cell_px: int = ranged(25, "[8, 64]")
    #: images kept in the model's context: null = the whole history, k = the last k turns.
    history_window: Optional[int] = ranged(None, "[1, 1000]")
    action_format: ActionFormat = ActionFormat.visgym_tuple
    prompt: PromptStyle = PromptStyle.visgym
    terminate_on_goal: bool = False
    #: training mazes (GRPO and SFT) are only those whose expert takes at least this many steps (stop included),
    #: e.g. 17 = only the 16-move mazes of maze_easy; null = every maze solvable within the turn limit.
    #: Evaluation always plays the pinned set.
    train_min_expert_length: Optional[int] = ranged(None, "[1, 1000]")
    #: share of the reward given for well-formed actions; 0 = the true task reward alone.
    format_reward: float = ranged(0.0, "[0, 1)")
    #: which pinned 64-maze set evaluation reads (``rlexp.envs.PINNED_SETS``).
    pinned_set: str = "maze_easy"
    #: frames the model sees: jpeg (VisGym's: quality 75, 4:2:0) | png (exact pixels); auto = jpeg iff prompt=visgym.
    image_format: ImageFormat = ImageFormat.auto
    #: history_window=k keeps k earlier turns + the current one (visgym) or the last k (last_k); auto = visgym iff prompt=visgym.
    history_style: HistoryStyle = HistoryStyle.auto
    #: ask for <think>…</think><answer>…</answer>, read the first answer (VisGym); null = on iff prompt=visgym.
    elicit_verbalization: Optional[bool] = None


@dataclass
class OptimizerConfig:
    """``hydra.utils.instantiate``-d as a partial, then called with the trainable params and ``lr``."""

    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    weight_decay: float = ranged(0.0, "[0, 1]")


@dataclass
class LrSchedulerConfig:
    """Called with the optimizer and ``warmup_steps=algorithm.lr_warmup_steps``."""

    _target_: str = "rlexp.training.schedules.warmup_constant"
    _partial_: bool = True


#: ``algorithm.old_logprobs``: where GRPO's old log-probs come from.
OLD_LOGPROB_SOURCES = ("trainer", "engine")


@dataclass
class AlgorithmConfig:
    name: AlgorithmName = AlgorithmName.grpo
    #: group size G: trajectories per maze (GRPO; SFT ignores it and plays one expert trajectory per maze).
    n_samples_per_prompt: int = ranged(8, "[1, 1024]")
    #: mazes per training step.
    train_batch_size: int = ranged(32, "[1, inf)")
    #: mazes per optimizer step; divides train_batch_size.
    policy_mini_batch_size: int = ranged(16, "[1, inf)")
    #: trajectories (training sequences) per forward pass.
    micro_batch_size: int = ranged(4, "[1, inf)")
    lr: float = ranged(3e-5, "(0, 1]")
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LrSchedulerConfig = field(default_factory=LrSchedulerConfig)
    lr_warmup_steps: int = ranged(0, "[0, inf)")
    epochs_per_step: int = ranged(1, "[1, 100]")
    #: the PPO ratio's old log-probs: ``trainer`` scores the samples before the update (a forward pass over
    #: all of them, skipped when the step is one optimizer step with no reference); ``engine`` takes the
    #: log-probs the engine recorded while sampling, with no such pass. Sound where the engine computes
    #: them as the trainer does (rollout=turn_batch: the same forward); ``rollout/logprob_gap`` is then
    #: measured on the first mini-batch, before any optimizer step.
    old_logprobs: str = ranged("trainer", choices=OLD_LOGPROB_SOURCES)
    #: the ratio is clipped to [1 - eps_low, 1 + eps_high].
    eps_low: float = ranged(0.2, "(0, 1)")
    eps_high: float = ranged(0.2, "(0, 10]")
    loss_reduction: LossReduction = LossReduction.token_mean
    norm_by_std: bool = True
    #: drop groups whose rewards are all equal (they carry no GRPO signal) from the update.
    drop_zero_variance_groups: bool = False
    #: weight of the k3 KL to the base model, as a loss term; 0 = no reference pass.
    kl_coef: float = ranged(0.0, "[0, 100]")
    max_grad_norm: float = ranged(1.0, "(0, inf)")


#: the engines rlexp ships and the options each reads; an option left null is not passed to the engine
#: (``rlexp.rollout.engine.build_engine``), and one set for an engine that does not read it is refused.
HF_ENGINE, VLLM_ENGINE = "rlexp.rollout.hf_engine.HFEngine", "rlexp.rollout.vllm_engine.VLLMEngine"
TURN_BATCH_ENGINE = "rlexp.rollout.turn_batch.TurnBatchEngine"
ENGINE_OPTIONS = {
    HF_ENGINE: ("static_cache",),
    TURN_BATCH_ENGINE: ("static_cache", "autocast"),  # its generate (evaluation) is HFEngine's
    VLLM_ENGINE: ("gpu_memory_utilization", "sleep_level", "max_model_len", "max_images_per_prompt", "seed", "enforce_eager", "dtype"),
}
#: ``rollout.engine.sleep_level``: 0 never sleeps, 1 moves the weights to host memory; auto measures the
#: first update and picks 0 or 1. vLLM's level 2 (drop the weights, read them again on waking) is not
#: offered: with LoRA enabled its ``reload_weights`` fails (vllm-project/vllm#39934, still open in 0.22.1).
SLEEP_LEVELS = ("auto", "0", "1")
#: ``rollout.engine.autocast`` (turn_batch): the dtype its play and scoring forward runs in under torch.autocast.
AUTOCAST_DTYPES = ("bfloat16", "float16")
#: ``rollout.engine.dtype`` (vllm): auto serves in the policy's dtype, but a float32 policy with LoRA in bfloat16.
ENGINE_DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass
class EngineConfig:
    """The inference engine (``rollout=hf`` or ``rollout=vllm``), built with ``model`` and ``processor`` and the
    options below that its option sets (the others stay null)."""

    _target_: str = HF_ENGINE
    #: hf: transformers' static KV cache (measured 2.6x faster for the 8B model on an H200).
    static_cache: Optional[bool] = None
    #: turn_batch: play and score under torch.autocast in this dtype (bfloat16 | float16), master weights and
    #: evaluation as the policy's dtype; null: no autocast.
    autocast: Optional[str] = ranged(None, choices=AUTOCAST_DTYPES)
    #: vllm: the share of the GPU's memory vLLM may take (weights, activations, KV cache).
    gpu_memory_utilization: Optional[float] = ranged(None, "(0, 1]")
    #: vllm: how the engine frees memory for the trainer's update: auto | 0 | 1 (see SLEEP_LEVELS).
    sleep_level: Optional[str] = ranged(None, choices=SLEEP_LEVELS)
    #: vllm: the longest context (prompt + reply) in tokens; null = the model's own limit.
    max_model_len: Optional[int] = ranged(None, "[256, 1048576]")
    #: vllm: images one prompt may carry (vLLM sizes its memory profile by it); at least the frames in a context.
    max_images_per_prompt: Optional[int] = ranged(None, "[1, 1000]")
    #: vllm: its sampling seed.
    seed: Optional[int] = ranged(None, "[0, 2147483647]")
    #: vllm: no torch.compile or CUDA graphs: a start of seconds instead of minutes, slower decoding.
    enforce_eager: Optional[bool] = None
    #: vllm: the dtype it serves in: auto | bfloat16 | float16 | float32 (see ENGINE_DTYPES).
    dtype: Optional[str] = ranged(None, choices=ENGINE_DTYPES)


@dataclass
class RolloutConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    #: sampling temperature of training rollouts (greedy evaluation is ``eval.greedy``).
    temperature: float = ranged(0.7, "(0, 10]")
    top_p: float = ranged(1.0, "(0, 1]")
    #: model turns per episode; ``stop`` counts as a turn. At most ``env.max_steps``.
    max_turns: int = ranged(15, "[1, 1000]")
    max_new_tokens_per_turn: int = ranged(1024, "[1, 32768]")


@dataclass
class RayConfig:
    """``cluster.launcher=ray``: the run goes to a Ray cluster through Ray's Job Submission API, and its
    ranks run there as Ray actors (``rlexp.training.ray_workers``)."""

    #: the cluster, passed to Ray as is: http://<head>:8265, ray://<head>:10001, or a provider's scheme
    #: (sagemaker_ray://<cluster>/<namespace>); null: $RAY_ADDRESS.
    address: Optional[str] = None
    #: names of the submitting shell's environment variables the job gets; nothing else travels (credentials
    #: included: name WANDB_API_KEY here to send it).
    env_vars: list[str] = field(default_factory=list)
    #: a single run: stream the job's logs until it ends, and exit with its outcome; false: print the job id.
    follow: bool = True
    #: a multirun: at most this many of its jobs pending or running at once (it waits for a slot).
    max_concurrent_jobs: int = ranged(4, "[1, inf)")
    #: training processes; null: one per GPU (nodes x gpus_per_node), or 1 on a CPU cluster.
    workers: Optional[int] = ranged(None, "[1, inf)")
    #: CPUs in each worker's placement-group bundle (beside its GPU).
    cpus_per_worker: int = ranged(1, "[1, inf)")


@dataclass
class KubeRayConfig:
    """``task=manifest``: the KubeRay ``RayCluster`` (and ``RayJob``) written for this cluster."""

    #: the image built from the Dockerfile, pushed where the cluster pulls from.
    image: str = "rlexp:latest"
    namespace: str = "default"
    #: the ReadWriteMany claim mounted at ``cluster.shared_storage`` on every pod (e.g. an FSx for Lustre PVC).
    storage_claim: str = "fsx-claim"
    #: written as a PersistentVolumeClaim of this size with ``storage_class`` (null: the claim exists already).
    storage_gb: Optional[int] = ranged(None, "[1, inf)")
    storage_class: Optional[str] = None
    #: CPUs the head pod asks for (the head runs Ray's GCS and dashboard and the job's driver).
    head_cpus: int = ranged(8, "[1, inf)")
    head_memory_gb: int = ranged(32, "[1, inf)")
    #: the share of a node's CPUs and memory its pod asks for (the rest is the node's own).
    pod_share: float = ranged(0.9, "(0, 1]")


@dataclass
class ClusterConfig:
    """The machines of a run. ``task=plan`` reads all of it. One node runs one process
    (``launcher=local``) or one per GPU with FSDP2 (``launcher=torchrun``); ``launcher=ray`` submits the
    run to a Ray cluster of any number of nodes, where the same per-rank code runs in Ray actors."""

    nodes: int = ranged(1, "[1, inf)")
    #: 0 with ``device=cpu``; with ``device=cuda``, more than 1 runs one process per GPU (torchrun or ray).
    gpus_per_node: int = ranged(0, "[0, inf)")
    #: memory of each GPU (GB); the run refuses to start on a GPU with less. 0 = no GPU, or with ``device=cuda``:
    #: whatever this machine's GPU has (nothing checked; the memory plan reads it at start).
    gpu_memory_gb: float = ranged(0.0, "[0, inf)")
    #: host memory (GB); the run refuses to start on a machine with less.
    cpu_memory_gb: float = ranged(0.0, "[0, inf)")
    #: vCPUs of each worker node (``task=manifest`` sizes the worker pods from it).
    cpus_per_node: Optional[int] = ranged(None, "[1, inf)")
    #: the worker nodes' instance type (the worker pods' node selector), e.g. ml.g7e.12xlarge.
    instance_type: Optional[str] = None
    #: the Ray head's instance type (launcher=ray), e.g. ml.r5d.16xlarge: a CPU node, no training on it.
    head: Optional[str] = None
    #: storage every node sees at this path (launcher=ray): run dirs, adapters and checkpoints live under it.
    shared_storage: Optional[str] = None
    launcher: Launcher = Launcher.local
    #: USD per node-hour: ``task=plan`` and ``task=report`` give GPU-hours and cost with it.
    price_per_hour: Optional[float] = ranged(None, "[0, inf)")
    #: torch device of the trainer and the in-process engine: cpu, cuda or cuda:N.
    device: str = ranged("cpu", pattern=DEVICE_PATTERN)
    ray: RayConfig = field(default_factory=RayConfig)
    kuberay: KubeRayConfig = field(default_factory=KubeRayConfig)


@dataclass
class EvalConfig:
    #: greedy (temperature 0) = one reproducible number per checkpoint.
    greedy: bool = True
    #: with greedy=false: samples per maze at the rollout temperature (mean success and pass@k).
    samples_per_maze: int = ranged(1, "[1, 1024]")
    #: evaluate the first n pinned mazes (64 = the whole pinned set; fewer only for quick checks).
    num_mazes: int = ranged(64, "[1, 64]")
    #: for the scripted ``noisy_expert`` policy: probability of the expert's move.
    expert_prob: float = ranged(0.5, "[0, 1]")
    policy: EvalPolicy = EvalPolicy.model


@dataclass
class PlanConfig:
    """``task=plan`` (and the fit check training runs before loading anything)."""

    #: generated tokens per turn the memory plan assumes; null = rollout.max_new_tokens_per_turn (the worst case).
    reply_tokens: Optional[int] = ranged(None, "[1, 32768]")
    #: seconds per training step (measured or stated), for GPU-hours and cost per step and per run.
    step_time_s: Optional[float] = ranged(None, "(0, inf)")


@dataclass
class ReportConfig:
    """``task=report``: which runs to compare."""

    #: MLflow experiment; null = this config's ``name``.
    experiment: Optional[str] = None
    #: only the runs of this multirun (its ``sweep`` tag, e.g. multirun-2026-12-03_10-00-00); null = all.
    sweep: Optional[str] = None
    #: null = ``MLFLOW_TRACKING_URI`` or the local store ``outputs/mlflow.db``.
    tracking_uri: Optional[str] = None


@dataclass
class MlflowTrackerConfig:
    """Options of ``rlexp.tracking.mlflow_tracker.MlflowTracker`` (see its docstring)."""

    _target_: str = "rlexp.tracking.mlflow_tracker.MlflowTracker"
    #: null: ``$MLFLOW_TRACKING_URI``, else sqlite:///<abs outputs/>/mlflow.db.
    tracking_uri: Optional[str] = None
    #: null: the config's ``name``.
    experiment_name: Optional[str] = None
    #: for an experiment this creates; null: the server's, or mlartifacts/ beside a sqlite db.
    artifact_location: Optional[str] = None
    #: extra run tags.
    tags: dict[str, str] = field(default_factory=dict)
    #: finish() waits at most this long for an unreachable server.
    flush_timeout_s: float = ranged(30.0, "[0, 3600]")
    #: per request; no MLflow-level retries (the journal retries later).
    http_timeout_s: int = ranged(5, "[1, 600]")
    #: first wait after a failure; doubles up to 60 s.
    retry_interval_s: float = ranged(5.0, "(0, 600]")


@dataclass
class WandbTrackerConfig:
    """Options of ``rlexp.tracking.wandb_tracker.WandbTracker`` (see its docstring)."""

    _target_: str = "rlexp.tracking.wandb_tracker.WandbTracker"
    project: str = "rlexp"
    #: null: your default entity.
    entity: Optional[str] = None
    #: null: the multirun sweep, else none.
    group: Optional[str] = None
    #: extra tags; the chosen config options and git commit are added as key=value.
    tags: list[str] = field(default_factory=list)
    #: online | offline | disabled; null: ``$WANDB_MODE``, else by credentials.
    mode: Optional[str] = ranged(None, choices=WANDB_MODES)


@dataclass
class LoggerConfig:
    """The trackers the ``logger`` group selects (``logger=[mlflow,wandb]``); an unselected one is null."""

    mlflow: Optional[MlflowTrackerConfig] = None
    wandb: Optional[WandbTrackerConfig] = None


@dataclass
class Config:
    task: Task = Task.train
    #: the experiment's name; the run dir is ``outputs/<name>/<run_name>``.
    name: str = "default"
    seed: int = ranged(0, "[0, 2147483647]")
    #: the run dir's name (a timestamp unless given); rerunning with the same name resumes that run.
    run_name: str = MISSING
    #: "latest" (newest complete checkpoint of this run dir), "none" (refused where checkpoints exist),
    #: "overwrite" (discard this run dir's checkpoints), or an existing checkpoint path.
    resume: str = "latest"
    total_steps: int = ranged(2, "[1, inf)")
    eval_interval: int = ranged(10, "[1, inf)")
    ckpt_interval: int = ranged(20, "[1, inf)")
    keep_last_ckpts: int = ranged(3, "[1, inf)")
    #: on SIGTERM/SIGINT: seconds to write a checkpoint and close the trackers before exiting 143/130 regardless
    #: (set it below the pod's terminationGracePeriodSeconds). Beside ``ckpt_interval``, not under
    #: ``checkpoint``, which is the path ``task=eval`` reads.
    preempt_grace_s: float = ranged(60.0, "(0, 3600]")
    #: for task=eval and task=export: a checkpoint dir (or adapter dir) to evaluate or export.
    checkpoint: Optional[str] = None
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    #: trackers, each built from its ``_target_``; the ``logger`` group fills it.
    logger: LoggerConfig = field(default_factory=LoggerConfig)


def register_configs() -> None:
    ConfigStore.instance().store(name="config_schema", node=Config)


def field_type(tp: Any) -> Any:
    """``Optional[X]`` -> ``X``; anything else as is."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp


def schema_node(path: str) -> Any:
    """The dataclass at a dotted path of the schema (``""`` = the root), or None where ``path`` is not one."""
    node: Any = Config
    for part in filter(None, path.split(".")):
        fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        if part not in fields:
            return None
        node = field_type(fields[part].type)
    return node if dataclasses.is_dataclass(node) else None


def schema_keys(path: str) -> list[str] | None:
    """The valid keys under a dotted path of the schema, or None if ``path`` is not a dataclass node."""
    node = schema_node(path)
    return [f.name for f in dataclasses.fields(node)] if node is not None else None


def schema_leaves(node: Any = Config, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """Every leaf key of the schema (``algorithm.optimizer.weight_decay``) with its field."""
    leaves = []
    for f in dataclasses.fields(node):
        sub = field_type(f.type)
        if dataclasses.is_dataclass(sub):
            leaves += schema_leaves(sub, f"{prefix}{f.name}.")
        else:
            leaves.append((f"{prefix}{f.name}", f))
    return leaves


class ConfigError(ValueError):
    """A setting, or a combination of settings, that cannot run; the message is one line naming the keys."""


def in_interval(value: float, interval: str) -> bool:
    """Whether ``value`` lies in ``interval``, written as in maths: ``"(0, 1]"``, ``"[1, inf)"``."""
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    above = value > low or (interval[0] == "[" and value == low)
    below = value < high or (interval[-1] == "]" and value == high)
    return above and below


def _show(value: Any) -> str:
    """A value as it is written on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    return value.value if isinstance(value, Enum) else "null" if value is None else str(value)


def _check_fields(node: Any, schema: Any, prefix: str = "") -> None:
    """Each field's own range, choices or pattern (see ``ranged``), recursively."""
    for f in dataclasses.fields(schema):
        sub = field_type(f.type)
        if not f.metadata and not dataclasses.is_dataclass(sub):
            continue  # nothing to check (and ``name`` resolves only inside a Hydra app)
        key, value = f"{prefix}{f.name}", node[f.name]
        if dataclasses.is_dataclass(sub):
            if value is not None:
                _check_fields(value, sub, f"{key}.")
            continue
        if value is None:
            continue
        if "range" in f.metadata and not in_interval(value, f.metadata["range"]):
            raise ConfigError(f"{key}={_show(value)} is out of range; valid: {f.metadata['range']}")
        if "choices" in f.metadata and value not in f.metadata["choices"]:
            raise ConfigError(f"{key}={value} is not a valid choice; valid: {', '.join(f.metadata['choices'])}")
        if "pattern" in f.metadata and not re.fullmatch(f.metadata["pattern"], str(value)):
            raise ConfigError(f"{key}={value} is not valid; expected {f.metadata['pattern'].replace('|', ' | ')}")


#: tasks that load a model and run on ``cluster``.
COMPUTE_TASKS = ("train", "eval")
#: algorithm keys only GRPO reads, with the value SFT needs (an SFT run with another value would ignore
#: it). ``n_samples_per_prompt`` is not among them: experiments size it for GRPO, and SFT plays one
#: expert trajectory per maze whatever it says.
GRPO_ONLY = {
    "eps_low": 0.2,
    "eps_high": 0.2,
    "norm_by_std": False,
    "drop_zero_variance_groups": False,
    "kl_coef": 0.0,
    "loss_reduction": LossReduction.token_mean,
}
RESUME_MODES = ("latest", "none", "overwrite")
#: tasks that read ``checkpoint``.
CHECKPOINT_TASKS = ("eval", "export")


def validate(cfg: Any) -> None:
    """Refuse, with one line naming the key, its value and what is valid, any setting that cannot run or
    that nothing reads yet. Run before any model loads; reads only the config (``rlexp.cli.check_machine``
    checks the machine)."""
    _check_fields(cfg, Config)
    if cfg.task.value in COMPUTE_TASKS:
        _check_cluster(cfg.cluster)
        if cfg.task.value == "eval" and cfg.cluster.launcher == Launcher.ray:
            raise ConfigError(
                "cluster.launcher=ray submits training; task=eval runs where it is started: pick a local cluster "
                "option (cluster=gpu_1x, or local_cpu) and checkpoint=<the run dir's checkpoint on shared storage>"
            )
    _check_strings(cfg)
    _check_env(cfg.env)
    _check_algorithm(cfg)
    _check_run(cfg)
    _check_targets(cfg)
    _check_engine(cfg)


def _check_cluster(cluster: Any) -> None:
    on_ray = cluster.launcher == Launcher.ray
    if cluster.nodes > 1 and not on_ray:
        raise ConfigError(
            f"cluster.nodes={cluster.nodes} needs cluster.launcher=ray (several nodes run as one Ray cluster); "
            "torchrun runs FSDP2 over the GPUs of one node"
        )
    if cluster.nodes > 1 and cluster.shared_storage is None:
        raise ConfigError(
            f"cluster.nodes={cluster.nodes}: set cluster.shared_storage to a path every node mounts (run dirs, "
            "adapters and checkpoints live there)"
        )
    for key in ("head", "shared_storage"):
        if cluster[key] is not None and not on_ray:
            raise ConfigError(
                f"cluster.{key}={cluster[key]} is for runs on a Ray cluster (cluster.launcher=ray); leave it null "
                f"with launcher={cluster.launcher.value}"
            )
    if cluster.ray.workers is not None and not on_ray:
        raise ConfigError(f"cluster.ray.workers={cluster.ray.workers} is read with cluster.launcher=ray only; leave it null")
    if on_ray and cluster.gpus_per_node and cluster.ray.workers not in (None, cluster.nodes * cluster.gpus_per_node):
        raise ConfigError(
            f"cluster.ray.workers={cluster.ray.workers}: on GPUs there is one worker per GPU "
            f"(nodes x gpus_per_node = {cluster.nodes * cluster.gpus_per_node}); leave it null"
        )
    on_gpu = str(cluster.device).startswith("cuda")
    if on_gpu != (cluster.gpus_per_node >= 1):
        raise ConfigError(
            f"cluster.device={cluster.device} with cluster.gpus_per_node={cluster.gpus_per_node}: "
            "use device=cpu with 0 GPUs, or device=cuda[:N] with 1 or more"
        )
    if cluster.gpus_per_node > 1 and (cluster.launcher == Launcher.local or cluster.device != "cuda"):
        raise ConfigError(
            f"cluster.gpus_per_node={cluster.gpus_per_node} needs cluster.launcher=torchrun (or ray) and "
            "cluster.device=cuda (one process per GPU, each on its own); or use gpus_per_node=1"
        )
    if cluster.launcher == Launcher.torchrun and not on_gpu:
        raise ConfigError("cluster.launcher=torchrun starts one process per GPU; with cluster.device=cpu use launcher=local")
    if not on_gpu and cluster.gpu_memory_gb:
        raise ConfigError(f"cluster.gpu_memory_gb={cluster.gpu_memory_gb} with cluster.device=cpu: no GPU to check; use 0")


def _check_strings(cfg: Any) -> None:
    for key in ("model.path", "run_name", "logger.wandb.project"):
        value = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
        if value is not None and not str(value).strip():
            raise ConfigError(f"{key} is empty; give a non-empty value")
    targets = cfg.model.lora.target_modules
    names = [targets] if isinstance(targets, str) else list(targets) if OmegaConf.is_list(targets) else None
    if not names or not all(isinstance(name, str) and name for name in names):
        raise ConfigError(
            f"model.lora.target_modules={targets} must be 'all-linear-language' or a non-empty list of module names"
        )


def _check_env(env: Any) -> None:
    from rlexp.envs.maze import min_expert_steps
    from rlexp.envs.pinned import PINNED_SETS

    if env.size % 2 == 0:
        raise ConfigError(f"env.size={env.size} must be odd (it includes the wall ring); valid: 5, 7, 9, 11, ...")
    if env.pinned_set not in PINNED_SETS:
        raise ConfigError(f"env.pinned_set={env.pinned_set} is not a pinned set; valid: {', '.join(PINNED_SETS)}")
    pinned_size = PINNED_SETS[env.pinned_set]["size"]
    if env.size != pinned_size:
        raise ConfigError(
            f"env.size={env.size} does not match env.pinned_set={env.pinned_set} ({pinned_size}x{pinned_size} mazes); "
            f"use env.size={pinned_size} or another env option"
        )
    fewest = min_expert_steps(env.size)
    if env.max_steps < fewest:
        raise ConfigError(
            f"env.max_steps={env.max_steps} is below {fewest}, the fewest steps any {env.size}x{env.size} maze "
            f"needs (moves + stop); valid: [{fewest}, 1000]"
        )


def _check_algorithm(cfg: Any) -> None:
    algo, rollout = cfg.algorithm, cfg.rollout
    if algo.train_batch_size % algo.policy_mini_batch_size:
        raise ConfigError(
            f"algorithm.policy_mini_batch_size={algo.policy_mini_batch_size} must divide "
            f"algorithm.train_batch_size={algo.train_batch_size} (both count mazes)"
        )
    if rollout.max_turns > cfg.env.max_steps:
        raise ConfigError(
            f"rollout.max_turns={rollout.max_turns} exceeds env.max_steps={cfg.env.max_steps}; "
            "an episode cannot take more turns than the env allows"
        )
    shortest_allowed = cfg.env.train_min_expert_length
    if shortest_allowed is not None and shortest_allowed > rollout.max_turns:  # the turn limit, checked ≤ env.max_steps above
        raise ConfigError(
            f"env.train_min_expert_length={shortest_allowed} exceeds the turn limit, rollout.max_turns={rollout.max_turns}; "
            "no training maze would fit"
        )
    if algo.name == AlgorithmName.sft:
        for key, needed in GRPO_ONLY.items():
            if algo[key] != needed:
                raise ConfigError(
                    f"algorithm.{key}={_show(algo[key])} is read by GRPO only; with algorithm.name=sft use {_show(needed)}"
                )
        return
    if algo.n_samples_per_prompt < 2:
        raise ConfigError(
            f"algorithm.n_samples_per_prompt={algo.n_samples_per_prompt} with algorithm.name=grpo: a group of one "
            "has zero advantage (r - mean = 0) and, with norm_by_std, no std; use a group size of at least 2"
        )
    if cfg.model.lora.dropout > 0:
        raise ConfigError(
            f"model.lora.dropout={cfg.model.lora.dropout} with algorithm.name=grpo: old log-probs are scored without "
            "dropout and new ones with it, which biases the clipped ratio; use 0 (SFT may use dropout)"
        )


def _check_run(cfg: Any) -> None:
    task = cfg.task.value
    if cfg.resume not in RESUME_MODES and not Path(cfg.resume).exists():
        raise ConfigError(
            f"resume={cfg.resume} is neither {', '.join(RESUME_MODES)} nor an existing checkpoint path"
        )
    if cfg.checkpoint is not None:
        if task not in CHECKPOINT_TASKS:
            raise ConfigError(
                f"checkpoint={cfg.checkpoint} is read by task=eval and task=export only; to continue training use resume=<path>"
            )
        if not Path(cfg.checkpoint).exists():
            raise ConfigError(f"checkpoint={cfg.checkpoint} does not exist")
    elif task == "export":
        raise ConfigError("task=export needs checkpoint=<run>/checkpoints/global_step_N (the LoRA checkpoint to merge)")
    if cfg.eval.greedy and cfg.eval.samples_per_maze != 1:
        raise ConfigError(
            f"eval.samples_per_maze={cfg.eval.samples_per_maze} is read only with eval.greedy=false (greedy eval plays "
            "each maze once)"
        )
    if task == "train" and cfg.eval.policy != EvalPolicy.model:
        raise ConfigError(f"eval.policy={cfg.eval.policy.value} is read by task=eval only; training evaluates the model")


def _check_targets(cfg: Any) -> None:
    """``_partial_`` nodes are called with more arguments later, so must stay partial; a ``_target_`` other
    than the schema's default must import (the default ones are tested; importing them here is slow)."""
    for key in ("algorithm.optimizer", "algorithm.lr_scheduler"):
        if not OmegaConf.select(cfg, f"{key}._partial_"):
            raise ConfigError(f"{key}._partial_=false: it is called with its arguments later; use true")
    nodes = {
        "algorithm.optimizer": OptimizerConfig,
        "algorithm.lr_scheduler": LrSchedulerConfig,
        "rollout.engine": EngineConfig,
        "logger.mlflow": MlflowTrackerConfig,
        "logger.wandb": WandbTrackerConfig,
    }
    for key, schema in nodes.items():
        target = OmegaConf.select(cfg, f"{key}._target_")
        if target is None or target == schema._target_:
            continue
        from hydra.utils import _locate

        try:
            _locate(target)
        except Exception:  # ImportError, with a multi-line message
            raise ConfigError(f"{key}._target_={target} cannot be imported (no such module or attribute)") from None


def check_turn_batch_env(env_cfg: Any) -> None:
    """``rollout=turn_batch`` shows one exact-pixel image a turn and reads one action token a reply."""
    from rlexp.envs.view import ModelView

    view = ModelView.from_config(env_cfg)
    if env_cfg.history_window != 1:
        raise ConfigError(f"rollout=turn_batch plays one-image turns: needs env.history_window=1, got {env_cfg.history_window}")
    if view.image_format != "png":
        raise ConfigError(f"rollout=turn_batch draws exact-pixel frames: needs env.image_format=png, got {view.image_format}")
    if view.elicit_verbalization:
        raise ConfigError("rollout=turn_batch replies with one action token: needs env.elicit_verbalization=false")


def _check_turn_batch(cfg: Any) -> None:
    """``rollout=turn_batch`` plays one-image turns in one process, for GRPO."""
    check_turn_batch_env(cfg.env)
    if cfg.algorithm.name.value == "sft":
        raise ConfigError("rollout=turn_batch plays GRPO's episodes; algorithm=sft learns from token sequences: use rollout=hf")
    cluster = cfg.cluster
    if cluster.launcher == Launcher.ray or cluster.nodes * cluster.gpus_per_node > 1:
        raise ConfigError(
            "rollout=turn_batch runs in one process (no FSDP2): use cluster=gpu_1x or local_cpu, or rollout=hf to shard"
        )


def _check_engine(cfg: Any) -> None:
    """Each engine gets only its own options; vLLM runs on the first visible GPU, with LoRA ranks it can serve."""
    engine = cfg.rollout.engine
    target = engine._target_
    if target in ENGINE_OPTIONS:
        for f in dataclasses.fields(EngineConfig):
            if f.name != "_target_" and engine[f.name] is not None and f.name not in ENGINE_OPTIONS[target]:
                raise ConfigError(
                    f"rollout.engine.{f.name}={_show(engine[f.name])} is not read by {target.rpartition('.')[2]} "
                    f"(rollout.engine._target_); leave it null"
                )
    if target == TURN_BATCH_ENGINE:
        _check_turn_batch(cfg)
    if target != VLLM_ENGINE:
        return
    if cfg.task.value in COMPUTE_TASKS and cfg.cluster.device not in ("cuda", "cuda:0"):
        raise ConfigError(
            f"rollout=vllm runs on the first visible GPU but cluster.device={cfg.cluster.device}; use cluster=gpu_1x "
            "(pick the GPU with CUDA_VISIBLE_DEVICES)"
        )
    if cfg.model.lora.rank > 512:
        raise ConfigError(f"model.lora.rank={cfg.model.lora.rank} with rollout=vllm: vLLM serves LoRA ranks up to 512")
