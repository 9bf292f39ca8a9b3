"""``task=eval``: the pinned mazes, played by the model (base or a checkpoint) or a scripted baseline."""

import logging
from pathlib import Path

from omegaconf import DictConfig

from rlexp.envs import ExpertPolicy, NoisyExpertPolicy, RandomPolicy, load_pinned
from rlexp.evaluation.evaluate import EvalResult, episode_rows, evaluate_model, record_eval, summarize
from rlexp.rollout.conversation import Trajectory, TurnFormatter
from rlexp.rollout.driver import scripted_trajectories
from rlexp.rollout.hf_engine import HFEngine
from rlexp.train.setup import load_policy, run_dir_of
from rlexp.tracking import build_trackers

log = logging.getLogger(__name__)


def evaluate_task(cfg: DictConfig) -> float:
    """Writes ``eval/<policy>.jsonl`` (per maze) and its summary in the run dir; returns the success rate."""
    run_dir = run_dir_of(cfg)
    mazes = load_pinned(cfg.env.pinned_set)[: cfg.eval.num_mazes]
    trackers = build_trackers(cfg.logger, run_dir, cfg)
    status = "FAILED"
    try:
        policy = cfg.eval.policy.value
        if policy == "model":
            result, trajectories = _evaluate_model(cfg, mazes)
        else:
            result, trajectories = _evaluate_scripted(cfg, mazes, policy)
        path = run_dir / "eval" / f"{policy}.jsonl"
        record_eval(result, trajectories, mazes, path, trackers, 0, cfg.env.cell_px)
        log.info("eval (%s) on %s: %s; per-maze results in %s", policy, cfg.env.pinned_set, result.summary(), path)
        status = "FINISHED"
        return result.success_rate
    finally:
        trackers.finish(status)


def _evaluate_model(cfg: DictConfig, mazes) -> tuple[EvalResult, list[Trajectory]]:
    adapter = None
    if cfg.checkpoint:
        adapter = Path(cfg.checkpoint)
        adapter = adapter / "policy" if (adapter / "policy").is_dir() else adapter
        if not (adapter / "adapter_config.json").is_file():
            raise FileNotFoundError(f"checkpoint={cfg.checkpoint}: no LoRA adapter (adapter_config.json) there")
    model, processor = load_policy(cfg.model, cfg.cluster.device, adapter=adapter, trainable=False, new_adapter=False)
    engine = HFEngine(model, processor, static_cache=cfg.rollout.static_cache)
    return evaluate_model(engine, TurnFormatter(processor), mazes, cfg.env, cfg.rollout, cfg.eval)


def _evaluate_scripted(cfg: DictConfig, mazes, policy: str) -> tuple[EvalResult, list[Trajectory]]:
    policies = {
        "random": lambda: RandomPolicy(seed=cfg.seed),
        "expert": ExpertPolicy,
        "noisy_expert": lambda: NoisyExpertPolicy(cfg.eval.expert_prob, seed=cfg.seed),
    }
    samples = 1 if cfg.eval.greedy else cfg.eval.samples_per_maze
    trajectories = scripted_trajectories(policies[policy](), mazes, cfg.env, samples, cfg.rollout.max_turns)
    return summarize(episode_rows(trajectories, mazes), len(mazes), cfg.rollout.max_turns, samples), trajectories
