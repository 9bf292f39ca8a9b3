"""``task=train``: the GRPO loop — rollouts, advantages, LoRA update, weight sync, eval, checkpoint.

Each step: sample ``train_batch_size`` mazes from a seeded stream disjoint from the pinned set, play
``n_samples_per_prompt`` episodes of each, compute group advantages, recompute old log-probs, then
update over mini-batches (``policy_mini_batch_size`` mazes) of micro-batches (``micro_batch_size``
sequences) with gradient accumulation, clipping, AdamW and a warmup-then-constant lr.
"""

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from rlexp.algorithms.grpo import group_advantages, loss_normalizer, nonzero_variance_groups, policy_loss, sft_loss
from rlexp.envs import ExpertPolicy, TrainingMazeStream, load_pinned, pinned_layout_hashes
from rlexp.evaluation.evaluate import EvalResult, evaluate_model, record_eval
from rlexp.models import reference_model
from rlexp.rollout.conversation import Sequence, Trajectory, TurnFormatter, training_sequences
from rlexp.rollout.driver import run_rollouts, scripted_trajectories, stop_strings
from rlexp.rollout.engine import SamplingParams
from rlexp.rollout.hf_engine import HFEngine
from rlexp.train.batching import collate, token_logprobs
from rlexp.train.checkpoint import (
    latest_valid_checkpoint,
    load_trainer_state,
    restore_rng_states,
    save_checkpoint,
)
from rlexp.train.setup import load_policy, run_dir_of
from rlexp.tracking import build_trackers

log = logging.getLogger(__name__)


class TrainingDivergedError(RuntimeError):
    """A non-finite loss or gradient; the step is abandoned and the last checkpoint stays intact."""


@dataclass
class Sample:
    sequence: Sequence
    advantage: float
    group: int
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


def train(cfg: DictConfig) -> float:
    """Run (or resume) a training run; returns the final eval success rate (a sweeper's objective)."""
    run_dir = run_dir_of(cfg)
    trackers = build_trackers(cfg.logger, run_dir, cfg)
    status = "FAILED"
    try:
        result = Trainer(cfg, run_dir, trackers).fit()
        status = "FINISHED"
        return result
    finally:
        trackers.finish(status)


class Trainer:
    def __init__(self, cfg: DictConfig, run_dir: Path, trackers):
        self.cfg, self.run_dir, self.trackers = cfg, run_dir, trackers
        self.algo, self.rollout_cfg, self.env_cfg = cfg.algorithm, cfg.rollout, cfg.env
        #: supervised on BFS-expert trajectories instead of GRPO on the policy's own.
        self.sft = self.algo.name.value == "sft"
        self.ckpt_root = run_dir / "checkpoints"
        torch.manual_seed(cfg.seed)
        checkpoint = self._checkpoint_to_resume()
        self.model, self.processor = load_policy(cfg.model, cfg.cluster.device, adapter=checkpoint and checkpoint / "policy", trainable=True)
        self.device = next(self.model.parameters()).device
        self.formatter = TurnFormatter(self.processor)
        self.engine = HFEngine(self.model, self.processor, static_cache=cfg.rollout.static_cache)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=self.algo.lr, weight_decay=self.algo.weight_decay)
        warmup = self.algo.lr_warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda n: min(1.0, (n + 1) / (warmup + 1)))
        self.pinned = load_pinned(self.env_cfg.pinned_set)[: cfg.eval.num_mazes]
        self.stream = TrainingMazeStream(
            self.env_cfg.size, self.env_cfg.max_steps, cfg.seed, pinned_layout_hashes(self.env_cfg.pinned_set)
        )
        self.step = 0
        self.last_eval: EvalResult | None = None
        if checkpoint is not None:
            state = load_trainer_state(checkpoint)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.stream.load_state_dict(state["stream"])
            self.step = state["step"]
            restore_rng_states(state["rng"])
            log.info("resumed from %s at step %d", checkpoint, self.step)

    def _checkpoint_to_resume(self) -> Path | None:
        resume = self.cfg.resume
        if resume == "none":
            return None
        if resume == "latest":
            return latest_valid_checkpoint(self.ckpt_root)
        path = Path(resume)
        if not (path / "trainer_state.pt").is_file():
            raise FileNotFoundError(f"resume={resume}: no trainer_state.pt there; give a global_step_N dir")
        return path

    # -- the loop -----------------------------------------------------------------------------------

    def fit(self) -> float:
        cfg = self.cfg
        log.info("run dir: %s", self.run_dir)
        if self.step == 0:
            self.evaluate()
        while self.step < cfg.total_steps:
            metrics = self.train_step()
            self.step += 1
            last = self.step == cfg.total_steps
            self.trackers.log_metrics(metrics, self.step)
            log.info(_step_line(self.step, cfg.total_steps, metrics))
            if self.step % cfg.eval_interval == 0 or last:
                self.evaluate()
            if self.step % cfg.ckpt_interval == 0 or last:
                path = self.save()
                self.trackers.set_tags({"checkpoint": str(path.resolve())})
                log.info("checkpoint: %s", path)
        if self.last_eval is None:
            self.evaluate()
        log.info("done: %s; run dir %s", self.last_eval.summary(), self.run_dir)
        return self.last_eval.success_rate

    def train_step(self) -> dict[str, float]:
        algo = self.algo
        mazes = self.stream.next_batch(algo.train_batch_size)
        t0 = time.perf_counter()
        if self.sft:
            trajectories = scripted_trajectories(
                ExpertPolicy(), mazes, self.env_cfg, 1, self.rollout_cfg.max_turns, self.formatter
            )
        else:
            trajectories = run_rollouts(
                self.engine, self.formatter, mazes, self.env_cfg, algo.n_samples_per_prompt, self._sampling(),
                self.rollout_cfg.max_turns,
            )
        t_generate = time.perf_counter() - t0
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        advantages, keep = torch.ones_like(rewards), torch.ones_like(rewards, dtype=torch.bool)
        if not self.sft:
            advantages = group_advantages(rewards, algo.n_samples_per_prompt, norm_by_std=algo.norm_by_std)
            if algo.drop_zero_variance_groups:
                keep = nonzero_variance_groups(rewards, algo.n_samples_per_prompt)
        samples = [
            Sample(sequence, float(advantages[i]), t.maze_index)
            for i, t in enumerate(trajectories)
            if keep[i]
            for sequence in training_sequences(self.formatter, t, self.env_cfg.history_window)
        ]
        t1 = time.perf_counter()
        update = self.update(samples) if samples else {}
        t_train = time.perf_counter() - t1
        t2 = time.perf_counter()
        self.engine.load_weights()
        t_sync = time.perf_counter() - t2
        generated = sum(len(turn.response_ids) for t in trajectories for turn in t.turns)
        return {
            **_rollout_metrics(trajectories, rewards),
            **update,
            "train/samples": float(len(samples)),
            "train/lr": self.scheduler.get_last_lr()[0],
            "timing/generate_s": t_generate,
            "timing/train_s": t_train,
            "timing/sync_s": t_sync,
            "timing/generate_tokens_per_s": generated / max(t_generate, 1e-9),
        }

    def _sampling(self) -> SamplingParams:
        r = self.rollout_cfg
        return SamplingParams(r.temperature, r.top_p, r.max_new_tokens_per_turn, stop_strings(self.env_cfg.action_format.value))

    # -- the policy update --------------------------------------------------------------------------

    def update(self, samples: list[Sample]) -> dict[str, float]:
        algo = self.algo
        self._score_old(samples)
        mini_batches = self._mini_batches(samples)
        totals: dict[str, float] = {}
        count = 0
        self.model.train()
        for _ in range(algo.epochs_per_step):
            for mini_batch in tqdm(mini_batches, desc="update", unit="mini-batch", leave=False):
                metrics = self._optimizer_step(mini_batch)
                for key, value in metrics.items():
                    totals[key] = totals.get(key, 0.0) + value
                count += 1
        return {key: value / max(count, 1) for key, value in totals.items()}

    def _mini_batches(self, samples: list[Sample]) -> list[list[Sample]]:
        per = self.algo.policy_mini_batch_size
        by_group: dict[int, list[Sample]] = {}
        for sample in samples:
            by_group.setdefault(sample.group // per, []).append(sample)
        return [by_group[k] for k in sorted(by_group)]

    def _micro_batches(self, samples: list[Sample]) -> list[list[Sample]]:
        size = self.algo.micro_batch_size
        return [samples[i : i + size] for i in range(0, len(samples), size)]

    @torch.no_grad()
    def _score_old(self, samples: list[Sample]) -> None:
        """Old log-probs from the trainer itself (ratio exactly 1 on the first mini-batch); reference too if KL is on."""
        temperature = self.rollout_cfg.temperature
        self.model.eval()
        for micro in self._micro_batches(samples):
            batch = collate([s.sequence for s in micro], self._pad_id, self.model.config, self.device)
            old, _ = token_logprobs(self.model, batch, temperature)
            ref = None
            if self.algo.kl_coef > 0:
                with reference_model(self.model):
                    ref, _ = token_logprobs(self.model, batch, temperature)
            for row, sample in enumerate(micro):
                n = len(sample.sequence.token_ids) - 1
                sample.old_logprobs = old[row, :n].cpu()
                sample.ref_logprobs = None if ref is None else ref[row, :n].cpu()

    @property
    def _pad_id(self) -> int:
        return self.processor.tokenizer.pad_token_id

    def _optimizer_step(self, mini_batch: list[Sample]) -> dict[str, float]:
        algo = self.algo
        reduction = algo.loss_reduction.value
        micro_batches = self._micro_batches(mini_batch)
        batches = [collate([s.sequence for s in micro], self._pad_id, self.model.config, self.device) for micro in micro_batches]
        normalizer = sum(loss_normalizer(b["loss_mask"], reduction) for b in batches)
        token_count = sum(loss_normalizer(b["loss_mask"], "token_mean") for b in batches)
        max_seq_len = self.rollout_cfg.max_turns * self.rollout_cfg.max_new_tokens_per_turn
        sums: dict[str, float] = {}
        tokens, loss_total = 0, 0.0
        self.optimizer.zero_grad(set_to_none=True)
        for micro, batch in zip(micro_batches, batches):
            logprobs, entropy = token_logprobs(self.model, batch, self.rollout_cfg.temperature)
            mask = batch["loss_mask"]
            width = mask.shape[1]
            old = _pad_rows([s.old_logprobs for s in micro], width).to(self.device)
            if self.sft:
                loss = sft_loss(logprobs, mask, token_count)
                metrics = {}
            else:
                refs = None if micro[0].ref_logprobs is None else _pad_rows([s.ref_logprobs for s in micro], width).to(self.device)
                advantages = torch.tensor([s.advantage for s in micro], device=self.device)
                loss, metrics = policy_loss(
                    logprobs, old, advantages, mask, algo.eps_low, algo.eps_high, reduction,
                    normalizer=normalizer, max_seq_len=max_seq_len, ref_logprobs=refs, kl_coef=algo.kl_coef,
                )
            if not torch.isfinite(loss):
                self.optimizer.zero_grad(set_to_none=True)
                raise TrainingDivergedError(
                    f"non-finite loss ({loss.item()}) at step {self.step + 1}; the update was not applied and "
                    f"the last checkpoint in {self.ckpt_root} is intact. Try a lower algorithm.lr."
                )
            loss.backward()
            loss_total += loss.item()
            n = int(mask.sum())
            tokens += n
            # per-call means, weighted by their token counts into mini-batch means
            means = {"train/entropy": float((entropy * mask).sum() / max(n, 1))}
            means.update({f"train/{k}": float(v) for k, v in metrics.items()})
            for key, value in means.items():
                sums[key] = sums.get(key, 0.0) + value * n
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.algo.max_grad_norm)
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingDivergedError(f"non-finite gradient norm at step {self.step + 1}; the update was not applied")
        self.optimizer.step()
        if not all(torch.isfinite(p).all() for p in params):
            raise TrainingDivergedError(
                f"non-finite LoRA weights after the update at step {self.step + 1}; the last checkpoint in "
                f"{self.ckpt_root} is intact. Try a lower algorithm.lr."
            )
        self.scheduler.step()
        result = {key: value / max(tokens, 1) for key, value in sums.items()}
        result["train/loss"] = loss_total
        result["train/grad_norm"] = float(grad_norm)
        result["train/tokens"] = float(tokens)
        return result

    # -- eval and checkpoints -----------------------------------------------------------------------

    def evaluate(self) -> EvalResult:
        start = time.perf_counter()
        result, trajectories = evaluate_model(
            self.engine, self.formatter, self.pinned, self.env_cfg, self.rollout_cfg, self.cfg.eval
        )
        self.trackers.log_metrics({"timing/eval_s": time.perf_counter() - start}, self.step)
        path = self.run_dir / "eval" / f"step_{self.step:06d}.jsonl"
        record_eval(result, trajectories, self.pinned, path, self.trackers, self.step, self.env_cfg.cell_px)
        log.info("eval at step %d: %s (%s)", self.step, result.summary(), path)
        self.last_eval = result
        return result

    def save(self) -> Path:
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "stream": self.stream.state_dict(),
        }
        return save_checkpoint(self.ckpt_root, self.step, self.model, state, self.cfg, self.cfg.keep_last_ckpts)


def _pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def _rollout_metrics(trajectories: list[Trajectory], rewards: torch.Tensor) -> dict[str, float]:
    turns = sum(t.num_turns for t in trajectories)
    return {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/success_rate": sum(t.success for t in trajectories) / len(trajectories),
        "rollout/mean_turns": turns / len(trajectories),
        "rollout/invalid_action_rate": sum(t.num_invalid for t in trajectories) / max(turns, 1),
        "rollout/response_tokens_mean": sum(len(x.response_ids) for t in trajectories for x in t.turns) / max(turns, 1),
    }


def _step_line(step: int, total: int, m: dict[str, float]) -> str:
    def get(key: str, spec: str) -> str:
        return format(m[key], spec) if key in m else "n/a"

    return (
        f"step {step}/{total} | reward {get('rollout/reward_mean', '.3f')} success {get('rollout/success_rate', '.1%')} "
        f"| loss {get('train/loss', '.4f')} kl {get('train/kl', '.4f')} entropy {get('train/entropy', '.3f')} "
        f"grad_norm {get('train/grad_norm', '.3f')} | {get('timing/generate_tokens_per_s', '.0f')} tok/s "
        f"| generate {get('timing/generate_s', '.1f')}s train {get('timing/train_s', '.1f')}s sync {get('timing/sync_s', '.2f')}s"
    )
