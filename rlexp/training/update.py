"""The policy update shared by every training recipe: mini-batches, micro-batches, one optimizer step each.

A recipe hands over ``Sample``s (a training sequence with its advantage) and a loss function; this
module scores old and reference log-probs where the loss needs them, splits the samples into
mini-batches of ``policy_mini_batch_size`` mazes and micro-batches of ``micro_batch_size`` sequences,
accumulates gradients, clips, steps the optimizer and the lr schedule, and aggregates the metrics so
that they mean the same whatever the micro-batch size:

* ``train/loss``, ``train/pg_loss`` and ``train/kl_loss`` are the mini-batch's loss terms (sums of the
  globally normalised micro-batch terms), averaged over the step's mini-batches;
* ``train/clip_frac``, ``train/ratio_mean``, ``train/approx_kl``, ``train/kl`` and ``train/entropy``
  are means over every loss-masked token of the step; ``train/ratio_max`` is the step's maximum.

Under FSDP2 (``rlexp.training.distributed``) each rank holds its share of every mini-batch: the
normalisers (tokens, trajectories) are summed over the ranks, so each rank's loss is its share of the
global one; the gradient is summed over the ranks (FSDP averages, so the loss is scaled by the world
size); ranks with fewer micro-batches run zero-weighted ones, since every forward is a collective; the
metrics are reduced over the ranks. Two ranks thus take the same step as one process.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from tqdm.auto import tqdm

from rlexp.algorithms.grpo import loss_normalizer
from rlexp.models import reference_model
from rlexp.rollout.conversation import Sequence
from rlexp.training.batching import collate, token_logprobs
from rlexp.training.distributed import World, local, this_rank, world


class TrainingDivergedError(RuntimeError):
    """A non-finite loss or gradient; the step is abandoned and the last checkpoint stays intact."""


@dataclass
class Sample:
    sequence: Sequence
    advantage: float
    #: the maze (GRPO group) it comes from: mini-batches hold whole groups.
    group: int
    #: the trajectory it comes from: with a history window one trajectory gives several sequences.
    trajectory: int
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


@dataclass
class MicroBatch:
    samples: list[Sample]
    batch: dict[str, torch.Tensor]
    #: [B] masked-token count of each row's whole trajectory (for per-trajectory reductions).
    trajectory_tokens: torch.Tensor


@dataclass
class Normalizers:
    """Counts over the whole mini-batch that each micro-batch's loss divides by (see ``loss_normalizer``)."""

    tokens: int
    trajectories: int


#: (log-probs [B, T], micro-batch, normalizers) -> (loss, {metric: 0-dim tensor})
LossFn = Callable[[torch.Tensor, MicroBatch, Normalizers], tuple[torch.Tensor, dict[str, torch.Tensor]]]

#: per-call metrics that are means over that call's masked tokens (weighted into step means).
TOKEN_MEANS = ("clip_frac", "ratio_mean", "approx_kl", "kl")
#: per-call metrics that are already shares of the mini-batch's loss (summed over micro-batches).
LOSS_TERMS = ("pg_loss", "kl_loss")


class PolicyUpdate:
    def __init__(
        self, model, optimizer, scheduler, algorithm_cfg, pad_id: int, suppressed_ids: list[int], step_label,
        ranks: World | None = None, scorer: "Scorer | None" = None,
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.world = ranks or world()
        self.algo = algorithm_cfg
        #: how samples become batches and log-probs: token sequences by default; an engine that plays
        #: episodes as tensors brings its own (``rlexp.rollout.turn_batch.ActionTurnScorer``).
        self.scorer = scorer or SequenceScorer(model, pad_id, suppressed_ids)
        #: () -> the step number used in error messages.
        self.step_label = step_label
        self.device = next(model.parameters()).device
        self.params = [p for p in model.parameters() if p.requires_grad]

    # -- batching -----------------------------------------------------------------------------------

    def mini_batches(self, samples: list[Sample]) -> list[list[Sample]]:
        """Samples by mini-batch, whole groups each; a rank's groups are its share of the step's mazes (every
        ``size``-th), so its mini-batch ``k`` holds ``policy_mini_batch_size / size`` of them. Mini-batches
        empty on every rank are left out; one empty on this rank only stays (it still takes part)."""
        per = self.algo.policy_mini_batch_size // self.world.size
        by_chunk: dict[int, list[Sample]] = {}
        for sample in samples:
            by_chunk.setdefault(sample.group // per, []).append(sample)
        chunks = int(self.world.max([max(by_chunk, default=-1) + 1])[0])
        counts = self.world.sum([len(by_chunk.get(k, [])) for k in range(chunks)])
        return [by_chunk.get(k, []) for k in range(chunks) if counts[k]]

    def micro_batches(self, samples: list[Sample]) -> list[MicroBatch]:
        """Micro-batches of sequences of similar length (sorted first), so that little of each is padding;
        the loss is a sum over micro-batches with mini-batch-wide normalizers, so the order changes nothing."""
        tokens_of: dict[int, int] = {}
        for s in samples:
            tokens_of[s.trajectory] = tokens_of.get(s.trajectory, 0) + self.scorer.tokens(s)
        size = self.algo.micro_batch_size
        by_length = sorted(samples, key=self.scorer.width)
        out = []
        for i in range(0, len(by_length), size):
            micro = by_length[i : i + size]
            batch = self.scorer.batch(micro, self.device)
            counts = torch.tensor([tokens_of[s.trajectory] for s in micro], dtype=torch.float32, device=self.device)
            out.append(MicroBatch(micro, batch, counts))
        return out

    def aligned_micro_batches(self, samples: list[Sample]) -> list[tuple[MicroBatch, bool]]:
        """(micro-batch, real) pairs, as many on every rank: every forward is a collective under FSDP2, so a
        rank with fewer micro-batches pads with copies of a sample (``real`` false: zero weight, no metrics)."""
        micro = [(m, True) for m in self.micro_batches(samples)]
        count, empty_ranks = self.world.max([len(micro), not samples])
        filler = self._shared_sample(samples) if empty_ranks else samples[0] if len(micro) < count else None
        if filler is not None:
            micro += [(self.micro_batches([filler])[0], False)] * (int(count) - len(micro))
        return micro

    def _shared_sample(self, samples: list[Sample]) -> Sample:
        """The first sample of the first rank that has one, on every rank (for a rank that has none)."""
        import torch.distributed as dist

        offered: list[Sample | None] = [None] * self.world.size
        dist.all_gather_object(offered, samples[0] if samples else None)
        return next(s for s in offered if s is not None)

    def logprobs(self, batch: dict[str, torch.Tensor], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scorer.logprobs(batch, temperature)

    # -- scoring ------------------------------------------------------------------------------------

    def exactly_on_policy(self, samples: list[Sample], reference: bool) -> bool:
        """Whether the step is one optimizer step on the policy that sampled (one mini-batch, one epoch)
        with no reference: then the old log-probs are the update's own, detached (the ratio is 1 by
        definition), and ``score`` need not run its forward pass; ``run`` reports the gap instead."""
        return not reference and self.algo.epochs_per_step == 1 and len(self.mini_batches(samples)) == 1

    @torch.no_grad()
    def score(self, samples: list[Sample], temperature: float, reference: bool) -> dict[str, float]:
        """Old log-probs from the trainer itself (ratio exactly 1 on the first mini-batch), the
        reference's when ``reference``; returns ``rollout/logprob_gap``: the mean |engine − trainer|
        log-prob over sampled tokens, the metric that catches an engine that drifts from the trainer."""
        was_training = self.model.training
        self.model.eval()
        gap_sum, gap_count = 0.0, 0
        try:
            for micro, real in self.aligned_micro_batches(samples):
                old, _ = self.logprobs(micro.batch, temperature)
                ref = None
                if reference:
                    with reference_model(self.model):
                        ref, _ = self.logprobs(micro.batch, temperature)
                if not real:
                    continue
                for row, sample in enumerate(micro.samples):
                    n = self.scorer.width(sample)
                    sample.old_logprobs = old[row, :n].cpu()
                    sample.ref_logprobs = None if ref is None else ref[row, :n].cpu()
                total, count = engine_gap(micro, old, self.scorer)
                gap_sum += total
                gap_count += count
        finally:
            self.model.train(was_training)
        gap_sum, gap_count = self.world.sum([gap_sum, gap_count])
        return {"rollout/logprob_gap": gap_sum / max(gap_count, 1)}

    # -- the update ---------------------------------------------------------------------------------

    def run(self, samples: list[Sample], loss_fn: LossFn, temperature: float, measure_gap: bool = False) -> dict[str, float]:
        """``epochs_per_step`` passes over the mini-batches, one optimizer step each; ``measure_gap``: report
        ``rollout/logprob_gap`` from the update's own forward of the first mini-batch, the one taken with the
        policy that sampled (for a step that was not scored)."""
        mini_batches = self.mini_batches(samples)
        sums: dict[str, float] = {}
        token_sums: dict[str, float] = {}
        tokens = 0
        ratio_max = 0.0
        steps = 0
        gap = [0.0, 0] if measure_gap else None
        self.model.train()
        for _ in range(self.algo.epochs_per_step):
            for mini_batch in tqdm(mini_batches, desc="update", unit="mini-batch", leave=False):
                stats, token_stats, n, r_max = self._optimizer_step(mini_batch, loss_fn, temperature, gap if steps == 0 else None)
                for key, value in stats.items():
                    sums[key] = sums.get(key, 0.0) + value
                for key, value in token_stats.items():
                    token_sums[key] = token_sums.get(key, 0.0) + value
                tokens += n
                ratio_max = max(ratio_max, r_max)
                steps += 1
        metrics = {f"train/{key}": value / max(steps, 1) for key, value in sums.items()}
        metrics.update({f"train/{key}": value / max(tokens, 1) for key, value in token_sums.items()})
        if "train/ratio_mean" in metrics:
            metrics["train/ratio_max"] = ratio_max
        if gap is not None:
            gap_sum, gap_count = self.world.sum(gap)
            metrics["rollout/logprob_gap"] = gap_sum / max(gap_count, 1)
        metrics["train/tokens"] = float(tokens)
        metrics["train/optimizer_steps"] = float(steps)
        return metrics

    def _optimizer_step(self, mini_batch: list[Sample], loss_fn: LossFn, temperature: float, gap: list | None):
        micro_batches = self.aligned_micro_batches(mini_batch)
        tokens, trajectories = self.world.sum([
            sum(loss_normalizer(m.batch["loss_mask"], "token_mean") for m, real in micro_batches if real),
            len({s.trajectory for s in mini_batch}),
        ])
        normalizers = Normalizers(tokens=int(tokens), trajectories=int(trajectories))
        sums = {"loss": 0.0}
        token_sums: dict[str, float] = {"entropy": 0.0}
        tokens, ratio_max = 0, 0.0
        # the lr this step is taken with (the schedule moves on after it)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.zero_grad(set_to_none=True)
        for micro, real in micro_batches:
            logprobs, entropy = self.logprobs(micro.batch, temperature)
            loss, metrics = loss_fn(logprobs, micro, normalizers)
            if not torch.isfinite(loss):
                self.optimizer.zero_grad(set_to_none=True)
                raise TrainingDivergedError(
                    f"non-finite loss ({loss.item()}) at step {self.step_label()}; the update was not applied and "
                    "the last checkpoint is intact. Try a lower algorithm.lr."
                )
            for key in (*LOSS_TERMS, *TOKEN_MEANS):
                if key in metrics:  # the same keys on every rank, padding or not
                    (sums if key in LOSS_TERMS else token_sums).setdefault(key, 0.0)
            if not real:
                (loss * 0.0).backward()  # takes part in FSDP's gradient reduction, adds nothing
                continue
            # FSDP averages gradients over the ranks; the loss is a share of the global one, so sum them
            (loss * self.world.size).backward()
            if gap is not None:
                total, count = engine_gap(micro, logprobs, self.scorer)
                gap[0] += total
                gap[1] += count
            mask = micro.batch["loss_mask"].bool()
            n = int(mask.sum())
            tokens += n
            sums["loss"] += loss.item()
            for key in LOSS_TERMS:
                if key in metrics:
                    sums[key] += float(metrics[key])
            token_sums["entropy"] += float(entropy[mask].sum())
            for key in TOKEN_MEANS:
                if key in metrics:
                    token_sums[key] += float(metrics[key]) * n
            if "ratio_max" in metrics:
                ratio_max = max(ratio_max, float(metrics["ratio_max"]))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.algo.max_grad_norm)
        grad_norm = local(grad_norm)
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingDivergedError(f"non-finite gradient norm at step {self.step_label()}; the update was not applied")
        self.optimizer.step()
        if not all(torch.isfinite(this_rank(p)).all() for p in self.params):
            raise TrainingDivergedError(
                f"non-finite weights after the update at step {self.step_label()}; the last checkpoint is intact. "
                "Try a lower algorithm.lr."
            )
        self.scheduler.step()
        sums = dict(zip(sums, self.world.sum(list(sums.values()))))
        token_sums = dict(zip(token_sums, self.world.sum(list(token_sums.values()))))
        tokens = int(self.world.sum([tokens])[0])
        ratio_max = self.world.max([ratio_max])[0]
        sums["grad_norm"] = float(grad_norm)
        sums["lr"] = lr
        return sums, token_sums, tokens, ratio_max


def engine_gap(micro: MicroBatch, logprobs: torch.Tensor, scorer: "Scorer") -> tuple[float, int]:
    """Sum and count of |engine − trainer| log-prob over the micro-batch's sampled (loss-masked) tokens."""
    mask = micro.batch["loss_mask"].bool()
    delta = scorer.engine_logprobs(micro).to(logprobs.device) - logprobs.detach().float()
    return float(delta[mask].abs().sum()), int(mask.sum())


class Scorer(Protocol):
    """What ``PolicyUpdate`` needs to know of its samples."""

    def batch(self, samples: list[Sample], device: torch.device) -> dict[str, torch.Tensor]:
        """A micro-batch's tensors, holding ``loss_mask`` (B, W)."""

    def logprobs(self, batch: dict[str, torch.Tensor], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, W) log-probs of the batch's tokens (with grad) and their entropies."""

    def width(self, sample: Sample) -> int:
        """The columns of the sample's row of ``logprobs``."""

    def tokens(self, sample: Sample) -> int:
        """The sample's loss-masked tokens."""

    def engine_logprobs(self, micro: MicroBatch) -> torch.Tensor:
        """(B, W) float32 log-probs the engine recorded, aligned with ``logprobs``."""


class SequenceScorer:
    """Samples that hold a ``Sequence`` (token ids, frames, loss mask), scored by the policy's own forward."""

    def __init__(self, model, pad_id: int, suppressed_ids: list[int]):
        self.model, self.pad_id, self.suppressed_ids = model, pad_id, suppressed_ids

    def batch(self, samples: list[Sample], device: torch.device) -> dict[str, torch.Tensor]:
        return collate([s.sequence for s in samples], self.pad_id, self.model.config, device)

    def logprobs(self, batch: dict[str, torch.Tensor], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(self.model, batch, temperature, self.suppressed_ids)

    def width(self, sample: Sample) -> int:
        return len(sample.sequence.token_ids) - 1

    def tokens(self, sample: Sample) -> int:
        return sum(sample.sequence.loss_mask)

    def engine_logprobs(self, micro: MicroBatch) -> torch.Tensor:
        mask = micro.batch["loss_mask"]
        engine = torch.zeros(mask.shape, dtype=torch.float32)
        for row, sample in enumerate(micro.samples):
            recorded = sample.sequence.engine_logprobs[1:]
            engine[row, : len(recorded)] = torch.tensor(recorded, dtype=torch.float32)
        return engine
