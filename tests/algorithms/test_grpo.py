"""GRPO / SFT tensor functions against values computed by hand (written out as literals)."""

from __future__ import annotations

import math

import pytest
import torch

from rlexp.algorithms.grpo import (
    group_advantages,
    kl_k3,
    loss_normalizer,
    masked_mean,
    nonzero_variance_groups,
    policy_loss,
    reduce_loss,
    selective_log_softmax,
    sft_loss,
    token_logprobs_and_entropy,
)

T = torch.tensor


def close(a, b, atol=1e-6):
    a = torch.as_tensor(a, dtype=torch.float64)
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=torch.float64), atol=atol, rtol=0)


# ------------------------------------------------------------------------------------ advantages


def test_advantages_one_group_hand_values():
    # mean 0.25; deviations .75 -.25 -.25 -.25; unbiased var = (.5625 + 3 * .0625) / 3 = .25 -> std .5
    adv = group_advantages(T([1.0, 0.0, 0.0, 0.0]), group_size=4)
    close(adv, [1.5, -0.5, -0.5, -0.5], atol=1e-5)


def test_advantages_two_groups_group_major():
    # group 2: mean .5, unbiased std sqrt(1/3) = .5773503 -> +-.5 / .5773503 = +-.8660254
    adv = group_advantages(T([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]), group_size=4)
    close(adv, [1.5, -0.5, -0.5, -0.5, 0.8660254, 0.8660254, -0.8660254, -0.8660254], atol=1e-5)


def test_advantages_eps_is_added_to_std():
    adv = group_advantages(T([1.0, 0.0]), group_size=2, eps=0.5)
    # mean .5, unbiased std sqrt(.5) = .7071068 -> .5 / 1.2071068 = .4142136
    close(adv, [0.4142136, -0.4142136])


def test_advantages_without_std_division_dr_grpo():
    adv = group_advantages(T([1.0, 0.0, 0.0, 0.0, 0.5, 0.0]), group_size=3, norm_by_std=False)
    # groups (1, 0, 0): mean 1/3; (0, .5, 0): mean 1/6
    close(adv, [2 / 3, -1 / 3, -1 / 3, -1 / 6, 1 / 3, -1 / 6])


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_zero_variance_groups_give_exact_zeros_not_nan(norm_by_std):
    rewards = T([0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.7, 0.7, 0.7, 0.7])
    adv = group_advantages(rewards, group_size=4, norm_by_std=norm_by_std)
    assert not torch.isnan(adv).any()
    assert torch.equal(adv, torch.zeros(12))


def test_advantages_accept_integer_and_bf16_rewards():
    close(group_advantages(T([1, 0, 0, 0]), 4), [1.5, -0.5, -0.5, -0.5], atol=1e-5)
    close(group_advantages(T([1.0, 0, 0, 0], dtype=torch.bfloat16), 4), [1.5, -0.5, -0.5, -0.5], atol=1e-5)


def test_advantages_bad_shapes():
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(T([1.0, 0.0]), group_size=1)
    assert torch.equal(group_advantages(T([1.0, 0.0]), group_size=1, norm_by_std=False), torch.zeros(2))
    with pytest.raises(ValueError, match="multiple"):
        group_advantages(T([1.0, 0.0, 1.0]), group_size=2)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), group_size=2)


def test_nonzero_variance_groups_mask():
    mask = nonzero_variance_groups(T([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5]), 4)
    assert mask.tolist() == [True] * 4 + [False] * 4 + [True] * 4
    assert nonzero_variance_groups(T([1.0, 0.0]), 1).tolist() == [False, False]


# ------------------------------------------------------------------------------------ reductions


def test_masked_mean_ignores_masked_nan_and_uses_normalizer():
    x = T([[1.0, 2.0, float("nan")], [float("inf"), 5.0, 6.0]])
    mask = T([[1, 1, 0], [0, 0, 1]])
    close(masked_mean(x, mask), 3.0)  # (1 + 2 + 6) / 3
    close(masked_mean(x, mask, normalizer=6), 1.5)
    close(masked_mean(x, torch.zeros(2, 3)), 0.0)  # empty mask -> 0, not NaN


def test_reductions_hand_values():
    loss_tok = T([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]])
    mask = T([[1, 1, 1, 0], [1, 0, 0, 0]])
    close(reduce_loss(loss_tok, mask, "token_mean"), 4.0)  # (1 + 2 + 3 + 10) / 4
    close(reduce_loss(loss_tok, mask, "sequence_mean"), 6.0)  # (2 + 10) / 2
    close(reduce_loss(loss_tok, mask, "seq_mean_token_sum_norm", max_seq_len=8), 1.0)  # (6/8 + 10/8) / 2
    with pytest.raises(ValueError, match="max_seq_len"):
        reduce_loss(loss_tok, mask, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="unknown loss_reduction"):
        reduce_loss(loss_tok, mask, "mean")


def test_loss_normalizer_counts():
    mask = T([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert loss_normalizer(mask, "token_mean") == 4
    assert loss_normalizer(mask, "sequence_mean") == 2
    assert loss_normalizer(mask, "seq_mean_token_sum_norm") == 2


# ------------------------------------------------------------------------------------ policy loss


def _ratio_one_batch():
    logprobs = T([[-1.0, -2.0, -3.0], [-0.5, -0.1, -9.0]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    adv = T([1.5, -0.5])
    return logprobs, mask, adv


def test_ratio_one_loss_is_minus_mean_advantage_each_reduction():
    logprobs, mask, adv = _ratio_one_batch()
    # token_mean: tokens carry 1.5, 1.5, -.5 -> mean .8333333
    loss, m = policy_loss(logprobs, logprobs.clone(), adv, mask, loss_reduction="token_mean")
    close(loss, -2.5 / 3)
    close(m["ratio_mean"], 1.0)
    close(m["clip_frac"], 0.0)
    close(m["approx_kl"], 0.0)
    # sequence_mean: per sequence 1.5 and -.5 -> .5
    loss, _ = policy_loss(logprobs, logprobs.clone(), adv, mask, loss_reduction="sequence_mean")
    close(loss, -0.5)
    # Dr. GRPO: sums 3.0 and -.5, / 4 -> .75 and -.125, mean .3125
    loss, _ = policy_loss(
        logprobs, logprobs.clone(), adv, mask, loss_reduction="seq_mean_token_sum_norm", max_seq_len=4
    )
    close(loss, -0.3125)


def _one_token(ratio: float, adv: float, eps_low=0.2, eps_high=0.2):
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss, m = policy_loss(logp, old, T([adv], dtype=torch.float64), torch.ones(1, 1), eps_low, eps_high)
    loss.backward()
    return loss.item(), m, logp.grad.item()


@pytest.mark.parametrize(
    "ratio, adv, want_loss, want_clip, want_grad",
    [
        # A > 0: the ratio is capped above at 1 + eps_high; below 1 - eps_low the unclipped term is the min
        (1.5, 1.0, -1.2, 1.0, 0.0),
        (0.5, 1.0, -0.5, 0.0, -0.5),  # d(-r * A)/dlogp = -r * A
        (1.1, 1.0, -1.1, 0.0, -1.1),
        # A < 0: the ratio is capped below at 1 - eps_low; above 1 + eps_high the unclipped term is the min
        (0.5, -1.0, 0.8, 1.0, 0.0),
        (1.5, -1.0, 1.5, 0.0, 1.5),
        (0.9, -2.0, 1.8, 0.0, 1.8),
    ],
)
def test_clipping_cases(ratio, adv, want_loss, want_clip, want_grad):
    loss, m, grad = _one_token(ratio, adv)
    close(loss, want_loss)
    close(m["clip_frac"], want_clip)
    close(grad, want_grad)
    close(m["ratio_max"], ratio)


def test_asymmetric_clip_higher():
    loss, m, grad = _one_token(1.5, 1.0, eps_low=0.2, eps_high=0.28)
    close(loss, -1.28)
    loss, m, grad = _one_token(0.5, -1.0, eps_low=0.1, eps_high=0.28)
    close(loss, 0.9)


def test_approx_kl_metric_hand_value():
    _, m, _ = _one_token(1.5, 1.0)
    close(m["approx_kl"], 0.5 - math.log(1.5))  # (r - 1) - log r = .0945349


def test_token_level_advantages_and_masked_garbage():
    logp = T([[0.0, 0.0, float("-inf")]])
    old = T([[0.0, 0.0, 0.0]])
    adv = T([[2.0, 4.0, 100.0]])
    loss, m = policy_loss(logp, old, adv, T([[1, 1, 0]]))
    close(loss, -3.0)
    assert torch.isfinite(m["ratio_max"])


def test_token_mean_micro_batches_with_global_normalizer_equal_one_batch():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    old = logp + 0.3 * (torch.rand(4, 6, generator=g, dtype=torch.float64) - 0.5)
    adv = T([1.0, -0.5, 0.25, 2.0], dtype=torch.float64)
    mask = T([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    ref = logp - 0.1
    for reduction in ("token_mean", "sequence_mean", "seq_mean_token_sum_norm"):
        kw = dict(loss_reduction=reduction, max_seq_len=6, ref_logprobs=None, kl_coef=0.1)
        full, _ = policy_loss(logp, old, adv, mask, **{**kw, "ref_logprobs": ref})
        n = loss_normalizer(mask[:2], reduction) + loss_normalizer(mask[2:], reduction)
        parts = [
            policy_loss(logp[s], old[s], adv[s], mask[s], normalizer=n, **{**kw, "ref_logprobs": ref[s]})[0]
            for s in (slice(0, 2), slice(2, 4))
        ]
        close(parts[0] + parts[1], full, atol=1e-12)
    # without the global normaliser, token_mean of micro-batch means is NOT the batch mean here
    a = policy_loss(logp[:2], old[:2], adv[:2], mask[:2])[0]
    b = policy_loss(logp[2:], old[2:], adv[2:], mask[2:])[0]
    full = policy_loss(logp, old, adv, mask)[0]
    assert abs((a + b) / 2 - full) > 1e-3


def test_kl_k3_hand_values():
    kl = kl_k3(T([[0.0, 0.0, -1.0]]), T([[math.log(2.0), math.log(0.5), -1.0]]))
    # exp(d) - d - 1: d = ln 2 -> 2 - .6931472 - 1; d = -ln 2 -> .5 + .6931472 - 1; d = 0 -> 0
    close(kl, [[0.3068528, 0.1931472, 0.0]])


def test_kl_enters_the_loss_with_coef_not_the_advantage():
    logp = T([[0.0, 0.0]])
    ref = T([[math.log(2.0), math.log(0.5)]])
    loss, m = policy_loss(logp, logp.clone(), T([0.0]), T([[1, 1]]), ref_logprobs=ref, kl_coef=0.1)
    close(loss, 0.1 * (0.3068528 + 0.1931472) / 2)
    close(m["kl"], 0.25)
    loss, m = policy_loss(logp, logp.clone(), T([0.0]), T([[1, 1]]), ref_logprobs=ref, kl_coef=0.0)
    close(loss, 0.0)
    close(m["kl"], 0.25)  # still logged


def test_policy_loss_shape_errors():
    with pytest.raises(ValueError, match="shape"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))


def test_sft_loss_hand_value():
    logprobs = T([[-1.0, -2.0], [-3.0, -4.0]])
    mask = T([[1, 1], [1, 0]])
    close(sft_loss(logprobs, mask), 2.0)
    close(sft_loss(logprobs, mask, normalizer=4), 1.5)


# ------------------------------------------------------------------------------------ log-probs


def test_selective_log_softmax_hand_values():
    logits = T([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    logp, ent = selective_log_softmax(logits, T([[0, 1]]))
    close(logp, [[-math.log(2.0), math.log(0.75)]])
    # entropy of (.25, .75) = -(.25 ln .25 + .75 ln .75) = .5623351
    close(ent, [[math.log(2.0), 0.5623351]])
    # temperature 2 halves the logits: (0, ln 3 / 2) -> p = (1 / (1 + sqrt 3), sqrt 3 / (1 + sqrt 3))
    logp, _ = selective_log_softmax(logits, T([[0, 1]]), temperature=2.0)
    close(logp[0, 1], math.log(math.sqrt(3.0) / (1.0 + math.sqrt(3.0))))


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1000])
def test_selective_log_softmax_matches_full_log_softmax(chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 50, generator=g, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, 50, (3, 5), generator=g)
    labels[1, 2] = -100
    logp, ent = selective_log_softmax(logits, labels, chunk_size=chunk_size)

    ref_logits = logits.detach().clone().requires_grad_()
    full = torch.log_softmax(ref_logits.float(), dim=-1)
    ref_logp = full.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ref_logp = torch.where(labels >= 0, ref_logp, torch.zeros_like(ref_logp))
    ref_ent = -(full.exp() * full).sum(-1)
    ref_ent = torch.where(labels >= 0, ref_ent, torch.zeros_like(ref_ent))
    close(logp, ref_logp.detach())
    close(ent, ref_ent.detach())
    assert not ent.requires_grad

    w = torch.randn(3, 5, generator=g)
    (logp * w).sum().backward()
    (ref_logp * w).sum().backward()
    close(logits.grad, ref_logits.grad)
    assert torch.all(logits.grad[1, 2] == 0)


def test_selective_log_softmax_bf16_input_gives_fp32_and_bf16_grad():
    g = torch.Generator().manual_seed(1)
    logits32 = torch.randn(2, 4, 64, generator=g)
    logits = logits32.to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 64, (2, 4), generator=g)
    logp, _ = selective_log_softmax(logits, labels, chunk_size=3)
    assert logp.dtype == torch.float32
    ref = torch.log_softmax(logits.detach().float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    close(logp, ref)
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_token_logprobs_from_hidden_match_logits_path():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 8, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 40, (2, 5), generator=g)
    labels[0, 0] = -100
    logp, ent = token_logprobs_and_entropy(hidden, weight, labels, chunk_size=3, temperature=0.7)
    h2 = hidden.detach().clone().requires_grad_()
    w2 = weight.detach().clone().requires_grad_()
    ref_logp, ref_ent = selective_log_softmax(h2 @ w2.T, labels, chunk_size=100, temperature=0.7)
    close(logp, ref_logp.detach())
    close(ent, ref_ent)
    logp.sum().backward()
    ref_logp.sum().backward()
    close(hidden.grad, h2.grad)
    close(weight.grad, w2.grad)


def test_masked_out_tokens_leave_log_probs_and_entropy_finite():
    """The trainer masks the never-generated ids with -inf, as the engine does when sampling."""
    logits = torch.tensor([[[1.0, 2.0, float("-inf"), 0.5]]])
    logp, ent = selective_log_softmax(logits, torch.tensor([[1]]))
    p = torch.softmax(torch.tensor([1.0, 2.0, 0.5]), -1)
    assert torch.isfinite(ent).all()
    torch.testing.assert_close(ent[0, 0], -(p * p.log()).sum())
    torch.testing.assert_close(logp[0, 0], p[1].log())
