"""The loss the config asks for, as the math takes it: learn.* (and rollout.max_tokens, Dr.GRPO's divisor) made
into grpo.core's LossSpec once, where a Learner is set up, so no config object reaches the math."""

from __future__ import annotations

from grpo import core
from grpo.config import RunConfig


def loss_spec(cfg: RunConfig) -> core.LossSpec:
    """The run's loss: variant names and plain floats of learn.*, and rollout.max_tokens (the response budget,
    seq_mean_token_sum_norm's constant divisor)."""
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
    )
