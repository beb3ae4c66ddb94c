"""Pure-math tests for grpo.core: hand-computed values, invariants, loop vs vectorized."""

import dataclasses
import math
from typing import get_args

import pytest
import torch

from grpo import core
from grpo.core import (
    AdvantageMode,
    AggMode,
    KLEstimator,
    LossSpec,
    LossType,
    aggregate_loss,
    chunked_token_logprobs,
    group_advantages,
    grpo_microbatch_step,
    kl_penalty,
    masked_mean,
    masked_normalize,
    policy_gradient_loss,
    token_entropy,
    token_logprobs,
)

# two groups of four: group 1 mean 0.5, group 2 mean 0.75
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 3.0])


# ---------------------------------------------------------------- advantages


def test_advantages_naive_is_raw_reward():
    adv, _ = group_advantages(REWARDS, 4, "naive")
    assert torch.equal(adv, REWARDS)


def test_advantages_centered_hand_values():
    adv, _ = group_advantages(REWARDS, 4, "centered")
    expected = [0.5, -0.5, -0.5, 0.5, -0.75, -0.75, -0.75, 2.25]
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_advantages_normalized_hand_values():
    # group 1: deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3, so +-0.5 * sqrt(3)
    # group 2: deviations (-0.75 x3, 2.25), unbiased var = (3 * 0.5625 + 5.0625) / 3 = 2.25, std 1.5
    adv, _ = group_advantages(REWARDS, 4, "normalized")
    h = 0.5 * math.sqrt(3.0)
    expected = [h, -h, -h, h, -0.5, -0.5, -0.5, 1.5]
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_advantage_stats_hand_values():
    _, stats = group_advantages(REWARDS, 4, "normalized")
    torch.testing.assert_close(stats["mean"], torch.tensor([0.5, 0.75]))
    torch.testing.assert_close(stats["std"], torch.tensor([math.sqrt(1 / 3), 1.5]))
    torch.testing.assert_close(stats["min"], torch.tensor([0.0, 0.0]))
    torch.testing.assert_close(stats["max"], torch.tensor([1.0, 3.0]))


def test_centered_advantages_sum_to_zero_per_group():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(6 * 5, generator=g)
    adv, _ = group_advantages(rewards, 5, "centered")
    torch.testing.assert_close(adv.view(6, 5).sum(dim=1), torch.zeros(6), atol=1e-6, rtol=0)


def test_normalized_advantages_have_unit_std_and_zero_mean():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(6 * 5, generator=g, dtype=torch.float64)
    adv, _ = group_advantages(rewards, 5, "normalized", eps=0.0)
    torch.testing.assert_close(adv.view(6, 5).std(dim=1), torch.ones(6, dtype=torch.float64))
    torch.testing.assert_close(adv.view(6, 5).mean(dim=1), torch.zeros(6, dtype=torch.float64))


def test_zero_variance_group_gives_zero_advantage_not_nan():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    adv, stats = group_advantages(rewards, 4, "normalized")
    assert not torch.isnan(adv).any()
    assert torch.equal(adv[:4], torch.zeros(4))
    assert stats["std"][0] == 0.0


def test_integer_rewards_are_accepted():
    adv, _ = group_advantages(torch.tensor([1, 0, 0, 1]), 2, "centered")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_batch_not_divisible_by_group_size_raises():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(7), 4, "centered")


def test_normalized_needs_two_samples_per_group():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(4), 1, "normalized")
    adv, stats = group_advantages(torch.ones(4), 1, "centered")  # legal, if useless
    assert torch.equal(adv, torch.zeros(4)) and not torch.isnan(stats["std"]).any()


# ---------------------------------------------------------------- masking


def _loop_reduce(x, mask, dim, fn):
    """fn(list of kept floats) over all of x (dim None) or per slice along dim; x, mask (N, M)."""
    if dim is None:
        kept = [x[i, j].item() for i in range(x.shape[0]) for j in range(x.shape[1]) if mask[i, j]]
        return torch.tensor(fn(kept))
    xs, ms = x.movedim(dim, -1), mask.bool().movedim(dim, -1)  # reduce over the last axis
    rows = [[xs[i, j].item() for j in range(xs.shape[1]) if ms[i, j]] for i in range(xs.shape[0])]
    return torch.tensor([fn(kept) for kept in rows])


def _mean(kept):
    return sum(kept) / len(kept) if kept else 0.0


@pytest.mark.parametrize("dim", [None, 0, 1, -1])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_masked_mean_matches_loop(dim, mask_dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.4
    mask[:, -1] = False  # an empty slice for dim=0 must give 0
    got = masked_mean(x, mask.to(mask_dtype), dim=dim)
    torch.testing.assert_close(got, _loop_reduce(x, mask, dim, _mean))


@pytest.mark.parametrize("dim", [None, 0, 1])
def test_masked_normalize_matches_loop(dim):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.5).float()
    expected = _loop_reduce(x, mask, dim, lambda kept: sum(kept) / 7.0)
    torch.testing.assert_close(masked_normalize(x, mask, 7.0, dim=dim), expected)


def test_masked_ops_ignore_nan_in_padding_and_empty_rows_give_zero():
    x = torch.tensor([[1.0, 3.0, float("nan")], [float("inf"), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(masked_normalize(x, mask, 2.0, dim=1), torch.tensor([2.0, 0.0]))


# ---------------------------------------------------------------- log-probs


def test_token_logprobs_and_entropy_match_loop():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 7, (2, 3), generator=g)
    lp, ent = token_logprobs(logits, labels), token_entropy(logits)
    for b in range(2):
        for t in range(3):
            p = torch.softmax(logits[b, t], dim=-1)
            torch.testing.assert_close(lp[b, t], torch.log(p)[labels[b, t]])
            torch.testing.assert_close(ent[b, t], -(p * torch.log(p)).sum())


def test_token_logprobs_gradient_is_onehot_minus_softmax():
    logits = torch.randn(1, 2, 5, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[3, 0]])
    token_logprobs(logits, labels).sum().backward()
    expected = torch.nn.functional.one_hot(labels, 5) - torch.softmax(logits.detach(), dim=-1)
    torch.testing.assert_close(logits.grad, expected)


def test_token_logprobs_are_stable_for_large_logits():
    logits = torch.tensor([[[1e4, 0.0, -1e4]]])
    lp = token_logprobs(logits, torch.tensor([[1]]))
    torch.testing.assert_close(lp, torch.tensor([[-1e4]]))
    assert torch.isfinite(token_entropy(logits)).all()


@pytest.mark.parametrize("chunk", [1, 4, 5, 100])
def test_chunked_logprobs_equal_full_logits_values_and_gradients(chunk):
    """The LM head applied chunk by chunk (recomputed in backward) gives the log-probs, entropy
    and gradients of the full (B, T, V) logits, whatever the chunk size (5: a ragged last chunk)."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(6, 11, bias=False).double()
    hidden = torch.randn(3, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (3, 4), generator=g)
    weights = torch.randn(3, 4, generator=g, dtype=torch.float64)
    grads = []
    for chunked in (False, True):
        head.zero_grad()
        hidden.grad = None
        if chunked:
            logp, ent = chunked_token_logprobs(hidden, head, labels, chunk, with_entropy=True)
        else:
            logits = head(hidden)
            logp, ent = token_logprobs(logits, labels), token_entropy(logits)
        (logp * weights).sum().backward()
        grads.append((logp.detach(), ent.detach(), hidden.grad.clone(), head.weight.grad.clone()))
    for full, chunked in zip(*grads):
        torch.testing.assert_close(chunked, full)
    assert not chunked_token_logprobs(hidden, head, labels, chunk, with_entropy=True)[1].requires_grad


def test_chunked_logprobs_and_entropy_take_one_lm_head_matmul_a_chunk():
    """With entropy, each chunk's logits give both figures: the head runs once a chunk in the forward (and once
    more in backward, recomputing them), not twice."""
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(6, 11, bias=False)
    calls = []
    head = lambda x: calls.append(len(x)) or linear(x)  # noqa: E731
    hidden = torch.randn(3, 4, 6, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (3, 4), generator=g)
    logp, _ = chunked_token_logprobs(hidden, head, labels, 5, with_entropy=True)
    assert calls == [5, 5, 2]  # 12 positions in chunks of 5
    logp.sum().backward()
    assert calls == [5, 5, 2, 2, 5, 5]  # the backward recomputes each chunk's logits once (last chunk first)


def test_token_logprobs_upcast_half_precision():
    logits = torch.randn(1, 2, 5).to(torch.bfloat16)
    assert token_logprobs(logits, torch.zeros(1, 2, dtype=torch.long)).dtype == torch.float32


def test_uniform_logits_have_entropy_log_vocab():
    expected = torch.full((2, 3), math.log(10))
    torch.testing.assert_close(token_entropy(torch.zeros(2, 3, 10)), expected)


# ---------------------------------------------------------------- policy-gradient losses

LOGPROBS = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])


def test_naive_loss_hand_values():
    loss, meta = policy_gradient_loss("naive", LOGPROBS, raw_rewards=torch.tensor([[1.0], [0.0]]))
    torch.testing.assert_close(loss, torch.tensor([[1.0, 2.0], [0.0, 0.0]]))
    assert not meta["clipped"].any() and torch.equal(meta["ratio"], torch.ones(2, 2))


def test_reinforce_baseline_loss_hand_values():
    adv = torch.tensor([[2.0], [-1.0]])
    loss, _ = policy_gradient_loss("reinforce_baseline", LOGPROBS, advantages=adv)
    torch.testing.assert_close(loss, torch.tensor([[2.0, 4.0], [-0.5, -3.0]]))


@pytest.mark.parametrize(
    "loss_type,missing", [("naive", "raw_rewards"), ("reinforce_baseline", "advantages"), ("grpo_clip", "advantages")]
)
def test_missing_argument_raises_naming_it(loss_type, missing):
    with pytest.raises(ValueError, match=missing):
        policy_gradient_loss(loss_type, LOGPROBS, old_logprobs=LOGPROBS)


def test_grpo_clip_missing_old_logprobs_raises():
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_gradient_loss("grpo_clip", LOGPROBS, advantages=torch.ones(2, 1))


def test_grpo_clip_at_ratio_one_matches_reinforce_baseline():
    adv = torch.tensor([[2.0], [-1.0]])
    lp_clip = LOGPROBS.clone().requires_grad_(True)
    loss, meta = policy_gradient_loss("grpo_clip", lp_clip, advantages=adv, old_logprobs=LOGPROBS.clone())
    loss.sum().backward()
    torch.testing.assert_close(loss.detach(), (-adv).expand(2, 2))  # -A * ratio with ratio 1
    assert meta["clipped"].float().mean() == 0.0
    lp_rb = LOGPROBS.clone().requires_grad_(True)
    policy_gradient_loss("reinforce_baseline", lp_rb, advantages=adv)[0].sum().backward()
    torch.testing.assert_close(lp_clip.grad, lp_rb.grad)
    torch.testing.assert_close(lp_clip.grad, (-adv).expand(2, 2))


def _clip_case(ratio, adv, **kw):
    """grpo_clip loss, its gradient and clipped flag for one token with the given ratio."""
    old = torch.tensor([[-1.0]])
    lp = (old + math.log(ratio)).requires_grad_(True)
    loss, meta = policy_gradient_loss("grpo_clip", lp, advantages=torch.tensor([[adv]]), old_logprobs=old, **kw)
    loss.sum().backward()
    return loss.item(), lp.grad.item(), bool(meta["clipped"].item())


@pytest.mark.parametrize(
    "ratio,adv,loss,clipped",
    [
        (1.5, 1.0, -1.2, True),  # A > 0, ratio above 1 + eps: capped, no gradient
        (0.5, 1.0, -0.5, False),  # A > 0, ratio below 1 - eps: unclipped term is the min
        (0.5, -1.0, 0.8, True),  # A < 0, ratio below 1 - eps: capped, no gradient
        (1.5, -1.0, 1.5, False),  # A < 0, ratio above 1 + eps: unclipped term is the min
    ],
)
def test_grpo_clip_outside_range(ratio, adv, loss, clipped):
    got_loss, grad, got_clipped = _clip_case(ratio, adv, clip_eps=0.2)
    assert got_loss == pytest.approx(loss, abs=1e-6)
    assert got_clipped == clipped
    if clipped:
        assert grad == 0.0
    else:  # d(-A * ratio)/d logp = -A * ratio
        assert grad == pytest.approx(-adv * ratio, abs=1e-6)


@pytest.mark.parametrize(
    "ratio,adv,eps_high,loss,clipped",
    [
        (1.25, 1.0, None, -1.2, True),  # eps_high defaults to clip_eps
        (1.25, 1.0, 0.28, -1.25, False),  # inside the wider upper bound
        (1.35, 1.0, 0.28, -1.28, True),  # capped at 1 + eps_high
        (0.7, -1.0, 0.28, 0.8, True),  # the lower bound still uses clip_eps
    ],
)
def test_grpo_clip_eps_high_is_separate(ratio, adv, eps_high, loss, clipped):
    got_loss, _, got_clipped = _clip_case(ratio, adv, clip_eps=0.2, clip_eps_high=eps_high)
    assert got_loss == pytest.approx(loss, abs=1e-6) and got_clipped == clipped


def test_grpo_clip_never_sends_gradient_to_old_logprobs():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.5]], requires_grad=True)
    loss, _ = policy_gradient_loss("grpo_clip", lp, advantages=torch.ones(1, 1), old_logprobs=old)
    loss.sum().backward()
    assert old.grad is None and lp.grad is not None


# 2 sequences x 3 tokens: per-token ratios exp(logp - old) of 1.5, 0.5, 1 and 1.1, 0.9, 2 (the last padding
# where a mask is given), advantages 1 and -2
RATIOS = torch.tensor([[1.5, 0.5, 1.0], [1.1, 0.9, 2.0]])
OLD = torch.full((2, 3), math.log(0.5))
ADV = torch.tensor([[1.0], [-2.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def _loss_and_grad(loss_type, old=OLD, ratios=RATIOS, adv=ADV, mask=MASK, **kw):
    """Per-token loss, metadata and d(sum of the masked loss)/d logp of one loss on the 2x3 example."""
    lp = (old + torch.log(ratios)).requires_grad_(True)
    loss, meta = policy_gradient_loss(loss_type, lp, loss_mask=mask, advantages=adv, old_logprobs=old, **kw)
    (loss * mask).sum().backward()
    return loss.detach(), meta, lp.grad


def test_dual_clip_hand_values_2x3():
    loss, meta, grad = _loss_and_grad("grpo_clip", mask=torch.ones(2, 3), clip_eps=0.2)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, -1.0], [2.2, 1.8, 4.0]]))
    # c = 1.5: where A = -2 the loss stops at -c * A = 3 (the ratio 2 token), without gradient
    loss, meta, grad = _loss_and_grad("grpo_clip", mask=torch.ones(2, 3), clip_eps=0.2, dual_clip_c=1.5)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, -1.0], [2.2, 1.8, 3.0]]))
    assert meta["clipped"].tolist() == [[True, False, False], [False, False, True]]
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5, -1.0], [2.2, 1.8, 0.0]]))  # -A * ratio, or 0


@pytest.mark.parametrize("loss_type", ["grpo_clip", "gspo"])
def test_dual_clip_bounds_negative_advantages_and_leaves_the_rest(loss_type):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(64, 6, generator=g) * 3
    ratios = torch.exp(torch.randn(64, 6, generator=g) * 1.5)  # up to ~100x
    adv = torch.randn(64, 1, generator=g)
    mask = (torch.arange(6) < torch.randint(1, 7, (64, 1), generator=g)).float()
    plain, _, _ = _loss_and_grad(loss_type, old, ratios, adv, mask, clip_eps=0.2)
    dual, _, _ = _loss_and_grad(loss_type, old, ratios, adv, mask, clip_eps=0.2, dual_clip_c=3.0)
    torch.testing.assert_close(dual, torch.where(adv < 0, torch.minimum(plain, -3.0 * adv), plain))
    assert (dual[(adv < 0).expand_as(dual)] <= (-3.0 * adv).expand_as(dual)[(adv < 0).expand_as(dual)] + 1e-6).all()
    assert (dual < plain).any()  # the bound bit somewhere


@pytest.mark.parametrize("loss_type", ["naive", "reinforce_baseline", "cispo"])
def test_dual_clip_is_refused_by_losses_without_a_clipped_objective(loss_type):
    with pytest.raises(ValueError, match="dual_clip_c"):
        policy_gradient_loss(
            loss_type, OLD, raw_rewards=ADV, advantages=ADV, old_logprobs=OLD, loss_mask=MASK, dual_clip_c=3.0
        )


def test_gspo_hand_values_2x3_with_the_papers_clip_range():
    # sequence ratios over response tokens only: (1.5 * 0.5 * 1)^(1/3) = 0.75^(1/3) and (1.1 * 0.9)^(1/2)
    loss, meta, grad = _loss_and_grad("gspo", clip_eps=3e-4, clip_eps_high=4e-4)
    s0, s1 = 0.75 ** (1 / 3), 0.99**0.5
    # A = 1, s0 below 1 - 3e-4: min(s0 * A, clip(s0) * A) is the unclipped s0; every token has its gradient
    torch.testing.assert_close(loss[0], torch.full((3,), -s0))
    torch.testing.assert_close(grad[0], torch.full((3,), -s0))  # d(-A * s)/d logp_t = -A * s, token by token
    # A = -2, s1 below 1 - 3e-4: the clipped term -A * (1 - 3e-4) is the larger loss; no gradient
    torch.testing.assert_close(loss[1, :2], torch.full((2,), 2 * (1 - 3e-4)))
    assert meta["clipped"].tolist() == [[False] * 3, [True] * 3] and not grad[1].any()
    torch.testing.assert_close(meta["ratio"], torch.tensor([[s0] * 3, [s1] * 3]))
    # the padding token's ratio 2 entering the mean would have made s1 = 1.98^(1/3) > 1 + 4e-4: unclipped, larger
    unmasked, _, _ = _loss_and_grad("gspo", mask=torch.ones(2, 3), clip_eps=3e-4, clip_eps_high=4e-4)
    torch.testing.assert_close(unmasked[1], torch.full((3,), 2 * 1.98 ** (1 / 3)))


def test_gspo_padding_never_enters_the_sequence_ratio():
    old = OLD.clone()
    old[1, 2] = -80.0  # a padding token with a huge log-ratio
    masked, _, grad = _loss_and_grad("gspo", old=old, clip_eps=0.2)
    plain, _, grad_plain = _loss_and_grad("gspo", clip_eps=0.2)
    torch.testing.assert_close(masked * MASK, plain * MASK)
    torch.testing.assert_close(grad * MASK, grad_plain * MASK)
    with pytest.raises(ValueError, match="loss_mask"):
        policy_gradient_loss("gspo", OLD, advantages=ADV, old_logprobs=OLD)


@pytest.mark.parametrize("log_ratio", [-0.5, -0.1, 0.0, 0.05, 0.4])  # inside and outside [1 - 0.2, 1 + 0.28]
def test_gspo_equals_grpo_clip_when_every_token_has_the_same_log_ratio(log_ratio):
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 5, generator=g) * 3
    ratios = torch.full((4, 5), math.exp(log_ratio))
    adv = torch.tensor([[1.0], [-1.0], [0.5], [-2.0]])
    mask = (torch.arange(5) < torch.tensor([[5], [3], [1], [4]])).float()
    kw = dict(clip_eps=0.2, clip_eps_high=0.28, dual_clip_c=1.1)
    gspo, gspo_meta, gspo_grad = _loss_and_grad("gspo", old, ratios, adv, mask, **kw)
    clip, clip_meta, clip_grad = _loss_and_grad("grpo_clip", old, ratios, adv, mask, **kw)
    torch.testing.assert_close(gspo * mask, clip * mask)
    torch.testing.assert_close(gspo_grad, clip_grad)
    assert torch.equal(gspo_meta["clipped"] & mask.bool(), clip_meta["clipped"] & mask.bool())


def test_gspo_token_form_gives_the_sequence_level_gradient():
    """Aggregated per sequence, the GSPO-token loss has the gradient of the paper's sequence objective
    -mean_i min(s_i * A_i, clip(s_i) * A_i) with s_i = exp(mean_t logp - old)."""
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(6, 5, generator=g) * 3
    lp0 = old + torch.randn(6, 1, generator=g) * 0.4 + torch.randn(6, 5, generator=g) * 0.2  # some clip
    adv = torch.randn(6, 1, generator=g)
    mask = (torch.arange(5) < torch.tensor([[5], [2], [4], [1], [3], [5]])).float()
    lp = lp0.clone().requires_grad_(True)
    loss, meta = policy_gradient_loss("gspo", lp, loss_mask=mask, advantages=adv, old_logprobs=old)
    aggregate_loss(loss, mask, "seq_mean_token_mean").backward()
    lp_seq = lp0.clone().requires_grad_(True)
    s = torch.exp(((lp_seq - old) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True))  # (B, 1)
    torch.maximum(-adv * s, -adv * s.clamp(0.8, 1.2)).mean().backward()
    assert meta["clipped"].any() and not meta["clipped"].all()  # both kinds of sequence
    torch.testing.assert_close(lp.grad, lp_seq.grad)


def test_cispo_hand_values_2x3_and_gradient_through_clipped_tokens():
    loss, meta, grad = _loss_and_grad("cispo", mask=torch.ones(2, 3), clip_eps=0.2)
    # weights clip(ratio, 0.8, 1.2): 1.2, 0.8, 1 and 1.1, 0.9, 1.2; logp = log(0.5 * ratio)
    w = torch.tensor([[1.2, 0.8, 1.0], [1.1, 0.9, 1.2]])
    logp = torch.log(torch.tensor([[0.75, 0.25, 0.5], [0.55, 0.45, 1.0]]))
    torch.testing.assert_close(loss, -w * ADV * logp)
    assert meta["clipped"].tolist() == [[True, True, False], [False, False, True]]
    # d/dlogp of -sg(w) * A * logp = -w * A on every token, the three clipped ones too
    torch.testing.assert_close(grad, torch.tensor([[-1.2, -0.8, -1.0], [2.2, 1.8, 2.4]]))
    _, _, clip_grad = _loss_and_grad("grpo_clip", mask=torch.ones(2, 3), clip_eps=0.2)
    assert clip_grad[0, 0] == 0 and grad[0, 0] != 0  # where grpo_clip cuts the gradient, cispo keeps it


def test_cispo_at_ratio_one_matches_reinforce_baseline():
    lp = OLD.clone().requires_grad_(True)
    loss, _ = policy_gradient_loss("cispo", lp, advantages=ADV, old_logprobs=OLD)
    loss.sum().backward()
    lp_rb = OLD.clone().requires_grad_(True)
    rb, _ = policy_gradient_loss("reinforce_baseline", lp_rb, advantages=ADV)
    rb.sum().backward()
    torch.testing.assert_close(loss.detach(), rb.detach())
    torch.testing.assert_close(lp.grad, lp_rb.grad)


# ---------------------------------------------------------------- KL


def test_kl_estimators_hand_values():
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    # log(pi/pi_ref) = log 2; pi_ref/pi = 0.5
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([[math.log(2)]]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([[0.5 * math.log(2) ** 2]]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([[0.5 + math.log(2) - 1.0]]))


def test_k3_is_nonnegative_and_zero_when_equal():
    g = torch.Generator().manual_seed(4)
    lp, ref = -torch.rand(64, 32, generator=g) * 10, -torch.rand(64, 32, generator=g) * 10
    assert (kl_penalty(lp, ref, "k3") >= 0).all()
    assert torch.equal(kl_penalty(lp, lp.clone(), "k3"), torch.zeros(64, 32))


def test_k3_is_finite_for_extreme_log_ratios():
    lp, ref = torch.tensor([[0.0, -1000.0]]), torch.tensor([[-1000.0, 0.0]])
    assert torch.isfinite(kl_penalty(lp, ref, "k3")).all()


def test_kl_does_not_send_gradient_to_reference():
    lp, ref = torch.tensor([[-1.0]], requires_grad=True), torch.tensor([[-2.0]], requires_grad=True)
    kl_penalty(lp, ref).sum().backward()
    assert ref.grad is None and lp.grad is not None


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_unbiased_estimators_match_true_kl_in_expectation(estimator):
    g = torch.Generator().manual_seed(5)
    logp = torch.log_softmax(torch.randn(6, generator=g), dim=0)  # policy
    logq = torch.log_softmax(torch.randn(6, generator=g), dim=0)  # reference
    true_kl = (logp.exp() * (logp - logq)).sum()
    x = torch.multinomial(logp.exp(), 200_000, replacement=True, generator=g)  # x ~ policy
    estimate = kl_penalty(logp[x][None], logq[x][None], estimator).mean()
    assert estimate.item() == pytest.approx(true_kl.item(), rel=0.05)


# ---------------------------------------------------------------- aggregation

# a 4-token and a 1-token response; padding holds garbage that must not count
AGG_LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 99.0, 99.0, 99.0]])
AGG_MASK = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token_mean", (1 + 2 + 3 + 4 + 10) / 5),
        ("seq_mean_token_mean", ((1 + 2 + 3 + 4) / 4 + 10 / 1) / 2),
        ("seq_mean_token_sum_norm", ((1 + 2 + 3 + 4) / 4 + 10 / 4) / 2),
    ],
)
def test_aggregation_hand_values(mode, expected):
    got = aggregate_loss(AGG_LOSS, AGG_MASK, mode, max_tokens=4.0)
    assert got.item() == pytest.approx(expected)


def _token_weights(mode):
    loss = AGG_LOSS.clone().requires_grad_(True)
    aggregate_loss(loss, AGG_MASK, mode, max_tokens=4.0).backward()
    return loss.grad


def test_token_mean_weights_long_sequences_more():
    w = _token_weights("token_mean")
    torch.testing.assert_close(w, AGG_MASK / 5.0)
    assert w[0].sum() == pytest.approx(4 * w[1].sum())


def test_seq_mean_token_mean_weights_sequences_equally():
    w = _token_weights("seq_mean_token_mean")
    torch.testing.assert_close(w, torch.tensor([[0.125] * 4, [0.5, 0, 0, 0]]))
    assert w[0].sum() == pytest.approx(w[1].sum())


def test_seq_mean_token_sum_norm_weights_tokens_by_constant():
    torch.testing.assert_close(_token_weights("seq_mean_token_sum_norm"), AGG_MASK / 8.0)


def test_token_mean_over_microbatches_weighs_every_token_of_the_minibatch_alike():
    """Microbatches of 9 and 7 tokens (issue 35's hand check): divided by the minibatch's tokens per
    microbatch (16 / 2) and accumulated over 2 steps, every token weighs 1/16; each microbatch's own token
    mean weighed them 1/18 and 1/14, less a token for the microbatch of longer responses."""
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    halves = (slice(0, 2), slice(2, 4))
    for normalizer, weights in [(8.0, [1 / 16, 1 / 16]), (None, [1 / 18, 1 / 14])]:
        loss = torch.zeros(4, 5, requires_grad=True)
        for s in halves:
            (aggregate_loss(loss[s], mask[s], "token_mean", token_normalizer=normalizer) / 2).backward()
        expected = torch.cat([mask[s] * w for s, w in zip(halves, weights)]).float()
        torch.testing.assert_close(loss.grad, expected)


def test_sum_norm_requires_max_tokens():
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate_loss(AGG_LOSS, AGG_MASK, "seq_mean_token_sum_norm")


# ---------------------------------------------------------------- microbatch step


def _batch(seed=6, b=4, t=5):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(b, t)
    for i, n in enumerate([5, 2, 4, 1][:b]):
        mask[i, n:] = 0
    return dict(
        logprobs=-torch.rand(b, t, generator=g) * 3,
        old_logprobs=-torch.rand(b, t, generator=g) * 3,
        ref_logprobs=-torch.rand(b, t, generator=g) * 3,
        advantages=torch.randn(b, 1, generator=g),
        mask=mask,
    )


STEP_SPEC = LossSpec(loss_type="grpo_clip", agg_mode="seq_mean_token_mean", kl_coef=0.1, clip_eps=0.2)


@pytest.mark.parametrize("loss_type", ["grpo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("agg_mode", ["seq_mean_token_mean", "seq_mean_token_sum_norm", "token_mean"])
def test_two_microbatches_match_full_batch_gradient(agg_mode, loss_type):
    """Microbatches of 7 and 5 response tokens; token_mean divides by the minibatch's tokens per microbatch
    (the seq_* modes ignore token_normalizer)."""
    d = _batch()
    spec = dataclasses.replace(STEP_SPEC, agg_mode=agg_mode, max_tokens=5.0, loss_type=loss_type)

    def run(slices, steps):
        theta = d["logprobs"].clone().requires_grad_(True)
        total = 0.0
        for s in slices:
            loss, _ = grpo_microbatch_step(
                spec,
                theta[s],
                d["mask"][s],
                gradient_accumulation_steps=steps,
                advantages=d["advantages"][s],
                old_logprobs=d["old_logprobs"][s],
                ref_logprobs=d["ref_logprobs"][s],
                token_normalizer=d["mask"].sum() / steps,
            )
            total += loss.item()
        return total, theta.grad

    full_loss, full_grad = run([slice(0, 4)], 1)
    micro_loss, micro_grad = run([slice(0, 2), slice(2, 4)], 2)
    assert micro_loss == pytest.approx(full_loss, rel=1e-6)
    torch.testing.assert_close(micro_grad, full_grad)


def test_microbatch_step_matches_per_sequence_loop():
    d = _batch()
    theta = d["logprobs"].clone().requires_grad_(True)
    loss, metrics = grpo_microbatch_step(
        STEP_SPEC,
        theta,
        d["mask"],
        gradient_accumulation_steps=3,
        advantages=d["advantages"],
        old_logprobs=d["old_logprobs"],
        ref_logprobs=d["ref_logprobs"],
    )
    per_seq = []
    for i in range(4):  # token by token, straight from the formulas
        terms = []
        for t in range(int(d["mask"][i].sum())):
            lp, old, ref = (d[k][i, t].item() for k in ("logprobs", "old_logprobs", "ref_logprobs"))
            a = d["advantages"][i, 0].item()
            ratio = math.exp(lp - old)
            pg = -min(ratio * a, min(max(ratio, 0.8), 1.2) * a)
            kl = math.exp(ref - lp) - (ref - lp) - 1
            terms.append(pg + 0.1 * kl)
        per_seq.append(sum(terms) / len(terms))
    assert loss.item() == pytest.approx(sum(per_seq) / 4 / 3, rel=1e-5)
    assert theta.grad is not None and torch.isfinite(theta.grad).all()


def test_microbatch_metrics_are_namespaced_detached_and_masked():
    d = _batch()
    # one response token above the clip range with A > 0; padding holds a huge ratio
    d["advantages"] = torch.ones(4, 1)
    d["old_logprobs"] = d["logprobs"].clone()
    d["old_logprobs"][0, 0] -= math.log(2.0)
    d["old_logprobs"][1, 4] -= 50.0  # padding
    theta = d["logprobs"].clone().requires_grad_(True)
    _, m = grpo_microbatch_step(
        STEP_SPEC,
        theta,
        d["mask"],
        gradient_accumulation_steps=1,
        advantages=d["advantages"],
        old_logprobs=d["old_logprobs"],
        ref_logprobs=d["ref_logprobs"],
    )
    assert {"loss/pg", "loss/kl", "actor/clip_frac", "actor/ratio_mean", "actor/ratio_max", "actor/ratio_min"} <= set(m)
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())
    n_tokens = 5 + 2 + 4 + 1
    assert m["actor/clip_frac"].item() == pytest.approx(1 / n_tokens)
    assert m["actor/ratio_max"].item() == pytest.approx(2.0)
    assert m["actor/ratio_min"].item() == pytest.approx(1.0)
    assert m["actor/ratio_mean"].item() == pytest.approx((n_tokens - 1 + 2.0) / n_tokens)


def test_microbatch_loss_scales_with_accumulation_steps():
    d = _batch()
    losses = []
    for steps in (1, 4):
        theta = d["logprobs"].clone().requires_grad_(True)
        loss, _ = grpo_microbatch_step(
            STEP_SPEC,
            theta,
            d["mask"],
            gradient_accumulation_steps=steps,
            advantages=d["advantages"],
            old_logprobs=d["old_logprobs"],
            ref_logprobs=d["ref_logprobs"],
        )
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0] / 4)


def test_kl_enters_the_loss_only_when_kl_coef_positive():
    d = _batch()

    def loss_with(kl_coef, **kw):
        theta = d["logprobs"].clone().requires_grad_(True)
        return grpo_microbatch_step(
            dataclasses.replace(STEP_SPEC, kl_coef=kl_coef),
            theta,
            d["mask"],
            gradient_accumulation_steps=1,
            advantages=d["advantages"],
            old_logprobs=d["old_logprobs"],
            **kw,
        )

    no_ref, _ = loss_with(kl_coef=0.0)
    ref_unused, m = loss_with(kl_coef=0.0, ref_logprobs=d["ref_logprobs"])
    with_kl, m_kl = loss_with(kl_coef=0.5, ref_logprobs=d["ref_logprobs"])
    assert ref_unused.item() == pytest.approx(no_ref.item())
    assert m["loss/kl"] > 0  # still reported for monitoring
    assert with_kl.item() == pytest.approx(no_ref.item() + 0.5 * m_kl["loss/kl"].item(), rel=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        loss_with(kl_coef=0.1)


# ---------------------------------------------------------------- registries


def _call(entry, name):
    """Call one public entry point with a variant name on tiny valid inputs."""
    lp, mask = torch.zeros(2, 4), torch.ones(2, 4)
    calls = {
        "advantage": lambda: group_advantages(torch.arange(4.0), 2, name),
        "loss": lambda: policy_gradient_loss(
            name, lp, loss_mask=mask, raw_rewards=torch.ones(2, 1), advantages=torch.ones(2, 1), old_logprobs=lp
        ),
        "kl": lambda: kl_penalty(lp, lp, name),
        "agg": lambda: aggregate_loss(lp, mask, name, max_tokens=4.0),
        "correction": lambda: core.behavior_weights(lp, lp, mask, name),
        "level": lambda: core.behavior_weights(lp, lp, mask, "tis", name),
    }
    return calls[entry]()


ENTRIES = [
    ("advantage", AdvantageMode),
    ("loss", LossType),
    ("kl", KLEstimator),
    ("agg", AggMode),
    ("correction", core.BehaviorCorrection),
    ("level", core.BehaviorLevel),
]


@pytest.mark.parametrize("entry,literal", ENTRIES)
def test_every_literal_name_is_registered(entry, literal):
    for name in get_args(literal):
        _call(entry, name)


@pytest.mark.parametrize("entry,literal", ENTRIES)
def test_unknown_name_raises_listing_valid_names(entry, literal):
    with pytest.raises(ValueError) as err:
        _call(entry, "bogus")
    assert "bogus" in str(err.value)
    for name in get_args(literal):
        assert repr(name) in str(err.value)


def test_unknown_name_in_a_loss_spec_raises_listing_the_valid_ones():
    """A spec with a name no registry holds fails when it is made, not at the first microbatch."""
    for bad, valid in [
        (dict(loss_type="ppo"), "grpo_clip"),
        (dict(agg_mode="mean"), "token_mean"),
        (dict(kl_estimator="k4"), "k3"),
        (dict(behavior_correction="clip"), "icepop"),
        (dict(behavior_level="row"), "geometric"),
        (dict(loss_type="cispo", dual_clip_c=3.0), "gspo"),
    ]:
        with pytest.raises(ValueError, match=valid):
            dataclasses.replace(STEP_SPEC, **bad)


def test_module_is_pure_torch():
    src = open(core.__file__).read()
    imports = {line.split()[1] for line in src.splitlines() if line.startswith(("import ", "from "))}
    # torch, and the variant names declared once for the math and the config (Literals, no code)
    assert {m.split(".")[0] for m in imports} - {"grpo"} <= {"dataclasses", "typing", "torch"}
    assert {m for m in imports if m.startswith("grpo")} <= {"grpo.variants"}


def test_linear_decay_lr():
    assert [core.linear_decay_lr(2.0, s, 4) for s in range(6)] == [2.0, 1.5, 1.0, 0.5, 0.0, 0.0]
    assert core.linear_decay_lr(2.0, 1000, 0) == 2.0  # 0: constant


def test_config_names_the_same_variants_as_the_math():
    """The config's Literals are the math's: a name added to one must be added to the other."""
    from typing import get_type_hints

    from grpo.config import AdvantageConfig, LearnConfig

    learn, adv = get_type_hints(LearnConfig), get_type_hints(AdvantageConfig)
    assert get_args(learn["loss_type"]) == get_args(LossType) and get_args(learn["agg_mode"]) == get_args(AggMode)
    assert get_args(learn["kl_estimator"]) == get_args(KLEstimator) and get_args(adv["mode"]) == get_args(AdvantageMode)
    assert get_args(learn["behavior_correction"]) == get_args(core.BehaviorCorrection)
    assert get_args(learn["behavior_level"]) == get_args(core.BehaviorLevel)


def test_tis_weighs_each_token_by_the_truncated_ratio_hand_computed():
    # pi_old / pi_sampler = 2 (capped at 1.5), 0.5, 1; advantage 1, grpo_clip at ratio 1 (logp = old)
    old = torch.log(torch.tensor([[0.4, 0.1, 0.3]]))
    sampler = torch.log(torch.tensor([[0.2, 0.2, 0.3]]))
    logp = old.clone().requires_grad_(True)
    mask = torch.ones(1, 3)
    loss, m = grpo_microbatch_step(
        LossSpec("grpo_clip", "token_mean", behavior_correction="tis", tis_cap=1.5),
        logp,
        mask,
        gradient_accumulation_steps=1,
        advantages=torch.ones(1, 1),
        old_logprobs=old,
        sampler_logprobs=sampler,
    )
    # per-token loss -A * ratio * w = -w at ratio 1; token mean: -(1.5 + 0.5 + 1) / 3 = -1
    assert loss.item() == pytest.approx(-1.0)
    assert logp.grad[0].tolist() == pytest.approx([-0.5, -1 / 6, -1 / 3])  # d(-w * exp(lp - old))/dlp / 3
    assert m["behavior/weight_mean"].item() == pytest.approx(1.0)
    assert m["behavior/weight_max"].item() == pytest.approx(1.5)
    assert m["behavior/clipped_frac"].item() == pytest.approx(1 / 3)
    plain = old.clone().requires_grad_(True)
    loss_none, _ = grpo_microbatch_step(
        LossSpec("grpo_clip", "token_mean", behavior_correction="none"),
        plain,
        mask,
        gradient_accumulation_steps=1,
        advantages=torch.ones(1, 1),
        old_logprobs=old,
        sampler_logprobs=sampler,
    )
    assert loss_none.item() == pytest.approx(-1.0) and plain.grad[0].tolist() == pytest.approx([-1 / 3] * 3)


# ---------------------------------------------------------------- behaviour correction (decoupled PPO)
# two responses: token ratios pi_prox / pi_sampler of 2, 2, 0.5 and of 4 (then padding, garbage that must not leak)
LOG_RATIO = torch.log(torch.tensor([[2.0, 2.0, 0.5], [4.0, 1e20, 1e-20]]))
SAMPLER = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, 50.0, -50.0]])
PROX = SAMPLER + LOG_RATIO
BMASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
GEO = 2 ** (1 / 3)  # the first response's geometric mean ratio: (2 * 2 * 0.5) ** (1 / 3)


@pytest.mark.parametrize(
    "correction,level,weights,clipped",
    [  # hand-computed; a response's weight goes to each of its tokens; clipped: masked or truncated tokens of 4
        ("none", "token", [[1, 1, 1], [1]], 0),
        ("tis", "token", [[1.5, 1.5, 0.5], [1.5]], 3),  # min(w, 1.5)
        ("mis", "token", [[2, 2, 0.5], [0]], 1),  # 4 > 2: masked
        ("icepop", "token", [[2, 2, 0], [4]], 1),  # 0.5 below the band [0.6, 5]
        ("tis", "sequence", [[1.5, 1.5, 1.5], [1.5]], 4),  # products 2 and 4, both over 1.5
        ("mis", "sequence", [[2, 2, 2], [0]], 1),  # 2 kept (in [0, 2]), 4 masked
        ("tis", "geometric", [[GEO, GEO, GEO], [1.5]], 1),
        ("mis", "geometric", [[GEO, GEO, GEO], [0]], 1),
    ],
)
def test_behavior_weights_hand_computed(correction, level, weights, clipped):
    w, m = core.behavior_weights(
        PROX, SAMPLER, BMASK, correction, level, cap=1.5, mis_bounds=(0.0, 2.0), icepop_bounds=(0.6, 5.0)
    )
    flat = [x for row in weights for x in row]
    assert w[0].tolist() == pytest.approx(weights[0]) and w[1, 0].item() == pytest.approx(weights[1][0])
    assert m["behavior/weight_mean"].item() == pytest.approx(sum(flat) / 4)
    assert m["behavior/weight_max"].item() == pytest.approx(max(flat))
    assert m["behavior/clipped_frac"].item() == pytest.approx(clipped / 4)
    k3 = [r - math.log(r) - 1 for r in (2, 2, 0.5, 4)]  # k3 of KL(sampler || prox): r = pi_prox / pi_sampler
    assert m["behavior/kl"].item() == pytest.approx(sum(k3) / 4)
    assert torch.isfinite(w).all()  # the padding's huge ratios never leak


def test_behavior_weights_of_one_policy_are_one_and_its_kl_zero():
    for level in ("token", "sequence", "geometric"):
        w, m = core.behavior_weights(SAMPLER, SAMPLER, BMASK, "mis", level, mis_bounds=(1.0, 1.0 + 1e-6))
        assert (w[BMASK.bool()] == 1).all() and m["behavior/clipped_frac"] == 0 and m["behavior/kl"] == 0


def test_decoupled_loss_clips_to_pi_prox_and_weighs_by_pi_prox_over_the_sampler_hand_computed():
    """Token 0: pi_theta / pi_prox = 1.5, clipped to 1.2 (no gradient), weight pi_prox / pi_sampler = 0.4, outside
    IcePop's band [0.5, 5]: masked. Token 1: ratio 1, weight 3. A = 1, token mean over the 2 tokens."""
    prox = torch.log(torch.tensor([[0.2, 0.3]]))
    sampler = prox - torch.log(torch.tensor([[0.4, 3.0]]))
    logp = (prox + torch.log(torch.tensor([[1.5, 1.0]]))).requires_grad_(True)
    loss, m = grpo_microbatch_step(
        LossSpec("grpo_clip", "token_mean", behavior_correction="icepop"),
        logp,
        torch.ones(1, 2),
        gradient_accumulation_steps=1,
        advantages=torch.ones(1, 1),
        old_logprobs=prox,
        sampler_logprobs=sampler,
    )
    assert loss.item() == pytest.approx(-(1.2 * 0 + 1.0 * 3) / 2)
    assert logp.grad[0].tolist() == pytest.approx([0.0, -3 / 2])  # d(-3 * exp(lp - prox)) / dlp / 2 at ratio 1
    assert m["actor/clip_frac"].item() == pytest.approx(0.5)  # the clip is to pi_prox, not to the sampler
    assert m["behavior/clipped_frac"].item() == pytest.approx(0.5) and m["behavior/weight_max"].item() == 3


def test_no_behavior_correction_is_the_uncorrected_loss_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    old, sampler = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    mask, adv = (torch.rand(3, 5, generator=gen) > 0.3).float(), torch.randn(3, 1, generator=gen)
    grads = []
    for correction in ("none", None):
        logp = (old + 0.1 * torch.randn(3, 5, generator=torch.Generator().manual_seed(1))).requires_grad_(True)
        if correction is None:  # the loss as it was before any correction existed
            pg, _ = policy_gradient_loss("grpo_clip", logp, loss_mask=mask, advantages=adv, old_logprobs=old)
            aggregate_loss(pg, mask, "seq_mean_token_mean").backward()
        else:
            spec = LossSpec("grpo_clip", "seq_mean_token_mean", behavior_correction=correction)
            grpo_microbatch_step(spec, logp, mask, gradient_accumulation_steps=1, advantages=adv, old_logprobs=old,
                                 sampler_logprobs=sampler)  # fmt: skip
        grads.append(logp.grad)
    assert torch.equal(grads[0], grads[1])


# ---------------------------------------------------------------- episodes: tokens masked out of the loss
def _dropped(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's values where mask is 1, moved to its front and right-padded with 0 (differentiable): the row as if
    its masked tokens had never been there."""
    rows = [x[i][mask[i].bool()] for i in range(len(x))]
    return torch.stack([torch.nn.functional.pad(r, (0, x.shape[1] - len(r))) for r in rows])


@pytest.mark.parametrize(
    "loss_type,dual_clip_c", [("grpo_clip", 3.0), ("gspo", None), ("cispo", None), ("reinforce_baseline", None)]
)
@pytest.mark.parametrize("agg_mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize(
    "correction,level",
    [("none", "token"), ("tis", "token"), ("icepop", "token"), ("mis", "sequence"), ("tis", "geometric")],
)
def test_masked_tokens_count_for_nothing_the_step_is_the_one_with_them_dropped(
    loss_type, dual_clip_c, agg_mode, correction, level
):
    """An episode's observation tokens (loss_mask 0 inside a response) leave the loss, its gradient, the KL and
    every metric (clip fractions, ratio stats, behaviour weights and their KL, GSPO's sequence ratio) as if they had
    been dropped from the sequence; and whatever old, sampler and reference log-probs they hold (huge, inf, nan)
    changes nothing."""
    gen = torch.Generator().manual_seed(3)
    b, t = 4, 9
    mask = torch.ones(b, t)
    mask[0, 2:4] = mask[1, 5:] = mask[2, 0] = mask[3, 1:8:2] = 0  # observations between turns, at the end, first
    mask[1, 7:] = mask[2, 6:] = 0  # and right padding
    logp = -torch.rand(b, t, generator=gen) * 2
    given = {
        "old_logprobs": logp + 0.3 * torch.randn(b, t, generator=gen),
        "sampler_logprobs": logp + 0.5 * torch.randn(b, t, generator=gen),
        "ref_logprobs": logp - torch.rand(b, t, generator=gen),
    }
    adv, rewards = torch.randn(b, 1, generator=gen), torch.rand(b, 1, generator=gen)
    spec = LossSpec(
        loss_type, agg_mode, kl_coef=0.1, dual_clip_c=dual_clip_c, max_tokens=float(t),
        behavior_correction=correction, behavior_level=level, tis_cap=1.2, mis_bounds=(0.0, 3.0),
        icepop_bounds=(0.6, 1.6),
    )  # fmt: skip

    def step(tensors: dict, m: torch.Tensor, drop: bool):
        theta = logp.clone().requires_grad_(True)
        cut = (lambda x: _dropped(x, m)) if drop else (lambda x: x)
        loss, metrics = grpo_microbatch_step(
            spec, cut(theta), _dropped(m, m) if drop else m, gradient_accumulation_steps=2, advantages=adv,
            raw_rewards=rewards, token_normalizer=float(m.sum()) / 2, **{k: cut(v) for k, v in tensors.items()},
        )  # fmt: skip
        return loss, metrics, theta.grad

    loss, metrics, grad = step(given, mask, drop=False)
    loss_d, metrics_d, grad_d = step(given, mask, drop=True)
    torch.testing.assert_close(loss, loss_d)
    torch.testing.assert_close(grad, grad_d)
    assert metrics.keys() == metrics_d.keys()
    for k in metrics:
        torch.testing.assert_close(metrics[k], metrics_d[k], msg=k)
    assert (grad[mask == 0] == 0).all() and grad.abs().sum() > 0
    noise = 1e4 * torch.randn(b, t, generator=gen)
    noise[0, 2], noise[1, 5], noise[3, 1] = float("inf"), float("-inf"), float("nan")
    garbage = {k: torch.where(mask.bool(), v, noise) for k, v in given.items()}
    loss_g, metrics_g, grad_g = step(garbage, mask, drop=False)
    assert torch.equal(grad_g, grad) and torch.equal(loss_g, loss)
    assert all(torch.equal(metrics_g[k], metrics[k]) for k in metrics)
