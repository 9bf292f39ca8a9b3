"""The update's log-probs (vocabulary projected at the loss-masked positions only, chunked, recomputed in
backward) equal the plain computation -- full ``model(...).logits``, masked, log-softmax at the
engine's temperature -- in value and in the gradient they give the LoRA weights (fp32, CPU)."""

import json
import os
import subprocess
import sys

import torch
from omegaconf import OmegaConf

from conftest import REPO, compose_config
from rlexp.envs import load_pinned
from rlexp.models import apply_lora, load_model_and_processor, never_generated_ids, resolve_model_path
from rlexp.rollout.conversation import TurnFormatter, training_sequences
from rlexp.rollout.driver import run_rollouts, stop_strings
from rlexp.rollout.engine import SamplingParams
from rlexp.rollout.hf_engine import HFEngine
from rlexp.training import batching
from rlexp.training.batching import collate, token_logprobs

TEMPERATURE = 0.7


def plain_logprobs(model, batch, temperature, suppressed_ids):
    """What a plain transformers step computes: every position's logits over the whole vocabulary."""
    inputs = {k: v for k, v in batch.items() if k != "loss_mask"}
    logits = model(**inputs, use_cache=False).logits[:, :-1].float()
    logits = logits.index_fill(-1, torch.tensor(suppressed_ids), float("-inf")) / temperature
    labels = batch["input_ids"][:, 1:]
    return torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _policy_and_batch():
    model, processor = load_model_and_processor(resolve_model_path("tiny"))
    policy = apply_lora(model, 8, 16, 0.0, "all-linear-language")
    torch.manual_seed(0)
    for name, param in policy.named_parameters():  # a non-zero adapter, so every LoRA weight gets a gradient
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    formatter = TurnFormatter(processor)
    env = OmegaConf.merge(compose_config("name=test").env, {"history_window": None})
    trajectories = run_rollouts(
        HFEngine(policy, processor), formatter, load_pinned("maze_easy")[:2], env, 2,
        SamplingParams(TEMPERATURE, 1.0, 6, stop_strings("visgym_tuple")), max_turns=3,
    )
    sequences = [s for t in trajectories for s in training_sequences(formatter, t, None)]
    batch = collate(sequences, processor.tokenizer.pad_token_id, policy.config, torch.device("cpu"))
    return policy, batch, never_generated_ids(processor.tokenizer)


def test_fast_logprobs_and_their_gradients_equal_the_plain_full_vocabulary_computation(monkeypatch):
    policy, batch, suppressed = _policy_and_batch()
    mask = batch["loss_mask"].bool()
    lengths = batch["attention_mask"].sum(1)
    assert mask.sum() > 10 and lengths.min() < lengths.max()  # right padding is exercised
    monkeypatch.setattr(batching, "LOGPROB_CHUNK", 7)  # several chunks, the last one partial
    policy.train()
    weights = torch.linspace(-1.0, 1.0, int(mask.sum()))  # a loss that weighs every token differently

    def grads(logprobs):
        policy.zero_grad(set_to_none=True)
        (logprobs[mask] * weights).sum().backward()
        return {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}

    plain = plain_logprobs(policy, batch, TEMPERATURE, suppressed)
    plain_grads = grads(plain)
    fast, entropy = token_logprobs(policy, batch, TEMPERATURE, suppressed)
    fast_grads = grads(fast)

    torch.testing.assert_close(fast[mask], plain[mask].detach(), atol=1e-5, rtol=0)
    assert (fast[~mask] == 0).all() and (entropy[~mask] == 0).all()
    assert (entropy[mask] > 0).all()
    assert plain_grads.keys() == fast_grads.keys() and all(g.abs().sum() > 0 for g in plain_grads.values())
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fast_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_update_benchmark_runs_at_the_tiny_size_and_its_log_probs_match(tmp_path):
    """``bench/update_step.py --size tiny``: on CPU a check of the numerics (speed is measured on the GPU)."""
    result = subprocess.run(
        [sys.executable, "bench/update_step.py", "--size", "tiny", "--sequences", "4", "--steps", "1", "--out", str(tmp_path)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "update_step.json").read_text())
    assert report["scored_tokens"] == 4 * 3 * 64  # every reply token of 3 turns, and nothing else
    assert report["logprob_max_abs_diff"] < 1e-5
    assert set(report["variants"]) == {"plain", "rlexp_scored", "rlexp_on_policy"}
    assert all(v["step_s"] > 0 and v["tokens_per_s"] > 0 for v in report["variants"].values())
    assert "rlexp_on_policy" in result.stdout and "x plain" in result.stdout
