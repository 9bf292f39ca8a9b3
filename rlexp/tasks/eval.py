"""``task=eval``: the pinned mazes, played by the model (base or a checkpoint) or a scripted baseline.

``checkpoint=<run>/checkpoints/global_step_N`` evaluates that checkpoint as it was trained: the
``model``, ``env`` and ``rollout`` settings come from its ``config.yaml``, and only the keys under them
that are given on the command line override those; the engine (``rollout.engine``) is this command's.
"""

import logging
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from rlexp.envs import ExpertPolicy, NoisyExpertPolicy, RandomPolicy, load_pinned
from rlexp.evaluation.evaluate import EvalResult, episode_rows, evaluate_model, record_eval, summarize
from rlexp.models import load_policy
from rlexp.rollout.conversation import Trajectory, TurnFormatter
from rlexp.rollout.driver import scripted_trajectories
from rlexp.rollout.engine import build_engine
from rlexp.runtime import run_dir_of
from rlexp.tracking import build_trackers

log = logging.getLogger(__name__)

#: ``eval.policy`` -> the scripted baseline, built from the config.
SCRIPTED = {
    "random": lambda cfg: RandomPolicy(seed=cfg.seed),
    "expert": lambda cfg: ExpertPolicy(),
    "noisy_expert": lambda cfg: NoisyExpertPolicy(cfg.eval.expert_prob, seed=cfg.seed),
}
#: sections of a checkpoint's config.yaml that describe the policy it holds and how it played.
CHECKPOINT_SECTIONS = ("model", "env", "rollout")


def evaluate(cfg: DictConfig) -> float:
    """Writes ``eval/<policy>.jsonl`` (per maze) and its summary in the run dir; returns the success rate."""
    adapter = None
    if cfg.checkpoint:
        adapter, cfg = checkpoint_adapter(Path(cfg.checkpoint)), with_checkpoint_config(cfg, Path(cfg.checkpoint))
    run_dir = run_dir_of(cfg)
    mazes = load_pinned(cfg.env.pinned_set)[: cfg.eval.num_mazes]
    trackers = build_trackers(cfg.logger, run_dir, cfg)
    status = "FAILED"
    try:
        policy = cfg.eval.policy.value
        if policy == "model":
            result, trajectories = _evaluate_model(cfg, mazes, adapter)
        else:
            result, trajectories = _evaluate_scripted(cfg, mazes, policy)
        path = run_dir / "eval" / f"{policy}.jsonl"
        record_eval(result, trajectories, mazes, path, trackers, 0, cfg.env.cell_px)
        log.info("eval (%s) on %s: %s; per-maze results in %s", policy, cfg.env.pinned_set, result.summary(), path)
        status = "FINISHED"
        return result.success_rate
    finally:
        trackers.finish(status)


def checkpoint_adapter(checkpoint: Path) -> Path:
    """The LoRA adapter of a ``global_step_N`` dir (its ``policy/``) or an adapter dir itself."""
    adapter = checkpoint / "policy" if (checkpoint / "policy").is_dir() else checkpoint
    if not (adapter / "adapter_config.json").is_file():
        raise FileNotFoundError(f"checkpoint={checkpoint}: no LoRA adapter (adapter_config.json) there")
    return adapter


def with_checkpoint_config(cfg: DictConfig, checkpoint: Path) -> DictConfig:
    """``cfg`` with the checkpoint's model/env/rollout settings, then this command line's overrides of them."""
    saved_path = checkpoint / "config.yaml"
    if not saved_path.is_file():
        log.warning("checkpoint=%s has no config.yaml; evaluating with this command's model/env/rollout settings", checkpoint)
        return cfg
    saved = OmegaConf.load(saved_path)
    merged = cfg.copy()
    for section in CHECKPOINT_SECTIONS:
        merged[section] = OmegaConf.merge(cfg[section], _known_keys(OmegaConf.to_container(saved[section]), cfg[section]))
    # the engine is how this machine generates (rollout=hf or vllm), not part of what was trained
    merged.rollout.engine = cfg.rollout.engine
    overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    with open_dict(merged):
        for override in OverridesParser.create().parse_overrides(list(overrides)):
            key = override.key_or_group
            if key.split(".")[0] in CHECKPOINT_SECTIONS and "." in key and not override.is_delete():
                OmegaConf.update(merged, key, override.value(), merge=False)
    return merged


def _evaluate_model(cfg: DictConfig, mazes, adapter: Path | None) -> tuple[EvalResult, list[Trajectory]]:
    model, processor = load_policy(cfg.model, cfg.cluster.device, adapter=adapter, trainable=False, new_adapter=False)
    engine = build_engine(cfg.rollout.engine, model=model, processor=processor)
    return evaluate_model(engine, TurnFormatter(processor), mazes, cfg.env, cfg.rollout, cfg.eval)


def _evaluate_scripted(cfg: DictConfig, mazes, policy: str) -> tuple[EvalResult, list[Trajectory]]:
    samples = 1 if cfg.eval.greedy else cfg.eval.samples_per_maze
    turns = min(cfg.env.max_steps, cfg.rollout.max_turns)
    trajectories = scripted_trajectories(SCRIPTED[policy](cfg), mazes, cfg.env, samples, turns)
    return summarize(episode_rows(trajectories, mazes), mazes, turns, samples), trajectories


def _known_keys(saved: dict, current: DictConfig) -> dict:
    """The saved settings this version still has (an older checkpoint may hold keys since removed)."""
    return {
        key: _known_keys(value, current[key]) if isinstance(value, dict) and OmegaConf.is_dict(current[key]) else value
        for key, value in saved.items()
        if key in current
    }
