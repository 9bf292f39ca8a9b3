"""Where the parts meet: engine and trainer agree on log-probs, batches line up with their labels, the
driver feeds the engine the contexts the trainer later scores, and the update's metrics add up."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose_config
from rlexp.algorithms.grpo import reduce_loss
from rlexp.envs import ExpertPolicy, format_action, load_pinned
from rlexp.models import never_generated_ids
from rlexp.rollout.conversation import Sequence, TurnFormatter, context_tokens, training_sequences
from rlexp.rollout.driver import run_rollouts, scripted_trajectories, stop_strings
from rlexp.rollout.engine import GenerationOutput, SamplingParams
from rlexp.rollout.hf_engine import HFEngine
from rlexp.tasks.train_grpo import GRPOStep
from rlexp.tasks.train_sft import SFTStep
from rlexp.tracking import Trackers
from rlexp.training import update as update_module
from rlexp.training.batching import collate, token_logprobs
from rlexp.training.loop import TrainingRun
from rlexp.training.update import PolicyUpdate, Sample

#: the default env (maze_easy as composed), full history
ENV = compose_config("name=test", "env.history_window=null").env


def _samples(formatter, trajectories, history_window=None):
    return [
        Sample(sequence, 1.0, group=t.maze_index, trajectory=i)
        for i, t in enumerate(trajectories)
        for sequence in training_sequences(formatter, t, history_window)
    ]


def _updater(model, processor, **algorithm):
    algo = OmegaConf.create({"policy_mini_batch_size": 1, "micro_batch_size": 3, "epochs_per_step": 1, "max_grad_norm": 1.0, **algorithm})
    return PolicyUpdate(model, None, None, algo, processor.tokenizer.pad_token_id, never_generated_ids(processor.tokenizer), lambda: 1)


@pytest.mark.parametrize("history_window", [None, 2])
def test_engine_logprobs_equal_the_trainers_recomputation_at_temperature_0_7(tiny_policy, history_window):
    model, processor = tiny_policy
    formatter = TurnFormatter(processor)
    env = OmegaConf.merge(ENV, {"history_window": history_window})
    torch.manual_seed(0)
    trajectories = run_rollouts(
        HFEngine(model, processor), formatter, load_pinned("maze_easy")[:2], env, 2,
        SamplingParams(0.7, 1.0, 6, stop_strings("visgym_tuple")), max_turns=3,
    )
    samples = _samples(formatter, trajectories, history_window)
    assert sum(sum(s.sequence.loss_mask) for s in samples) > 10
    gap = _updater(model, processor).score(samples, temperature=0.7, reference=False)["rollout/logprob_gap"]
    assert gap < 1e-5
    # and token by token, on every sampled token
    for sample in samples:
        mask = torch.tensor(sample.sequence.loss_mask[1:], dtype=torch.bool)
        engine = torch.tensor(sample.sequence.engine_logprobs[1:])
        torch.testing.assert_close(sample.old_logprobs[mask], engine[mask], atol=1e-5, rtol=0)


def test_the_gap_metric_sees_a_trainer_that_scores_a_different_distribution(tiny_policy):
    model, processor = tiny_policy
    formatter = TurnFormatter(processor)
    torch.manual_seed(1)
    trajectories = run_rollouts(
        HFEngine(model, processor), formatter, load_pinned("maze_easy")[:1], ENV, 2,
        SamplingParams(0.7, 1.0, 6, []), max_turns=2,
    )
    samples = _samples(formatter, trajectories)
    # scoring at the wrong temperature must show up as a gap
    assert _updater(model, processor).score(samples, temperature=1.0, reference=False)["rollout/logprob_gap"] > 1e-3


def test_checkpoint_generation_settings_are_not_inherited(tiny_policy):
    """A generation_config.json with top_k=1 and a repetition penalty would make sampling greedy and
    bend the recorded log-probs away from what the trainer scores."""
    model, processor = tiny_policy
    formatter = TurnFormatter(processor)
    base = model.get_base_model()
    saved = base.generation_config
    base.generation_config = type(saved)(top_k=1, repetition_penalty=5.0, temperature=0.1)
    try:
        torch.manual_seed(2)
        trajectories = run_rollouts(
            HFEngine(model, processor), formatter, load_pinned("maze_easy")[:1], ENV, 6,
            SamplingParams(1.0, 1.0, 6, []), max_turns=1,
        )
    finally:
        base.generation_config = saved
    replies = {tuple(t.turns[0].response_ids) for t in trajectories}
    assert len(replies) > 1, "six samples at temperature 1 came out identical: top_k=1 was inherited"
    samples = _samples(formatter, trajectories)
    assert _updater(model, processor).score(samples, temperature=1.0, reference=False)["rollout/logprob_gap"] < 1e-5


def test_collate_and_token_logprobs_line_up_with_the_next_token(tiny_policy):
    model, processor = tiny_policy
    model.eval()
    short = Sequence([5, 6, 7, 8], [0, 0, 1, 1], [0.0] * 4, None)
    long = Sequence([9, 10, 11, 12, 13, 14], [0, 1, 1, 0, 1, 1], [0.0] * 6, None)
    batch = collate([short, long], processor.tokenizer.pad_token_id, model.config, torch.device("cpu"))
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0, 0], [1, 1, 0, 1, 1]]
    mask = batch["loss_mask"].bool()
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, batch, temperature=0.7)
        assert (logprobs[~mask] == 0).all()  # scored where the loss reads only
        for row, sequence in enumerate([short, long]):
            ids = torch.tensor([sequence.token_ids])
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float() / 0.7
            expected = torch.log_softmax(logits, -1)[torch.arange(len(ids[0]) - 1), ids[0, 1:]]
            scored = mask[row, : len(ids[0]) - 1]
            torch.testing.assert_close(logprobs[row, : len(ids[0]) - 1][scored], expected[scored], atol=1e-5, rtol=0)


def test_micro_batches_hold_sequences_of_similar_length(tiny_policy):
    model, processor = tiny_policy
    lengths = [10, 3, 9, 4, 8]
    samples = [Sample(Sequence(list(range(5, 5 + n)), [0] + [1] * (n - 1), [0.0] * n, None), 1.0, 0, i) for i, n in enumerate(lengths)]
    micro = _updater(model, processor, micro_batch_size=2).micro_batches(samples)
    assert [[len(s.sequence.token_ids) for s in m.samples] for m in micro] == [[3, 4], [8, 9], [10]]
    assert [tuple(m.batch["input_ids"].shape) for m in micro] == [(2, 4), (2, 9), (1, 10)]  # little padding
    # each row's per-trajectory token count follows its sample
    assert [m.trajectory_tokens.tolist() for m in micro] == [[2.0, 3.0], [7.0, 8.0], [9.0]]


def test_driver_gives_the_engine_the_contexts_the_trainer_scores(tiny_processor):
    formatter = TurnFormatter(tiny_processor)
    mazes = load_pinned("maze_easy")[:1]
    tokenizer = tiny_processor.tokenizer
    asked = []
    expert = ExpertPolicy()

    class ScriptedEngine:
        """A test double of the engine contract: replays the expert's replies and records what it was asked."""

        def generate(self, requests, params):
            asked.append(requests)
            return replies.pop(0)

    # the expert's replies, from a scripted run (reply ids = the action's tokens + EOS)
    scripted = scripted_trajectories(expert, mazes, ENV, 1, 20, formatter)[0]
    assert scripted.success
    replies = [[GenerationOutput(t.response_ids, [-0.25] * len(t.response_ids), t.response_text, "stop")] for t in scripted.turns]
    (played,) = run_rollouts(ScriptedEngine(), formatter, mazes, ENV, 1, SamplingParams(), max_turns=20)
    assert played.success and played.reward == 1.0 and played.num_turns == scripted.num_turns
    assert played.turns[-1].response_text == format_action(4, "visgym_tuple")
    for turn_index, (request,) in enumerate(asked):
        context = context_tokens(formatter, played, turn_index, None)
        assert request.prompt_token_ids == context.token_ids
        assert len(request.images) == turn_index + 1 and all(isinstance(i, np.ndarray) for i in request.images)
    (sequence,) = training_sequences(formatter, played, None)
    assert sequence.token_ids[: len(asked[-1][0].prompt_token_ids)] == asked[-1][0].prompt_token_ids
    assert [lp for lp, m in zip(sequence.engine_logprobs, sequence.loss_mask) if m] == [-0.25] * sum(sequence.loss_mask)
    assert tokenizer.decode([t for t, m in zip(sequence.token_ids, sequence.loss_mask) if m]).count("move") >= 12


def test_a_trajectory_split_over_rows_reduces_like_one_row():
    """sequence_mean / Dr. GRPO with a history window: one trajectory gives one row per turn, and
    the loss must still be one mean (or sum / constant) per trajectory, not per row."""
    loss_a = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    loss_b = torch.tensor([[10.0, 20.0, 0.0, 0.0, 0.0]])
    mask_a = torch.ones(1, 5)
    mask_b = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0]])
    split = torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0], [10.0, 20.0, 0.0]])
    split_mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    for reduction in ("sequence_mean", "seq_mean_token_sum_norm"):
        whole = reduce_loss(torch.cat([loss_a, loss_b]), torch.cat([mask_a, mask_b]), reduction, max_seq_len=8)
        rows = reduce_loss(split, split_mask, reduction, normalizer=2, max_seq_len=8, sequence_tokens=torch.tensor([5, 5, 2]))
        torch.testing.assert_close(rows, whole)
    assert whole != reduce_loss(split, split_mask, "seq_mean_token_sum_norm", max_seq_len=8)


QUICK = ("name=test", "eval.num_mazes=2", "rollout.max_turns=3", "rollout.max_new_tokens_per_turn=8")


def _run(tmp_path, *overrides):
    return TrainingRun(compose_config(*QUICK, *overrides), tmp_path, Trackers([]))


def _signal_step(step):
    """A step with reward differences (the toy policy gets them through the format share)."""
    for _ in range(6):
        metrics = step()
        step.run.step += 1
        if metrics.get("train/grad_norm", 0) > 0:
            return metrics
    raise AssertionError("six steps without any reward difference")


def test_pg_loss_is_the_loss_when_kl_is_off_whatever_the_micro_batch(tmp_path):
    losses = []
    for micro in (1, 8):
        run = _run(tmp_path / str(micro), "algorithm.lr=0.05", f"algorithm.micro_batch_size={micro}", "seed=3")
        metrics = _signal_step(GRPOStep(run))
        assert metrics["train/pg_loss"] == pytest.approx(metrics["train/loss"], abs=1e-7)
        assert metrics["train/kl_loss"] == pytest.approx(0.0, abs=1e-9)
        assert all(v == v and abs(v) != float("inf") for v in metrics.values()), metrics
        losses.append(metrics["train/loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-4, abs=1e-6)


def test_train_lr_is_the_lr_the_step_used(tmp_path):
    run = _run(tmp_path, "algorithm.lr=0.3", "algorithm.lr_warmup_steps=2", "algorithm.train_batch_size=2", "algorithm.policy_mini_batch_size=2")
    step = GRPOStep(run)
    assert step()["train/lr"] == pytest.approx(0.3 / 3)
    assert step()["train/lr"] == pytest.approx(0.3 * 2 / 3)
    assert step()["train/lr"] == pytest.approx(0.3)


def test_sft_scores_at_temperature_one_without_an_old_logprob_pass(tmp_path, monkeypatch):
    run = _run(tmp_path, "algorithm=sft", "rollout.temperature=0.7")
    temperatures = []
    real = update_module.token_logprobs

    def recording(model, batch, temperature, suppressed_ids=()):
        temperatures.append((temperature, torch.is_grad_enabled()))
        return real(model, batch, temperature, suppressed_ids)

    monkeypatch.setattr(update_module, "token_logprobs", recording)
    metrics = SFTStep(run)()
    assert temperatures and all(t == (1.0, True) for t in temperatures), temperatures
    assert metrics["train/loss"] > 0 and "rollout/logprob_gap" not in metrics
