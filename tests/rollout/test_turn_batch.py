"""rollout=turn_batch: episodes played as tensors are the driver's episodes, and the update scores each
turn as it was sampled."""

from pathlib import Path

import numpy as np
import numpy as np
import pytest
import torch

from conftest import compose_config
from rlexp.envs import load_pinned, parse_action
from rlexp.models import load_policy
from rlexp.rollout.conversation import TurnFormatter
from rlexp.rollout.driver import run_rollouts
from rlexp.rollout.engine import SamplingParams
from rlexp.rollout.turn_batch import TurnBatchEngine
from rlexp.tasks.train_grpo import GRPOStep
from rlexp.tracking import Trackers
from rlexp.training.loop import TrainingRun

pytestmark = pytest.mark.slow

WARM_START = Path(__file__).resolve().parents[2] / "checkpoints" / "maze_sft_warm_seed0"
REPRO = ("experiment=tiny_maze_repro", "name=test", "cluster=local_cpu", "rollout=turn_batch", f"model.path={WARM_START}")


def test_greedy_play_is_the_drivers_greedy_episode():
    """From the warm start, whose full-vocabulary argmax is always a move, the constrained greedy episodes
    equal the driver's through transformers generate: the same frames, turn texts and so the same moves."""
    cfg = compose_config(*REPRO)
    model, processor = load_policy(cfg.model, "cpu")
    engine = TurnBatchEngine(model, processor)
    mazes = load_pinned("maze_easy")[:4]
    played = engine.play(mazes, cfg.env, 1, 0.0, 20)
    trajectories = run_rollouts(engine, TurnFormatter(processor), mazes, cfg.env, 1, SamplingParams(0.0, 1.0, 2), 20)
    for e, trajectory in enumerate(trajectories):
        n = trajectory.num_turns
        assert int(played.taken[e].sum()) == n
        moves = [parse_action(turn.response_text, "visgym_tuple")[0] for turn in trajectory.turns]
        assert played.actions[e, :n].tolist() == moves
        assert [tuple(p) for p in played.positions[e, :n].tolist()] == [turn.position for turn in trajectory.turns]
        assert bool(played.success[e]) == trajectory.success and float(played.rewards[e]) == trajectory.reward
    assert 0 < int(played.success.sum()) < len(mazes)  # both outcomes are compared


@pytest.mark.parametrize("autocast", ["null", "bfloat16"])
def test_a_grpo_step_scores_what_it_sampled_and_learns(tmp_path, autocast):
    """Two mini-batches, so the old log-probs are scored before the update: they equal the sampled ones
    (under autocast too: play and scoring run the same forward), and the step moves the LoRA weights."""
    cfg = compose_config(
        *REPRO, f"rollout.engine.autocast={autocast}", "algorithm.train_batch_size=2", "algorithm.n_samples_per_prompt=4", "algorithm.policy_mini_batch_size=1",
        "algorithm.micro_batch_size=32",
    )
    run = TrainingRun(cfg, tmp_path, Trackers([]))
    lora = {n: p.detach().clone() for n, p in run.model.named_parameters() if p.requires_grad}
    for _ in range(4):  # a step whose groups all agree carries no gradient: take the first that differs
        metrics = GRPOStep(run)()
        run.step += 1
        if metrics["train/grad_norm"] > 0:
            break
    assert metrics["train/grad_norm"] > 0, metrics
    assert metrics["rollout/logprob_gap"] < 1e-5
    assert metrics["rollout/invalid_action_rate"] == 0 and metrics["train/optimizer_steps"] == 2
    assert all(v == v and abs(v) != float("inf") for v in metrics.values())
    moved = [n for n, p in run.model.named_parameters() if p.requires_grad and not torch.equal(p.detach(), lora[n])]
    assert moved


def test_autocast_runs_the_fast_forward_in_bfloat16():
    """``rollout.engine.autocast=bfloat16`` changes the forward's numbers (so it is applied), not its moves."""
    cfg = compose_config(*REPRO)
    model, processor = load_policy(cfg.model, "cpu")
    exact, autocast = TurnBatchEngine(model, processor), TurnBatchEngine(model, processor, autocast="bfloat16")
    mazes = load_pinned("maze_easy")[:8]
    walls = torch.tensor(np.stack([m.grid for m in mazes]))
    positions, goals = torch.tensor([m.start for m in mazes]), torch.tensor([m.goal for m in mazes])
    variants = torch.zeros(len(mazes), dtype=torch.long)
    logits = []
    for engine in (exact, autocast):
        engine.prepare(cfg.env)
        with torch.no_grad():
            logits.append(engine.action_logits(walls, positions, goals, variants))
    assert not torch.equal(logits[0], logits[1])
    torch.testing.assert_close(logits[1], logits[0], atol=0.25, rtol=0)  # measured: 0.1 at most, logits up to 8
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))




def test_a_grpo_step_with_a_kl_term_scores_the_reference_through_the_fast_forward(tmp_path):
    """``algorithm.kl_coef > 0``: the reference is the policy with its adapter off, scored by the same fast
    forward. With the adapter moved off zero before the step, the policy differs from the reference at the
    step's first (only) optimizer step already: a reference scored with the adapter on would give KL 0."""
    cfg = compose_config(
        *REPRO, "algorithm.kl_coef=0.5", "algorithm.train_batch_size=2", "algorithm.n_samples_per_prompt=4",
        "algorithm.policy_mini_batch_size=2", "algorithm.micro_batch_size=32",
    )
    run = TrainingRun(cfg, tmp_path, Trackers([]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in run.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    metrics = GRPOStep(run)()
    assert metrics["train/optimizer_steps"] == 1 and metrics["rollout/logprob_gap"] < 1e-5
    assert metrics["train/kl"] > 1e-6 and metrics["train/kl_loss"] > 0, metrics


def test_the_engines_old_logprobs_give_the_trainers_update_without_its_scoring_pass(tmp_path):
    """``algorithm.old_logprobs=engine``: the log-probs recorded in play stand for the scoring pass, which
    turn_batch makes with the same forward. The same step (same seed, two mini-batches) takes the same
    update either way, and with ``engine`` no scoring pass runs."""
    overrides = (
        *REPRO, "algorithm.train_batch_size=2", "algorithm.n_samples_per_prompt=4", "algorithm.policy_mini_batch_size=1",
        "algorithm.micro_batch_size=32",
    )
    steps, updates = {}, {}
    for source in ("trainer", "engine"):
        run = TrainingRun(compose_config(*overrides, f"algorithm.old_logprobs={source}"), tmp_path / source, Trackers([]))
        lora = [p for p in run.model.parameters() if p.requires_grad]
        before = torch.cat([p.detach().flatten() for p in lora])
        steps[source] = GRPOStep(run)()
        updates[source] = torch.cat([p.detach().flatten() for p in lora]) - before
    trainer, engine = steps["trainer"], steps["engine"]
    assert trainer["timing/score_s"] > 0 and engine["timing/score_s"] == 0
    assert engine["train/optimizer_steps"] == 2 and engine["rollout/logprob_gap"] < 1e-5
    assert trainer["train/grad_norm"] > 0  # a step with a gradient is compared
    for key in ("train/loss", "train/pg_loss", "train/ratio_mean", "train/clip_frac", "train/grad_norm"):
        assert engine[key] == pytest.approx(trainer[key], rel=1e-4, abs=1e-6), key
    # Adam divides by the gradient's size: where a gradient is ~0, summation-order noise of 1e-7 in the old
    # log-probs moves a weight by up to the lr, so the updates are compared as a whole
    cosine = torch.nn.functional.cosine_similarity(updates["engine"], updates["trainer"], dim=0)
    assert cosine > 0.999, float(cosine)
