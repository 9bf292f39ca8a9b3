"""The trainer in-process: a real tiny policy, a real update, and what happens when the loss is not finite."""

import pytest
import torch

from conftest import compose_config
from rlexp.tasks.train_grpo import GRPOStep
from rlexp.tasks.train_sft import SFTStep
from rlexp.tracking import Trackers
from rlexp.training import update as update_module
from rlexp.training.checkpoint import latest_valid_checkpoint, verify_checkpoint
from rlexp.training.loop import TrainingRun
from rlexp.training.update import PolicyUpdate, TrainingDivergedError

QUICK = ("name=test", "eval.num_mazes=2", "rollout.max_turns=2", "rollout.max_new_tokens_per_turn=6")


class _Trainer:
    """A training run and its recipe's step, stepped by hand."""

    def __init__(self, tmp_path, *overrides):
        self.run = TrainingRun(compose_config(*QUICK, *overrides), tmp_path, Trackers([]))
        self.model = self.run.model
        self.train_step = (SFTStep if self.run.cfg.algorithm.name.value == "sft" else GRPOStep)(self.run)

    def save(self):
        return self.run.save()


def _trainer(tmp_path, *overrides):
    return _Trainer(tmp_path, *overrides)


def _lora_weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_update_changes_only_lora_weights_and_logs_the_step(tmp_path):
    # longer replies make valid actions, and so reward differences within a group, likely
    trainer = _trainer(tmp_path, "algorithm.lr=0.05", "rollout.max_turns=3", "rollout.max_new_tokens_per_turn=12")
    frozen_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    before = _lora_weights(trainer)
    metrics = {}
    for _ in range(5):  # a step can have all-equal rewards (no signal): then try the next
        metrics = trainer.train_step()
        trainer.run.step += 1
        if metrics["train/grad_norm"] > 0:
            break
    assert metrics["train/grad_norm"] > 0
    assert any(not torch.equal(before[n], p) for n, p in _lora_weights(trainer).items())
    for name, param in trainer.model.named_parameters():
        if not param.requires_grad:
            assert torch.equal(frozen_before[name], param), name
    for key in ("rollout/reward_mean", "train/loss", "train/entropy", "train/clip_frac", "timing/generate_s"):
        assert key in metrics


def test_ratio_is_exactly_one_on_the_first_mini_batch(tmp_path, monkeypatch):
    """score()'s recomputed old log-probs are the update's own (forced: this step could skip it)."""
    monkeypatch.setattr(PolicyUpdate, "exactly_on_policy", lambda *_: False)
    trainer = _trainer(tmp_path, "algorithm.train_batch_size=2", "algorithm.policy_mini_batch_size=2")
    metrics = trainer.train_step()
    assert metrics["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["train/clip_frac"] == 0.0


def test_an_exactly_on_policy_step_skips_the_scoring_pass_and_takes_the_same_step(tmp_path, monkeypatch):
    """One mini-batch, one epoch, no KL: the update's forward gives the old log-probs; the weights it
    reaches equal those of the step that scores them in a pass of its own."""
    overrides = ("algorithm.train_batch_size=2", "algorithm.policy_mini_batch_size=2", "algorithm.lr=0.05",
                 "rollout.max_turns=3", "rollout.max_new_tokens_per_turn=12")
    runs = {}
    for skip in (True, False):
        if not skip:
            monkeypatch.setattr(PolicyUpdate, "exactly_on_policy", lambda *_: False)
        trainer = _trainer(tmp_path / f"skip{skip}", *overrides)
        steps = []
        for _ in range(3):
            steps.append(trainer.train_step())
            trainer.run.step += 1
        runs[skip] = steps, _lora_weights(trainer)
    (fast, fast_weights), (slow, slow_weights) = runs[True], runs[False]
    assert any(m["train/grad_norm"] > 0 for m in fast), "no step had a learning signal"
    for f, s in zip(fast, slow):
        assert f["timing/score_s"] == 0.0 and s["timing/score_s"] > 0.0
        assert f["rollout/logprob_gap"] < 1e-5 and s["rollout/logprob_gap"] < 1e-5
        assert f["train/ratio_mean"] == 1.0
        assert f["train/grad_norm"] == pytest.approx(s["train/grad_norm"], rel=1e-4, abs=1e-7)
    for name, weight in fast_weights.items():
        torch.testing.assert_close(weight, slow_weights[name], atol=1e-6, rtol=0)


def test_non_finite_loss_stops_with_clear_error_and_keeps_checkpoint(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path)
    checkpoint = trainer.save()
    before = _lora_weights(trainer)
    real_token_logprobs = update_module.token_logprobs

    def nan_when_training(model, batch, temperature, suppressed_ids=()):
        logprobs, entropy = real_token_logprobs(model, batch, temperature, suppressed_ids)
        return (logprobs * float("nan") if torch.is_grad_enabled() else logprobs), entropy

    monkeypatch.setattr(update_module, "token_logprobs", nan_when_training)
    with pytest.raises(TrainingDivergedError, match="non-finite loss.*checkpoint"):
        trainer.train_step()
    assert verify_checkpoint(checkpoint) is None
    assert latest_valid_checkpoint(tmp_path / "checkpoints") == checkpoint
    for name, weight in _lora_weights(trainer).items():
        assert torch.equal(before[name], weight), name


def test_all_zero_rewards_give_zero_loss_not_nan(tmp_path):
    trainer = _trainer(tmp_path, "env.format_reward=0.0")  # the untrained toy policy never solves a maze
    metrics = trainer.train_step()
    assert metrics["rollout/reward_mean"] == 0.0
    assert metrics["train/loss"] == 0.0 and metrics["train/grad_norm"] == 0.0


def test_sft_trains_on_expert_replies(tmp_path):
    trainer = _trainer(tmp_path, "algorithm=sft", "rollout.max_turns=4")
    first = trainer.train_step()["train/loss"]
    for _ in range(3):
        last = trainer.train_step()["train/loss"]
    assert first > 0 and last < first


def test_train_min_expert_length_reaches_the_mazes_a_step_plays(tmp_path):
    from rlexp.envs.maze import expert_actions

    run = TrainingRun(
        compose_config(*QUICK, "rollout.max_turns=20", "env.train_min_expert_length=17", "algorithm.train_batch_size=8",
                       "algorithm.policy_mini_batch_size=8"),
        tmp_path, Trackers([]),
    )
    assert sorted({len(expert_actions(maze)) for maze in run.mazes()}) == [17]
    assert run.stream.state_dict()["min_expert_length"] == 17  # saved with each checkpoint, checked on resume
