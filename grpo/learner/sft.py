"""The warm start on this learner (sft: stages/sft.py): supervised cross-entropy over the assistant tokens of
conversations is the policy-gradient loss with advantage 1, -1 * log p per token (loss_type reinforce_baseline), the
token mean over loss_mask (DAPO's token_mean: every trained token of a minibatch weighs the same, as TRL's SFT loss),
no clip, no KL, pi_old never read. So the warm start runs on the learner the RL iterations use, `train` and all it
covers (PolicyLM's packing, LoRA, fsdp2 and torchrun, every family's learner path), from a Batch whose groups are one
conversation each: the prompt (the messages before the first assistant turn), then the rest of the conversation as
the response (grpo.episodes.transcripts: loss mask 1 on the assistant's tokens, 0 on what answered them).
"""

from __future__ import annotations

import dataclasses

import torch

from grpo.config import RunConfig, validate
from grpo.data import draw_at
from grpo.learner.batch import Batch

WARM_START_ITERATION = -1
"""The iteration the warm start's seeds, metrics rows and token versions name: before iteration 0 (its policy is
version -1, which iteration 0 samples)."""


def sft_run_config(cfg: RunConfig) -> RunConfig:
    """The run's config with learn set for the warm start (cfg.sft's lr, minibatch and microbatch; one pass over the
    Batch that `conversation_order` draws; the loss above) and the rest as the run's: its model, LoRA, precision,
    sharding and processes. Valid as a whole (a torchrun rank loads and checks it again)."""
    s = cfg.sft
    learn = dataclasses.replace(
        cfg.learn,
        loss_type="reinforce_baseline",
        agg_mode="token_mean",
        kl_coef=0.0,
        ref_update_every=None,
        dual_clip_c=None,
        epochs=1,
        lr=s.lr,
        lr_decay_steps=0,
        minibatch_size=s.minibatch_size,
        microbatch_size=s.microbatch_size,
        microbatch_tokens=None,
        behavior_correction="none",
        old_logprobs="sampler",
        max_token_age=None,
        max_logprob_gap=None,
    )
    rollout = dataclasses.replace(
        cfg.rollout, group_size=1, prompts_per_iteration=s.minibatch_size, min_signal_groups=None, shards=1
    )
    out = dataclasses.replace(
        cfg,
        learn=learn,
        rollout=rollout,
        advantage=dataclasses.replace(cfg.advantage, mode="naive", filter_zero_variance=False),
        reward=dataclasses.replace(cfg.reward, shards=1),
    )
    validate(out)
    return out


def conversation_order(conversations: int, steps: int | None, epochs: int, minibatch: int, seed: int) -> list[int]:
    """The conversations the warm start trains on, in order: `steps` minibatches (or `epochs` passes, whole
    minibatches), drawn epoch by epoch without replacement in a seeded order (grpo.data.draw_at).

    >>> conversation_order(3, 2, 1, 2, 0) == draw_at(3, 0, 4, 0), len(conversation_order(5, None, 2, 2, 0))
    (True, 10)
    """
    total = steps * minibatch if steps is not None else conversations * epochs
    return draw_at(conversations, 0, total, seed)


def conversation_batch(rows: list[tuple[list[int], list[int], list[int]]], pad_id: int) -> Batch:
    """The learner's Batch of conversations, a group of one each: rows of (prompt ids, response ids, loss mask);
    advantage and reward 1, sampler log-probs 0 (never read: pi_old is not in this loss), every token version -1;
    trained in the rows' order (in_order)."""
    n = len(rows)
    lp = max(len(p) for p, _, _ in rows)
    t = max(len(r) for _, r, _ in rows)
    prompt_ids = torch.full((n, lp), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, lp), dtype=torch.long)
    response_ids = torch.full((n, t), pad_id, dtype=torch.long)
    response_mask = torch.zeros((n, t))
    loss_mask = torch.zeros((n, t))
    for i, (p, r, m) in enumerate(rows):
        prompt_ids[i, lp - len(p) :], prompt_mask[i, lp - len(p) :] = torch.tensor(p), 1  # left-padded
        response_ids[i, : len(r)], response_mask[i, : len(r)] = torch.tensor(r), 1.0
        loss_mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
    return Batch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        loss_mask=loss_mask,
        sampler_logprobs=torch.zeros((n, t)),
        token_versions=torch.full((n, t), WARM_START_ITERATION, dtype=torch.long),
        advantages=torch.ones(n),
        rewards=torch.ones(n),
        group_size=1,
        prompt_id=list(range(n)),
        sample_index=[0] * n,
        in_order=True,  # conversation_order's minibatches, as drawn: the learner does not shuffle them again
    )
