"""The loss the config asks for, as the math takes it: learn.* (and rollout.max_tokens, Dr.GRPO's divisor) made
into grpo.core's LossSpec once, where a Learner is set up, so no config object reaches the math; and the tokens it
trains on, of the ages learn.max_token_age allows."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from grpo import core
from grpo.config import RunConfig
from grpo.errors import LearnError
from grpo.learner.batch import Batch


def loss_spec(cfg: RunConfig) -> core.LossSpec:
    """The run's loss: variant names and plain floats of learn.*, rollout.max_tokens (the response budget,
    seq_mean_token_sum_norm's constant divisor) and teacher.gkd_coef (GKD's term)."""
    lcfg = cfg.learn
    return core.LossSpec(
        loss_type=lcfg.loss_type,
        agg_mode=lcfg.agg_mode,
        clip_eps=lcfg.clip_eps,
        clip_eps_high=lcfg.clip_eps_high,
        dual_clip_c=lcfg.dual_clip_c,
        kl_coef=lcfg.kl_coef,
        kl_estimator=lcfg.kl_estimator,
        max_tokens=cfg.rollout.max_tokens,
        behavior_correction=lcfg.behavior_correction,
        behavior_level=lcfg.behavior_level,
        tis_cap=lcfg.tis_cap,
        mis_bounds=lcfg.mis_bounds,
        icepop_bounds=lcfg.icepop_bounds,
        gkd_coef=0.0 if cfg.teacher is None else cfg.teacher.gkd_coef,
    )


def within_age(batch: Batch, start_version: int, max_age: int | None) -> tuple[Batch, dict]:
    """The batch whose loss_mask leaves out the tokens older than `max_age` (None: none), and what the learn
    manifest records of the ages: the trained (loss_mask 1) tokens of each age (`token_ages`), the largest
    (`largest_token_age`) and, with max_age, those masked for it (`tokens_too_old`). A token's age is
    `start_version` (the policy the update starts from: grpo.record.lineage.policy_version) minus the version that
    sampled it; each token counts once, however many epochs train on it."""
    age = start_version - batch.token_versions  # (N, T)
    sampled = batch.loss_mask.bool()
    if bool((age[sampled] < 0).any()):
        raise LearnError(
            f"learn: a token was sampled by policy version {int(batch.token_versions[sampled].max())}, newer than "
            f"the policy this update starts from ({start_version}); the rollouts' token_versions are not this run's"
        )
    old = sampled & (age > max_age) if max_age is not None else torch.zeros_like(sampled)
    trained = sampled & ~old
    ages = {
        "token_ages": _counts(age[trained]),
        "largest_token_age": int(age[trained].max()) if bool(trained.any()) else None,
    }
    if max_age is None:
        return batch, ages
    ages["tokens_too_old"] = _counts(age[old])
    return dataclasses.replace(batch, loss_mask=batch.loss_mask * trained), ages


def _counts(ages: Tensor) -> dict[str, int]:
    """{age: tokens} of a 1-d tensor of ages, ages ascending (JSON keys: strings)."""
    values, counts = torch.unique(ages, return_counts=True)
    return {str(v): c for v, c in zip(values.tolist(), counts.tolist())}
