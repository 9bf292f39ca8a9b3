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
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from rlexp.algorithms.grpo import loss_normalizer
from rlexp.models import reference_model
from rlexp.rollout.conversation import Sequence
from rlexp.training.batching import collate, token_logprobs


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
    def __init__(self, model, optimizer, scheduler, algorithm_cfg, pad_id: int, suppressed_ids: list[int], step_label):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.algo = algorithm_cfg
        self.pad_id = pad_id
        self.suppressed_ids = suppressed_ids
        #: () -> the step number used in error messages.
        self.step_label = step_label
        self.device = next(model.parameters()).device
        self.params = [p for p in model.parameters() if p.requires_grad]

    # -- batching -----------------------------------------------------------------------------------

    def mini_batches(self, samples: list[Sample]) -> list[list[Sample]]:
        per = self.algo.policy_mini_batch_size
        by_chunk: dict[int, list[Sample]] = {}
        for sample in samples:
            by_chunk.setdefault(sample.group // per, []).append(sample)
        return [by_chunk[k] for k in sorted(by_chunk)]

    def micro_batches(self, samples: list[Sample]) -> list[MicroBatch]:
        tokens_of: dict[int, int] = {}
        for s in samples:
            tokens_of[s.trajectory] = tokens_of.get(s.trajectory, 0) + sum(s.sequence.loss_mask)
        size = self.algo.micro_batch_size
        out = []
        for i in range(0, len(samples), size):
            micro = samples[i : i + size]
            batch = collate([s.sequence for s in micro], self.pad_id, self.model.config, self.device)
            counts = torch.tensor([tokens_of[s.trajectory] for s in micro], dtype=torch.float32, device=self.device)
            out.append(MicroBatch(micro, batch, counts))
        return out

    def logprobs(self, batch: dict[str, torch.Tensor], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(self.model, batch, temperature, self.suppressed_ids)

    # -- scoring ------------------------------------------------------------------------------------

    @torch.no_grad()
    def score(self, samples: list[Sample], temperature: float, reference: bool) -> dict[str, float]:
        """Old log-probs from the trainer itself (ratio exactly 1 on the first mini-batch), the
        reference's when ``reference``; returns ``rollout/logprob_gap``: the mean |engine − trainer|
        log-prob over sampled tokens, the metric that catches an engine that drifts from the trainer."""
        was_training = self.model.training
        self.model.eval()
        gap_sum, gap_count = 0.0, 0
        try:
            for micro in self.micro_batches(samples):
                old, _ = self.logprobs(micro.batch, temperature)
                ref = None
                if reference:
                    with reference_model(self.model):
                        ref, _ = self.logprobs(micro.batch, temperature)
                for row, sample in enumerate(micro.samples):
                    n = len(sample.sequence.token_ids) - 1
                    sample.old_logprobs = old[row, :n].cpu()
                    sample.ref_logprobs = None if ref is None else ref[row, :n].cpu()
                    mask = torch.tensor(sample.sequence.loss_mask[1:], dtype=torch.bool)
                    engine = torch.tensor(sample.sequence.engine_logprobs[1:], dtype=torch.float32)
                    gap_sum += float((engine - sample.old_logprobs)[mask].abs().sum())
                    gap_count += int(mask.sum())
        finally:
            self.model.train(was_training)
        return {"rollout/logprob_gap": gap_sum / max(gap_count, 1)}

    # -- the update ---------------------------------------------------------------------------------

    def run(self, samples: list[Sample], loss_fn: LossFn, temperature: float) -> dict[str, float]:
        """``epochs_per_step`` passes over the mini-batches, one optimizer step each."""
        mini_batches = self.mini_batches(samples)
        sums: dict[str, float] = {}
        token_sums: dict[str, float] = {}
        tokens = 0
        ratio_max = 0.0
        steps = 0
        self.model.train()
        for _ in range(self.algo.epochs_per_step):
            for mini_batch in tqdm(mini_batches, desc="update", unit="mini-batch", leave=False):
                stats, token_stats, n, r_max = self._optimizer_step(mini_batch, loss_fn, temperature)
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
        metrics["train/tokens"] = float(tokens)
        metrics["train/optimizer_steps"] = float(steps)
        return metrics

    def _optimizer_step(self, mini_batch: list[Sample], loss_fn: LossFn, temperature: float):
        micro_batches = self.micro_batches(mini_batch)
        normalizers = Normalizers(
            tokens=sum(loss_normalizer(m.batch["loss_mask"], "token_mean") for m in micro_batches),
            trajectories=len({s.trajectory for s in mini_batch}),
        )
        sums = {"loss": 0.0}
        token_sums: dict[str, float] = {}
        tokens, ratio_max = 0, 0.0
        # the lr this step is taken with (the schedule moves on after it)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.zero_grad(set_to_none=True)
        for micro in micro_batches:
            logprobs, entropy = self.logprobs(micro.batch, temperature)
            loss, metrics = loss_fn(logprobs, micro, normalizers)
            if not torch.isfinite(loss):
                self.optimizer.zero_grad(set_to_none=True)
                raise TrainingDivergedError(
                    f"non-finite loss ({loss.item()}) at step {self.step_label()}; the update was not applied and "
                    "the last checkpoint is intact. Try a lower algorithm.lr."
                )
            loss.backward()
            mask = micro.batch["loss_mask"].bool()
            n = int(mask.sum())
            tokens += n
            sums["loss"] += loss.item()
            for key in LOSS_TERMS:
                if key in metrics:
                    sums[key] = sums.get(key, 0.0) + float(metrics[key])
            token_sums["entropy"] = token_sums.get("entropy", 0.0) + float(entropy[mask].sum())
            for key in TOKEN_MEANS:
                if key in metrics:
                    token_sums[key] = token_sums.get(key, 0.0) + float(metrics[key]) * n
            if "ratio_max" in metrics:
                ratio_max = max(ratio_max, float(metrics["ratio_max"]))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.algo.max_grad_norm)
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingDivergedError(f"non-finite gradient norm at step {self.step_label()}; the update was not applied")
        self.optimizer.step()
        if not all(torch.isfinite(p).all() for p in self.params):
            raise TrainingDivergedError(
                f"non-finite weights after the update at step {self.step_label()}; the last checkpoint is intact. "
                "Try a lower algorithm.lr."
            )
        self.scheduler.step()
        sums["grad_norm"] = float(grad_norm)
        sums["lr"] = lr
        return sums, token_sums, tokens, ratio_max
