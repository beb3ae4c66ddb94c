"""GRPO math: group advantages, policy-gradient losses, KL penalty, loss aggregation.

Pure torch, no I/O. Follows DeepSeekMath's GRPO (Shao et al., 2024) and the
Stanford CS336 (2025) lecture 17 / assignment 5 reference, with these departures:
- advantages come in three modes; "normalized" is the paper's z-score (with the
  unbiased torch.std, as CS336 uses), "centered" only subtracts the group mean
  (Dr.GRPO, nanochat), "naive" uses the raw reward.
- grpo_clip takes an optional separate upper clip bound (DAPO's clip-higher) and an optional
  dual-clip bound for negative advantages (Ye et al. 2020).
- gspo (Zheng et al. 2025) clips one ratio per sequence (the GSPO-token form: every token's gradient
  goes through its own log-prob); cispo (MiniMax-M1, 2025) clips a stop-gradient weight instead of the
  objective, so no token loses its gradient.
- the KL to the reference is added to the per-token loss (DeepSeekMath eq. 3), not
  folded into the reward, and is off by default (kl_coef=0) as in DAPO / Dr.GRPO.
- aggregation offers the paper's per-sequence mean plus DAPO's token mean and
  Dr.GRPO's sum divided by a constant; under gradient accumulation the token mean divides by
  the whole minibatch's tokens (as verl's global token count), not each microbatch's.
- decoupled PPO (Hilton et al. 2022; AReaL's use_decoupled_loss): the clip is to pi_old = pi_prox, the
  learner before its first step, and each token's loss may be weighed by the behaviour weight
  pi_prox / pi_sampler, truncated (TIS, Yao et al. 2025) or masked (MIS; IcePop's two-sided band), per
  token, sequence or geometric mean: for a sampler that is stale (rollout.staleness) or whose numerics
  (bf16 vLLM) differ from the learner's.
Shapes: B responses, T response tokens (right-padded), V vocab, G groups of K.
Variants are picked by name from small registries; unknown names raise ValueError.
"""

from dataclasses import dataclass
from typing import Callable, get_args

import torch
from torch import Tensor

from grpo.variants import (
    AdvantageMode,
    AggMode,
    BehaviorCorrection,
    BehaviorLevel,
    DualClipLossType,
    KLEstimator,
    LossType,
    TeacherMode,
)


def _lookup(registry: dict[str, Callable], name: str, kind: str) -> Callable:
    """Return registry[name]; unknown names fail listing the valid ones."""
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; valid: {list(registry)}")
    return registry[name]


def _require(value: Tensor | None, name: str, owner: str) -> Tensor:
    """Return value, or fail naming the missing argument."""
    if value is None:
        raise ValueError(f"{owner} requires `{name}`")
    return value


# ---------------------------------------------------------------- advantages
def _normalized(r: Tensor, mean: Tensor, std: Tensor, eps: float) -> Tensor:
    """z-score within each group; r (G, K), mean and std (G, 1) -> (G, K)."""
    # a zero-variance group gives 0 / eps = 0, not nan
    if r.shape[1] < 2:
        raise ValueError("advantage mode 'normalized' needs group_size >= 2")
    return (r - mean) / (std + eps)


_ADVANTAGES: dict[str, Callable[..., Tensor]] = {
    "naive": lambda r, mean, std, eps: r,
    "centered": lambda r, mean, std, eps: r - mean,
    "normalized": _normalized,
}


def group_advantages(
    rewards: Tensor, group_size: int, mode: AdvantageMode, eps: float = 1e-6
) -> tuple[Tensor, dict[str, Tensor]]:
    """Group-relative advantages.

    rewards: (B,) laid out group-contiguous, B = G * group_size.
    Returns advantages (B,) and per-group stats {mean, std, min, max}, each (G,).
    """
    adv_fn = _lookup(_ADVANTAGES, mode, "advantage mode")
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of group_size={group_size}"
        )
    if not rewards.is_floating_point():
        rewards = rewards.float()
    r = rewards.reshape(-1, group_size)  # (G, K)
    mean = r.mean(dim=1, keepdim=True)  # (G, 1)
    # unbiased std like the CS336 reference; one-sample groups report 0, not nan
    std = r.std(dim=1, keepdim=True, correction=1 if group_size > 1 else 0)
    adv = adv_fn(r, mean, std, eps).reshape(-1)
    stats = {"mean": mean.squeeze(1), "std": std.squeeze(1), "min": r.amin(dim=1), "max": r.amax(dim=1)}
    return adv, stats


# ---------------------------------------------------------------- distillation advantages
# on-policy distillation (Agarwal et al. 2024; Tinker's and prime-rl's form): each sampled token's advantage is the
# negative per-token reverse KL to the teacher, -(log p_sampler - log p_teacher), a single-sample estimate taken on the
# student's own tokens; the policy-gradient loss then moves the student toward the teacher, token by token
_TEACHER_MODES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "reverse_kl": lambda reverse_kl, group: reverse_kl,
    "add": lambda reverse_kl, group: reverse_kl + group[:, None],
}


def teacher_advantages(
    sampler_logprobs: Tensor,
    teacher_logprobs: Tensor,
    loss_mask: Tensor,
    advantages: Tensor,
    mode: TeacherMode,
    coef: float,
) -> Tensor:
    """Per-token advantages from a teacher: coef * -(sampler_logprobs - teacher_logprobs), alone (`reverse_kl`) or
    plus each sample's group advantage (`add`); 0 where loss_mask is 0.

    sampler_logprobs, teacher_logprobs, loss_mask: (B, T); advantages: (B,) -> (B, T).

    >>> teacher_advantages(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-0.5, -3.0]]), torch.tensor([[1, 0]]),
    ...                    torch.tensor([0.25]), "add", 2.0).tolist()
    [[1.25, 0.0]]
    """
    combine = _lookup(_TEACHER_MODES, mode, "teacher mode")
    reverse_kl = -coef * (sampler_logprobs - teacher_logprobs)  # (B, T)
    return combine(reverse_kl, advantages).masked_fill(~loss_mask.bool(), 0.0)


def topk_forward_kl(student_topk: Tensor, teacher_topk: Tensor, teacher_tail: Tensor, eps: float = 1e-8) -> Tensor:
    """GKD's forward KL(teacher || student) per token over the teacher's top k tokens and the mass outside them:
    sum_i p_T(i) (log p_T(i) - log p_S(i)) + tail_T (log tail_T - log tail_S), tail_S = 1 - sum_i p_S(i). Gradient
    flows into the student's log-probs only.

    student_topk, teacher_topk: (B, T, k) log-probs of the teacher's top k ids; teacher_tail: (B, T) -> (B, T).

    >>> t, tail = torch.log(torch.tensor([[[0.5, 0.3]]])), torch.tensor([[0.2]])
    >>> abs(topk_forward_kl(t, t, tail).item()) < 1e-6, topk_forward_kl(t - 1.0, t, tail).item() > 0
    (True, True)
    """
    teacher_topk, teacher_tail = teacher_topk.detach(), teacher_tail.detach()
    p_teacher = teacher_topk.exp()
    head = (p_teacher * (teacher_topk - student_topk)).sum(-1)  # (B, T)
    student_tail = (1.0 - student_topk.exp().sum(-1)).clamp_min(eps)
    tail = torch.where(teacher_tail > 0, teacher_tail * (teacher_tail.clamp_min(eps).log() - student_tail.log()), 0.0)
    return head + tail


# ---------------------------------------------------------------- masking
def linear_decay_lr(lr: float, step: int, decay_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based): lr decayed linearly to 0 over
    `decay_steps` steps, then 0; decay_steps 0 means constant.

    >>> linear_decay_lr(1.0, 0, 4), linear_decay_lr(1.0, 3, 4), linear_decay_lr(1.0, 9, 4), linear_decay_lr(1.0, 9, 0)
    (1.0, 0.25, 0.0, 1.0)
    """
    return lr if decay_steps <= 0 else lr * max(0.0, 1.0 - step / decay_steps)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over positions where mask is 1.

    x, mask: same shape; mask is 0/1 (bool or float). Reduces over dim (all if None).
    Masked-out positions never leak, even if they hold nan/inf; empty slices give 0.
    """
    keep = mask.bool()
    total = x.masked_fill(~keep, 0.0).sum(dim=dim)
    return total / keep.sum(dim=dim).clamp_min(1).to(x.dtype)


def masked_normalize(x: Tensor, mask: Tensor, constant: float, dim: int | None = None) -> Tensor:
    """Masked sum of x over dim (all if None) divided by a constant (Dr.GRPO).

    x, mask: same shape; mask is 0/1 (bool or float).
    """
    return x.masked_fill(~mask.bool(), 0.0).sum(dim=dim) / constant


# ---------------------------------------------------------------- log-probs
def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """log p(labels[b, t]) under softmax(logits[b, t]).

    logits: (B, T, V), labels: (B, T) long -> (B, T); or labels (B, T, m) -> (B, T, m), m ids a position (the
    sampled token and the teacher's top k: GKD's term from the same forward).
    The caller shifts: logits[:, t] must predict labels[:, t], i.e. pass
    model(ids).logits[:, :-1] with ids[:, 1:].
    """
    # half-precision logsumexp loses the small differences that ratios depend on
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if labels.dim() == logits.dim():  # m ids a position
        return logits.gather(-1, labels) - torch.logsumexp(logits, dim=-1, keepdim=True)
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position. logits: (B, T, V) -> (B, T).

    Same shifting convention as token_logprobs; logits must be finite.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def chunked_token_logprobs(
    hidden: Tensor, project: Callable[[Tensor], Tensor], labels: Tensor, chunk: int, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """token_logprobs (and token_entropy) of project(hidden), `chunk` positions at a time.

    hidden: (B, T, H), project: (n, H) -> (n, V) logits (the LM head), labels: (B, T) long ->
    log-probs (B, T) (labels (B, T, m): (B, T, m)) and, with_entropy, the entropy (B, T) as a metric (no
    gradient). Only one chunk's float32 (chunk, V) logits exist at a time: under autograd each chunk's logits are
    recomputed in the backward pass (activation checkpointing) instead of kept, so memory holds
    the hidden states, not (B, T, V). A chunk's logits give its log-probs and entropy together (one LM head
    matmul a chunk in the forward). Same values and gradients as the unchunked form.
    """
    b, t, h = hidden.shape
    flat, flat_labels = hidden.reshape(b * t, h), labels.reshape(b * t, *labels.shape[2:])
    logps, entropies = [], []
    for x, y in zip(flat.split(max(1, chunk)), flat_labels.split(max(1, chunk))):
        if torch.is_grad_enabled() and x.requires_grad:
            from torch.utils.checkpoint import checkpoint

            logp, entropy = checkpoint(_chunk_logprobs, x, project, y, with_entropy, use_reentrant=False)
        else:
            logp, entropy = _chunk_logprobs(x, project, y, with_entropy)
        logps.append(logp)
        entropies.append(entropy)
    logp = torch.cat(logps).reshape(b, t, *labels.shape[2:])
    return logp, torch.cat(entropies).reshape(b, t) if with_entropy else None


def _chunk_logprobs(
    x: Tensor, project: Callable[[Tensor], Tensor], labels: Tensor, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """(n, H) hidden states -> (n,) log-probs of labels (n,) (labels (n, m): (n, m)) and, with_entropy, (n,)
    entropies (no gradient)."""
    logits = project(x)[None]  # (1, n, V)
    entropy = token_entropy(logits.detach())[0] if with_entropy else None
    return token_logprobs(logits, labels[None])[0], entropy


# ---------------------------------------------------------------- policy-gradient losses
# every loss: (logprobs, mask, raw_rewards, advantages, old_logprobs, eps_low, eps_high, dual_clip_c)
# -> per-token loss (B, T), detached metadata {ratio, clipped} (B, T)
def _on_policy_meta(logprobs: Tensor) -> dict[str, Tensor]:
    """Ratio 1 and nothing clipped (B, T): no importance weighting, same metric keys."""
    return {"ratio": torch.ones_like(logprobs).detach(), "clipped": torch.zeros_like(logprobs, dtype=torch.bool)}


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float, dual_clip_c: float | None):
    """PPO's -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A), and with dual_clip_c at most
    -c * A where A < 0 (dual-clip); ratio (B, T), advantages (B, 1) -> (B, T) and metadata."""
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    # -min(ratio*A, clip(ratio)*A) == max of the negated terms
    loss = torch.maximum(pg_loss1, pg_loss2)
    clipped = pg_loss2 > pg_loss1
    if dual_clip_c is not None:  # A < 0 and a huge ratio: the loss stops growing at -c * A (no gradient)
        bound = (-dual_clip_c * advantages).expand_as(loss)
        dual = (advantages < 0) & (loss > bound)
        loss, clipped = torch.where(dual, bound, loss), clipped | dual
    return loss, {"ratio": ratio.detach(), "clipped": clipped}


def _naive_pg(logprobs, mask, raw_rewards, advantages, old_logprobs, eps_low, eps_high, dual_clip_c):
    """-r * logp; raw_rewards (B, 1), logprobs (B, T) -> (B, T)."""
    raw_rewards = _require(raw_rewards, "raw_rewards", "loss_type 'naive'")
    return -raw_rewards * logprobs, _on_policy_meta(logprobs)


def _reinforce_baseline_pg(logprobs, mask, raw_rewards, advantages, old_logprobs, eps_low, eps_high, dual_clip_c):
    """-A * logp; advantages (B, 1), logprobs (B, T) -> (B, T)."""
    advantages = _require(advantages, "advantages", "loss_type 'reinforce_baseline'")
    return -advantages * logprobs, _on_policy_meta(logprobs)


def _grpo_clip_pg(logprobs, mask, raw_rewards, advantages, old_logprobs, eps_low, eps_high, dual_clip_c):
    """PPO-style clipped surrogate per token; advantages (B, 1), (old_)logprobs (B, T) -> (B, T)."""
    advantages = _require(advantages, "advantages", "loss_type 'grpo_clip'")
    old_logprobs = _require(old_logprobs, "old_logprobs", "loss_type 'grpo_clip'")
    # the sampling policy is a constant: never send gradient into it
    ratio = torch.exp(logprobs - old_logprobs.detach())  # (B, T)
    return _clipped_surrogate(ratio, advantages, eps_low, eps_high, dual_clip_c)


def _gspo_pg(logprobs, mask, raw_rewards, advantages, old_logprobs, eps_low, eps_high, dual_clip_c):
    """GSPO-token (Zheng et al. 2025): one ratio per sequence, s = exp(mean over its response tokens of
    logp - old_logp), clipped per sequence; mask, (old_)logprobs (B, T), advantages (B, 1) -> (B, T)."""
    advantages = _require(advantages, "advantages", "loss_type 'gspo'")
    old_logprobs = _require(old_logprobs, "old_logprobs", "loss_type 'gspo'")
    mask = _require(mask, "loss_mask", "loss_type 'gspo'")
    seq_log_ratio = masked_mean(logprobs - old_logprobs.detach(), mask, dim=-1).unsqueeze(-1)  # (B, 1)
    # the paper's sg[s] * pi / sg[pi]: the value is s on every token, token t's gradient is s * d logp_t,
    # so with seq_mean_token_mean this is the sequence-level GSPO gradient
    ratio = torch.exp(seq_log_ratio.detach() + logprobs - logprobs.detach())  # (B, T)
    return _clipped_surrogate(ratio, advantages, eps_low, eps_high, dual_clip_c)


def _cispo_pg(logprobs, mask, raw_rewards, advantages, old_logprobs, eps_low, eps_high, dual_clip_c):
    """CISPO (MiniMax-M1): -sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * logp; the clip bounds each
    token's weight, never its gradient. advantages (B, 1), (old_)logprobs (B, T) -> (B, T)."""
    advantages = _require(advantages, "advantages", "loss_type 'cispo'")
    old_logprobs = _require(old_logprobs, "old_logprobs", "loss_type 'cispo'")
    ratio = torch.exp(logprobs - old_logprobs.detach()).detach()  # (B, T)
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return -weight * advantages * logprobs, {"ratio": ratio, "clipped": weight != ratio}


_PG_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "naive": _naive_pg,
    "reinforce_baseline": _reinforce_baseline_pg,
    "grpo_clip": _grpo_clip_pg,
    "gspo": _gspo_pg,
    "cispo": _cispo_pg,
}


_PER_SEQUENCE = ("gspo",)  # losses whose advantage is one a sequence: token advantages (a teacher's) are refused


def policy_gradient_loss(
    loss_type: LossType,
    logprobs: Tensor,
    *,
    loss_mask: Tensor | None = None,
    raw_rewards: Tensor | None = None,
    advantages: Tensor | None = None,
    old_logprobs: Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token policy-gradient loss (to minimize).

    logprobs, old_logprobs, loss_mask: (B, T); raw_rewards: (B, 1); advantages: (B, 1), or (B, T) one a token (a
    teacher's reverse KL: teacher_advantages; not for gspo). naive: -r * logp; reinforce_baseline: -A * logp;
    grpo_clip: -min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A),
    clip_eps_high defaulting to clip_eps;
    gspo: the same with one ratio per sequence, exp(masked mean of logp - old_logp) (needs loss_mask);
    cispo: -sg(clip(ratio, 1 - clip_eps, 1 + clip_eps_high)) * A * logp;
    dual_clip_c (grpo_clip, gspo): where A < 0 the loss is at most -dual_clip_c * A.
    Returns loss (B, T) and detached per-token metadata {ratio, clipped}, each (B, T).
    """
    loss_fn = _lookup(_PG_LOSSES, loss_type, "loss_type")
    if advantages is not None and advantages.dim() == 2 and advantages.shape[1] != 1 and loss_type in _PER_SEQUENCE:
        raise ValueError(f"loss_type {loss_type!r} takes one advantage a sequence (B, 1), got (B, T) token advantages")
    if dual_clip_c is not None and loss_type not in get_args(DualClipLossType):
        raise ValueError(f"dual_clip_c applies to loss_type {list(get_args(DualClipLossType))}, not {loss_type!r}")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    return loss_fn(logprobs, loss_mask, raw_rewards, advantages, old_logprobs, clip_eps, eps_high, dual_clip_c)


# ---------------------------------------------------------------- KL to the reference
def _k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Schulman's k3 per token; (B, T) -> (B, T)."""
    # clamp before exp so a far-off token cannot overflow; it loses gradient past |20|
    log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return torch.exp(log_ratio) - log_ratio - 1.0


_KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": lambda logprobs, ref_logprobs: logprobs - ref_logprobs,
    "k2": lambda logprobs, ref_logprobs: 0.5 * (logprobs - ref_logprobs) ** 2,
    "k3": _k3,
}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) on tokens sampled from pi_theta.

    logprobs, ref_logprobs: (B, T) -> (B, T).
    k1 = log(pi/pi_ref) (unbiased, can be negative); k2 = 0.5 * k1**2;
    k3 = pi_ref/pi - log(pi_ref/pi) - 1 (Schulman; DeepSeekMath eq. 4): unbiased
    and non-negative, with log(pi_ref/pi) clamped to [-20, 20] before exp.
    """
    kl_fn = _lookup(_KL_ESTIMATORS, estimator, "KL estimator")
    # the reference is frozen
    return kl_fn(logprobs, ref_logprobs.detach())


# ---------------------------------------------------------------- behaviour correction (decoupled PPO)
# the clip is to pi_prox (old_logprobs: the learner before the iteration's first step); the weight
# pi_prox / pi_sampler corrects for having sampled from another policy (a stale one, other numerics)
_LEVELS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token": lambda log_ratio, mask: log_ratio,
    "sequence": lambda log_ratio, mask: log_ratio.sum(-1, keepdim=True).expand_as(log_ratio),
    "geometric": lambda log_ratio, mask: masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio),
}


def _band(weight: Tensor, bounds: tuple[float, float]) -> tuple[Tensor, Tensor]:
    """The weight (B, T) where it lies in [low, high], 0 elsewhere; and where it was masked (B, T) bool."""
    keep = (weight >= bounds[0]) & (weight <= bounds[1])
    return weight * keep, ~keep


_BEHAVIOR: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "none": lambda w, cap, mis, icepop: (torch.ones_like(w), torch.zeros_like(w, dtype=torch.bool)),
    "tis": lambda w, cap, mis, icepop: (w.clamp(max=cap), w > cap),
    "mis": lambda w, cap, mis, icepop: _band(w, mis),
    "icepop": lambda w, cap, mis, icepop: _band(w, icepop),
}


def behavior_weights(
    prox_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    correction: BehaviorCorrection,
    level: BehaviorLevel = "token",
    cap: float = 2.0,
    mis_bounds: tuple[float, float] = (0.0, 2.0),
    icepop_bounds: tuple[float, float] = (0.5, 5.0),
) -> tuple[Tensor, dict[str, Tensor]]:
    """Behaviour weights pi_prox / pi_sampler per token, corrected; no gradient.

    prox_logprobs (the learner's before its first step), sampler_logprobs, mask: (B, T) -> weights (B, T) and
    metrics over response tokens: behavior/weight_mean, behavior/weight_max, behavior/clipped_frac (truncated or
    masked), behavior/kl (k3 of KL(pi_sampler || pi_prox), on the sampler's tokens).
    level: the ratio of each token (token), of the response (sequence: the product over its tokens) or their
    geometric mean (geometric), log-ratio clamped to [-20, 20]; a response's weight goes to each of its tokens.
    none: 1; tis: min(w, cap); mis: w within mis_bounds, else 0; icepop: w within icepop_bounds, else 0.

    >>> prox, sampler = torch.log(torch.tensor([[0.5, 0.2]])), torch.log(torch.tensor([[0.25, 0.4]]))
    >>> behavior_weights(prox, sampler, torch.ones(1, 2), "tis", cap=1.5)[0]
    tensor([[1.5000, 0.5000]])
    >>> behavior_weights(prox, sampler, torch.ones(1, 2), "icepop", icepop_bounds=(0.6, 5.0))[0]
    tensor([[2., 0.]])
    """
    fix = _lookup(_BEHAVIOR, correction, "behavior correction")
    keep = mask.bool()
    log_ratio = (prox_logprobs.detach() - sampler_logprobs.detach()).masked_fill(~keep, 0.0)  # (B, T)
    raw = torch.exp(_lookup(_LEVELS, level, "behavior level")(log_ratio, mask).clamp(-20.0, 20.0))
    weights, clipped = fix(raw, cap, mis_bounds, icepop_bounds)
    metrics = {
        "behavior/weight_mean": masked_mean(weights, keep),
        "behavior/weight_max": weights.masked_fill(~keep, float("-inf")).max(),
        "behavior/clipped_frac": masked_mean(clipped.float(), keep),
        "behavior/kl": masked_mean(_k3(sampler_logprobs.detach(), prox_logprobs.detach()), keep),
    }
    return weights, metrics


# ---------------------------------------------------------------- aggregation
def _seq_mean(per_sequence: Tensor, sequences: float | None) -> Tensor:
    """(B,) -> scalar: the mean, or the sum / sequences (a microbatch's share of its minibatch's sequences)."""
    return per_sequence.mean() if sequences is None else per_sequence.sum() / sequences


def _seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, max_tokens: float | None, sequences: float | None) -> Tensor:
    """Per-sequence masked sum / max_tokens, mean over sequences; (B, T) -> scalar."""
    max_tokens = _require(max_tokens, "max_tokens", "agg mode 'seq_mean_token_sum_norm'")
    return _seq_mean(masked_normalize(loss, mask, max_tokens, dim=-1), sequences)


def _token_mean(loss: Tensor, mask: Tensor, max_tokens: float | None, tokens: float | Tensor | None, seqs) -> Tensor:
    """Masked sum / tokens (default: the mask's own token count); (B, T) -> scalar."""
    return masked_mean(loss, mask) if tokens is None else masked_normalize(loss, mask, tokens)


_AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, float | None, float | Tensor | None, float | None], Tensor]] = {
    # every response token weighs the same, so long answers weigh more (DAPO)
    "token_mean": _token_mean,
    # every sequence weighs the same (GRPO paper, CS336 default)
    "seq_mean_token_mean": lambda loss, mask, max_tokens, tokens, seqs: _seq_mean(
        masked_mean(loss, mask, dim=-1), seqs
    ),
    # constant divisor removes the length bias of the per-sequence mean (Dr.GRPO)
    "seq_mean_token_sum_norm": lambda loss, mask, max_tokens, tokens, seqs: _seq_mean_token_sum_norm(
        loss, mask, max_tokens, seqs
    ),
}


def aggregate_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    mode: AggMode,
    max_tokens: float | None = None,
    token_normalizer: float | Tensor | None = None,
    sequence_normalizer: float | None = None,
) -> Tensor:
    """Reduce a per-token loss (B, T) over response tokens (mask (B, T)) to a scalar.

    max_tokens is the constant divisor of 'seq_mean_token_sum_norm' (required there). token_normalizer is
    what 'token_mean' divides the masked sum by instead of the mask's own token count (a scalar);
    sequence_normalizer what the per-sequence modes divide their sum over sequences by instead of B (microbatches
    of unequal sizes: learn.microbatch_tokens). Each mode ignores the other's.

    >>> loss, mask = torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[1, 1, 0]])
    >>> aggregate_loss(loss, mask, "token_mean").item(), aggregate_loss(loss, mask, "token_mean", None, 6.0).item()
    (1.5, 0.5)
    >>> aggregate_loss(loss, mask, "seq_mean_token_mean", sequence_normalizer=3.0).item()
    0.5
    """
    fn = _lookup(_AGGREGATIONS, mode, "agg mode")
    return fn(per_token_loss, mask, max_tokens, token_normalizer, sequence_normalizer)


# ---------------------------------------------------------------- train step
def _actor_metrics(meta: dict[str, Tensor], mask: Tensor) -> dict[str, Tensor]:
    """Clip fraction and ratio stats over response tokens; meta tensors (B, T)."""
    keep = mask.bool()
    ratio = meta["ratio"].detach()
    return {
        "actor/clip_frac": masked_mean(meta["clipped"].float(), keep),
        "actor/ratio_mean": masked_mean(ratio, keep),
        "actor/ratio_max": ratio.masked_fill(~keep, float("-inf")).max(),
        "actor/ratio_min": ratio.masked_fill(~keep, float("inf")).min(),
    }


@dataclass(frozen=True)
class LossSpec:
    """The loss grpo_microbatch_step computes, fixed for a run: variant names and plain floats, built once from the
    config where the learner is set up (grpo/learner/loss.py), never a config object in the math.

    loss_type, clip_eps, clip_eps_high, dual_clip_c: policy_gradient_loss's; agg_mode and max_tokens (the constant
    divisor of seq_mean_token_sum_norm): aggregate_loss's; kl_coef, kl_estimator: the KL term (kl_penalty);
    behavior_correction, behavior_level, tis_cap, mis_bounds, icepop_bounds: behavior_weights'. Unknown names fail
    when the spec is made, listing the valid ones.
    """

    loss_type: LossType
    agg_mode: AggMode
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip_c: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    max_tokens: float | None = None
    behavior_correction: BehaviorCorrection = "none"
    behavior_level: BehaviorLevel = "token"
    tis_cap: float = 2.0
    mis_bounds: tuple[float, float] = (0.0, 2.0)
    icepop_bounds: tuple[float, float] = (0.5, 5.0)
    gkd_coef: float = 0.0  # the weight of topk_forward_kl's token mean, a term of its own (teacher.gkd_coef; 0: off)

    def __post_init__(self):
        _lookup(_PG_LOSSES, self.loss_type, "loss_type")
        _lookup(_AGGREGATIONS, self.agg_mode, "agg mode")
        _lookup(_KL_ESTIMATORS, self.kl_estimator, "KL estimator")
        _lookup(_BEHAVIOR, self.behavior_correction, "behavior correction")
        _lookup(_LEVELS, self.behavior_level, "behavior level")
        if self.dual_clip_c is not None and self.loss_type not in get_args(DualClipLossType):
            valid = list(get_args(DualClipLossType))
            raise ValueError(f"dual_clip_c applies to loss_type {valid}, not {self.loss_type!r}")

    @property
    def behavior(self) -> tuple:
        """behavior_weights' arguments after the log-probs and mask: (correction, level, cap, mis, icepop)."""
        return self.behavior_correction, self.behavior_level, self.tis_cap, self.mis_bounds, self.icepop_bounds


def grpo_microbatch_step(
    spec: LossSpec,
    logprobs: Tensor,
    loss_mask: Tensor,
    *,
    gradient_accumulation_steps: int,
    raw_rewards: Tensor | None = None,
    advantages: Tensor | None = None,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    sampler_logprobs: Tensor | None = None,
    token_normalizer: float | Tensor | None = None,
    sequence_normalizer: float | None = None,
    extra_loss: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss of one microbatch under `spec`, scaled by 1/gradient_accumulation_steps, then .backward() (with
    `extra_loss` added, already scaled, in the same backward: GKD's term from the same forward; not in the loss
    returned).

    logprobs, loss_mask, old_logprobs, ref_logprobs: (B, T); raw_rewards: (B, 1); advantages: (B, 1) or (B, T)
    (token advantages: teacher_advantages); loss_mask is 1
    on the tokens the loss counts (the loss, KL, metrics and behaviour weights see only those). sampler_logprobs
    (B, T), needed by a spec.behavior_correction other than "none", which weighs each token's policy-gradient loss
    by behavior_weights(old_logprobs, sampler_logprobs, ...) (decoupled PPO: the clip is to old_logprobs = pi_prox,
    the weight pi_prox / pi_sampler corrected). The KL term is added only when spec.kl_coef > 0; with kl_coef == 0
    a given ref_logprobs is still reported as loss/kl. Equal-size microbatches
    reproduce the full-batch gradient for the seq_* modes (each sequence weighs 1 / (B x steps)). token_mean
    divides the microbatch's token sum by token_normalizer: given the minibatch's response tokens (every
    microbatch's, every rank's) / (gradient_accumulation_steps x ranks averaging their gradients), every token
    of the minibatch weighs 1 / its tokens, as DAPO's token mean asks, however unequal the microbatches; left
    None, each microbatch's own token mean, which weighs a token 1 / (steps x tokens of its microbatch). The
    per-sequence modes divide the microbatch's sequence sum by sequence_normalizer where given (the process's
    minibatch sequences / gradient_accumulation_steps: microbatches of unequal sizes), else by its B.
    Returns the scaled loss (scalar, detached) and detached metrics; loss/pg and
    loss/kl are the unscaled microbatch values.
    """
    if gradient_accumulation_steps < 1:
        raise ValueError("gradient_accumulation_steps must be >= 1")
    if spec.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 requires `ref_logprobs`")
    # a token outside the mask counts for nothing, whatever log-probs it holds (an observation's, padding's): its
    # ratio is 1 and its KL 0, so no inf or nan can reach the gradient through it
    keep, own = loss_mask.bool(), logprobs.detach()
    old_logprobs, ref_logprobs, sampler_logprobs = (
        None if x is None else torch.where(keep, x, own) for x in (old_logprobs, ref_logprobs, sampler_logprobs)
    )
    pg_loss, meta = policy_gradient_loss(
        spec.loss_type,
        logprobs,
        loss_mask=loss_mask,
        raw_rewards=raw_rewards,
        advantages=advantages,
        old_logprobs=old_logprobs,
        clip_eps=spec.clip_eps,
        clip_eps_high=spec.clip_eps_high,
        dual_clip_c=spec.dual_clip_c,
    )
    behavior = {}
    if spec.behavior_correction != "none":  # none: the loss as it always was, not multiplied by 1
        weights, behavior = behavior_weights(
            _require(old_logprobs, "old_logprobs", "behavior_correction"),
            _require(sampler_logprobs, "sampler_logprobs", "behavior_correction"),
            loss_mask,
            *spec.behavior,
        )  # (B, T)
        pg_loss = pg_loss * weights
    per_token = pg_loss  # (B, T)
    norms = (spec.max_tokens, token_normalizer, sequence_normalizer)
    metrics = {"loss/pg": aggregate_loss(pg_loss, loss_mask, spec.agg_mode, *norms).detach()}
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, spec.kl_estimator)  # (B, T)
        metrics["loss/kl"] = aggregate_loss(kl, loss_mask, spec.agg_mode, *norms).detach()
        if spec.kl_coef > 0:
            per_token = per_token + spec.kl_coef * kl
    loss = aggregate_loss(per_token, loss_mask, spec.agg_mode, *norms)
    loss = loss / gradient_accumulation_steps
    (loss if extra_loss is None else loss + extra_loss).backward()
    metrics.update(_actor_metrics(meta, loss_mask))
    metrics.update(behavior)
    return loss.detach(), metrics
