"""The typed batch the learner trains on: one iteration's kept samples in whole groups, and the log-probs
scored for them (pi_old, the reference)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Batch:
    """One iteration's kept samples, whole groups in (prompt_id, sample_index) order.

    Group g (one prompt, G = group_size samples) holds samples g*G .. g*G+G-1; P groups, N = P*G. A sample is an
    episode: its response is every token after the prompt (each turn's sampled ones and the observations appended
    between turns), in the order they were appended; the forward sees them all, the loss the sampled ones.
    """

    prompt_ids: Tensor  # (P, Lp) long, left-padded: one row per group
    prompt_mask: Tensor  # (P, Lp) long
    response_ids: Tensor  # (N, T) long, right-padded
    response_mask: Tensor  # (N, T) float, each row a prefix of ones: the tokens there (the forward's)
    # (N, T) float: 1 on the tokens the loss trains on (those the sampler produced), 0 on an episode's observation and
    # template tokens (context only) and on padding; every loss, KL, metric and token count of the update is over it
    loss_mask: Tensor
    sampler_logprobs: Tensor  # (N, T) the sampler's log-prob of each sampled token (0 where loss_mask is 0)
    token_versions: Tensor  # (N, T) long: the policy version that sampled each token (the rollouts' policy_version)
    advantages: Tensor  # (N,) one a sample, or (N, T) one a token (a teacher's: stages/teacher.py)
    rewards: Tensor  # (N,)
    group_size: int
    prompt_id: list[int]  # (N,) the keys of each sample, for the log-probs table
    sample_index: list[int]
    # teacher.gkd_coef: the teacher's top k ids and log-probs (N, T, k) and the mass outside them (N, T) on each loss
    # token (stages/teacher.py); None without GKD
    topk_ids: Tensor | None = None
    topk_logprobs: Tensor | None = None
    topk_tail: Tensor | None = None
    # True: the groups train in this order, minibatch after minibatch (a warm start's conversation_order, drawn
    # epoch by epoch without replacement); False: `train` shuffles them each epoch (an iteration's samples)
    in_order: bool = False

    def to(self, device) -> Batch:
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if torch.is_tensor(getattr(self, f.name))
            },
        )

    def advantages_of(self, rows: Tensor) -> Tensor:
        """The advantages of sample rows `rows` as the losses take them: (R, 1) one a sample, (R, T) one a token."""
        a = self.advantages[rows]
        return a if a.dim() == 2 else a[:, None]

    def rows(self, groups: Tensor) -> Tensor:
        """Sample rows of `groups`: (P',) -> (P' * G,), group by group."""
        g = self.group_size
        return (groups[:, None] * g + torch.arange(g, device=groups.device)).reshape(-1)


@dataclass(frozen=True)
class Scores:
    """The log-probs every minibatch's loss compares against, computed before the first update."""

    old_logprobs: Tensor  # (N, T) the snapshot policy's, without gradient
    ref_logprobs: Tensor | None  # (N, T) the frozen reference's; None without a KL penalty
