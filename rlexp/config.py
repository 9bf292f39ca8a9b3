"""Typed schemas for every config group, registered in Hydra's ConfigStore.

The YAML files in ``conf/`` fill these in. Because the root config is this structured schema, a
misspelt key or a value of the wrong type fails at composition, naming the key; enum-typed fields
list their valid values. Units (see DESIGN.md): ``train_batch_size`` and ``policy_mini_batch_size``
count mazes, ``micro_batch_size`` counts trajectories per GPU per forward.
"""

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class Task(str, Enum):
    train = "train"
    eval = "eval"
    plan = "plan"
    report = "report"
    export = "export"
    manifest = "manifest"
    submit = "submit"


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


@dataclass
class LoraConfig:
    rank: int = 32
    alpha: int = 32
    dropout: float = 0.0
    #: "all-linear-language" = every linear layer of the language model (vision tower frozen), or a list of names.
    target_modules: Any = "all-linear-language"


@dataclass
class ModelConfig:
    #: a local directory or hub id; "tiny" builds the toy Qwen3-VL locally (no download).
    path: str = MISSING
    dtype: DType = DType.float32
    attn_implementation: str = "sdpa"
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
    #: maze side in cells, outer wall ring included (odd).
    size: int = 9
    #: step limit of one episode; ``stop`` counts as a step.
    max_steps: int = 20
    cell_px: int = 25
    #: images kept in the model's context: null = the whole history, k = the last k turns.
    history_window: Optional[int] = None
    action_format: ActionFormat = ActionFormat.visgym_tuple
    prompt: PromptStyle = PromptStyle.visgym
    terminate_on_goal: bool = False
    #: share of the reward given for well-formed actions; 0 = the true task reward alone.
    format_reward: float = 0.0
    #: which pinned 64-maze set evaluation reads.
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
    weight_decay: float = 0.0


@dataclass
class LrSchedulerConfig:
    """Called with the optimizer and ``warmup_steps=algorithm.lr_warmup_steps``."""

    _target_: str = "rlexp.training.schedules.warmup_constant"
    _partial_: bool = True


@dataclass
class AlgorithmConfig:
    name: AlgorithmName = AlgorithmName.grpo
    #: group size G: trajectories per maze.
    n_samples_per_prompt: int = 8
    #: mazes per training step.
    train_batch_size: int = 32
    #: mazes per optimizer step.
    policy_mini_batch_size: int = 16
    #: trajectories (training sequences) per forward pass.
    micro_batch_size: int = 4
    lr: float = 3e-5
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LrSchedulerConfig = field(default_factory=LrSchedulerConfig)
    lr_warmup_steps: int = 0
    epochs_per_step: int = 1
    eps_low: float = 0.2
    eps_high: float = 0.2
    loss_reduction: LossReduction = LossReduction.token_mean
    norm_by_std: bool = True
    #: drop groups whose rewards are all equal (they carry no GRPO signal) from the update.
    drop_zero_variance_groups: bool = False
    kl_coef: float = 0.0
    max_grad_norm: float = 1.0


@dataclass
class EngineConfig:
    """The inference engine, ``instantiate``-d with ``model`` and ``processor``."""

    _target_: str = "rlexp.rollout.hf_engine.HFEngine"
    #: transformers' static KV cache (measured 2.6x faster for the 8B model on an H200).
    static_cache: bool = False


@dataclass
class RolloutConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    temperature: float = 0.7
    top_p: float = 1.0
    #: model turns per episode; ``stop`` counts as a turn. Capped by ``env.max_steps``.
    max_turns: int = 15
    max_new_tokens_per_turn: int = 1024
    gpu_memory_utilization: float = 0.45
    sleep_level: int = 1


@dataclass
class ClusterConfig:
    nodes: int = 1
    gpus_per_node: int = 0
    gpu_memory_gb: float = 0.0
    cpu_memory_gb: float = 24.0
    head: Optional[str] = None
    shared_storage: Optional[str] = None
    launcher: Launcher = Launcher.local
    #: USD per node-hour; null unless the user sets it.
    price_per_hour: Optional[float] = None
    #: torch device of the trainer and the in-process engine.
    device: str = "cpu"


@dataclass
class EvalConfig:
    #: greedy (temperature 0) = one reproducible number per checkpoint.
    greedy: bool = True
    #: with greedy=false: samples per maze at the rollout temperature (mean success and pass@k).
    samples_per_maze: int = 1
    #: evaluate the first n pinned mazes (64 = the whole pinned set; fewer only for quick checks).
    num_mazes: int = 64
    #: for the scripted ``noisy_expert`` policy: probability of the expert's move.
    expert_prob: float = 0.5
    policy: EvalPolicy = EvalPolicy.model


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
class Config:
    task: Task = Task.train
    #: the experiment's name; the run dir is ``outputs/<name>/<run_name>``.
    name: str = "default"
    seed: int = 0
    #: the run dir's name (a timestamp unless given); rerunning with the same name resumes that run.
    run_name: str = MISSING
    #: "latest" (newest complete checkpoint of this run dir), "none" (refused where checkpoints exist),
    #: "overwrite" (discard this run dir's checkpoints), or a checkpoint path.
    resume: str = "latest"
    total_steps: int = 2
    eval_interval: int = 10
    ckpt_interval: int = 20
    keep_last_ckpts: int = 3
    #: for task=eval: a checkpoint dir (or adapter dir) to evaluate.
    checkpoint: Optional[str] = None
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    #: trackers by name, each with a ``_target_``; the ``logger`` group fills it.
    logger: dict[str, Any] = field(default_factory=dict)


def register_configs() -> None:
    ConfigStore.instance().store(name="config_schema", node=Config)


def schema_keys(path: str) -> list[str] | None:
    """The valid keys under a dotted path of the schema, or None if ``path`` is not a dataclass node."""
    node: Any = Config
    for part in filter(None, path.split(".")):
        fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        if part not in fields:
            return None
        node = fields[part].type
    return [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else None


class ConfigError(ValueError):
    """A setting, or a combination of settings, that cannot run; the message names the keys."""


def validate(cfg: Any) -> None:
    """Cross-key checks the schema cannot express; run before any model loads."""
    algo, rollout, env = cfg.algorithm, cfg.rollout, cfg.env
    positive = {
        "algorithm.n_samples_per_prompt": algo.n_samples_per_prompt,
        "algorithm.train_batch_size": algo.train_batch_size,
        "algorithm.policy_mini_batch_size": algo.policy_mini_batch_size,
        "algorithm.micro_batch_size": algo.micro_batch_size,
        "algorithm.epochs_per_step": algo.epochs_per_step,
        "rollout.max_turns": rollout.max_turns,
        "rollout.max_new_tokens_per_turn": rollout.max_new_tokens_per_turn,
        "env.max_steps": env.max_steps,
        "env.cell_px": env.cell_px,
        "eval_interval": cfg.eval_interval,
        "ckpt_interval": cfg.ckpt_interval,
        "keep_last_ckpts": cfg.keep_last_ckpts,
        "eval.samples_per_maze": cfg.eval.samples_per_maze,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")
    if algo.train_batch_size % algo.policy_mini_batch_size:
        raise ConfigError(
            f"algorithm.policy_mini_batch_size={algo.policy_mini_batch_size} must divide "
            f"algorithm.train_batch_size={algo.train_batch_size} (both count mazes)"
        )
    if algo.name.value == "grpo" and algo.n_samples_per_prompt == 1 and algo.norm_by_std:
        raise ConfigError(
            "algorithm.n_samples_per_prompt=1 with algorithm.norm_by_std=true: a group of one has no std; "
            "use a group size of at least 2 or set algorithm.norm_by_std=false"
        )
    if env.size < 5 or env.size % 2 == 0:
        raise ConfigError(f"env.size={env.size} must be odd and at least 5 (it includes the wall ring)")
    if env.history_window is not None and env.history_window < 1:
        raise ConfigError(f"env.history_window={env.history_window} must be null (all images) or at least 1")
    if not 0.0 <= env.format_reward < 1.0:
        raise ConfigError(f"env.format_reward={env.format_reward} must be in [0, 1)")
    if not 1 <= cfg.eval.num_mazes <= 64:
        raise ConfigError(f"eval.num_mazes={cfg.eval.num_mazes} must be between 1 and 64 (the pinned set)")
    if rollout.max_turns > env.max_steps:
        raise ConfigError(
            f"rollout.max_turns={rollout.max_turns} exceeds env.max_steps={env.max_steps}; "
            "an episode cannot take more turns than the env allows"
        )
