"""Recipe: GRPO with LoRA — rollouts, group advantages, clipped-ratio update, weight sync.

Each step samples ``train_batch_size`` mazes from a seeded stream disjoint from the pinned set, plays
``n_samples_per_prompt`` episodes of each with the engine, computes group advantages, scores old
log-probs with the trainer (and the reference's where ``kl_coef > 0``; skipped when the step is exactly
on policy, whose update forward gives them) and updates over mini-batches,
with a colocated engine asleep meanwhile; the loop then hands the new weights to the engine. The loss
and its choices are in ``rlexp.algorithms.grpo``.
"""

import torch
from omegaconf import DictConfig

from rlexp.algorithms.grpo import group_advantages, nonzero_variance_groups, policy_loss
from rlexp.rollout.conversation import training_sequences
from rlexp.rollout.driver import run_rollouts, stop_strings
from rlexp.rollout.engine import SamplingParams
from rlexp.rollout.turn_batch import TurnBatchEngine
from rlexp.training import distributed
from rlexp.training.loop import TrainingRun, run_training, timed, turn_limit
from rlexp.training.update import MicroBatch, Normalizers, Sample


def train(cfg: DictConfig) -> float:
    return run_training(cfg, GRPOStep)


class GRPOStep:
    def __init__(self, run: TrainingRun):
        self.run = run
        self.cfg = run.cfg
        self.algo = run.cfg.algorithm
        r = self.cfg.rollout
        self.sampling = SamplingParams(r.temperature, r.top_p, r.max_new_tokens_per_turn, stop_strings(self.cfg.env.action_format.value))
        #: the PPO ratio's old log-probs are the engine's, as sampled (``algorithm.old_logprobs=engine``).
        self.engine_old_logprobs = self.algo.old_logprobs == "engine"
        #: Dr. GRPO's constant: the most tokens one trajectory can generate.
        self.max_seq_len = turn_limit(self.cfg) * r.max_new_tokens_per_turn

    def __call__(self) -> dict[str, float]:
        run, algo = self.run, self.algo
        with run.preemption.abandonable():  # changes nothing a checkpoint holds (stream and RNG are restored)
            mazes = run.mazes()
            with distributed.gathered(run.model):  # each rank generates alone, on the whole weights
                played, t_generate = timed(self.play, mazes)
        # a colocated engine frees the GPU for scoring and the update, and is woken before the loop syncs it
        _, t_sleep = timed(run.engine.sleep)
        rewards = played.rewards
        advantages = group_advantages(rewards, algo.n_samples_per_prompt, norm_by_std=algo.norm_by_std)
        keep = torch.ones_like(rewards, dtype=torch.bool)
        if algo.drop_zero_variance_groups:
            keep = nonzero_variance_groups(rewards, algo.n_samples_per_prompt)
        n = algo.n_samples_per_prompt  # episodes are maze-major: episode i plays maze i // n
        samples = [Sample(seq, float(advantages[i]), group=i // n, trajectory=i) for seq, i in played.sequences() if keep[i]]
        metrics: dict[str, float] = {}
        t_train = 0.0
        n_samples = run.world.sum([len(samples)])[0]
        if n_samples:  # on every rank or none: scoring and the update are collectives under FSDP2
            reference = algo.kl_coef > 0
            t_score = 0.0
            # unscored: the update's own forward gives the old log-probs, or the engine's are taken (and the
            # update's first forward gives the gap)
            unscored = run.update.exactly_on_policy(samples, reference) or (self.engine_old_logprobs and not reference)
            if not unscored:
                (gap, t_score) = timed(run.update.score, samples, self.cfg.rollout.temperature, reference=reference)
                metrics.update(gap)
            update, t_train = timed(run.update.run, samples, self.loss, self.cfg.rollout.temperature, measure_gap=unscored)
            metrics.update(update)
            metrics["timing/score_s"] = t_score
        _, t_wake = timed(run.engine.wake_up)
        (generated,) = run.world.sum([played.generated_tokens])
        return {
            **played.metrics(),
            **metrics,
            "train/samples": n_samples,
            "timing/generate_s": t_generate,
            "timing/train_s": t_train,
            "timing/sleep_s": t_sleep,
            "timing/wake_s": t_wake,
            "timing/generate_tokens_per_s": generated / max(t_generate, 1e-9),
        }

    def play(self, mazes):
        """The step's episodes: as tensors where the engine plays them so (``rollout=turn_batch``), else
        trajectories from the driver."""
        cfg, n = self.cfg, self.algo.n_samples_per_prompt
        if isinstance(self.run.engine, TurnBatchEngine):
            return self.run.engine.play(mazes, cfg.env, n, cfg.rollout.temperature, turn_limit(cfg))
        trajectories = run_rollouts(self.run.engine, self.run.formatter, mazes, cfg.env, n, self.sampling, turn_limit(cfg))
        return PlayedTrajectories(self.run, trajectories)

    def loss(self, logprobs: torch.Tensor, micro: MicroBatch, normalizers: Normalizers):
        algo = self.algo
        device = logprobs.device
        width = logprobs.shape[1]
        if self.engine_old_logprobs:
            old = self.run.update.scorer.engine_logprobs(micro).to(device)
        elif micro.samples[0].old_logprobs is None:  # exactly on policy (PolicyUpdate.exactly_on_policy)
            old = logprobs.detach()
        else:
            old = _pad_rows([s.old_logprobs for s in micro.samples], width).to(device)
        refs = None
        if micro.samples[0].ref_logprobs is not None:
            refs = _pad_rows([s.ref_logprobs for s in micro.samples], width).to(device)
        reduction = algo.loss_reduction.value
        # token_mean divides by the mini-batch's tokens; the per-sequence reductions count trajectories
        normalizer = normalizers.tokens if reduction == "token_mean" else normalizers.trajectories
        loss, metrics = policy_loss(
            logprobs, old, torch.tensor([s.advantage for s in micro.samples], device=device), micro.batch["loss_mask"],
            algo.eps_low, algo.eps_high, reduction, normalizer=normalizer, max_seq_len=self.max_seq_len,
            ref_logprobs=refs, kl_coef=algo.kl_coef, sequence_tokens=micro.trajectory_tokens,
        )
        metrics["kl_loss"] = (loss - metrics["pg_loss"]).detach()
        return loss, metrics


class PlayedTrajectories:
    """The driver's trajectories, as ``GRPOStep`` reads a step's episodes (``PlayedBatch``'s interface)."""

    def __init__(self, run: TrainingRun, trajectories):
        self.run, self.trajectories = run, trajectories
        self.rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        self.generated_tokens = sum(len(turn.response_ids) for t in trajectories for turn in t.turns)

    def sequences(self) -> list:
        window = self.run.cfg.env.history_window
        return [(seq, i) for i, t in enumerate(self.trajectories) for seq in training_sequences(self.run.formatter, t, window)]

    def metrics(self) -> dict[str, float]:
        return self.run.rollout_metrics(self.trajectories, self.rewards)


def _pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out

