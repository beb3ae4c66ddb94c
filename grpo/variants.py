"""Every variant name, declared once: grpo.core registers its functions under these names and
grpo.config accepts exactly these (an unknown name fails there, listing the valid ones)."""

from typing import Literal

AdvantageMode = Literal["naive", "centered", "normalized"]
LossType = Literal["naive", "reinforce_baseline", "grpo_clip", "gspo", "cispo"]
DualClipLossType = Literal["grpo_clip", "gspo"]  # the losses learn.dual_clip_c bounds (clipped surrogates)
KLEstimator = Literal["k1", "k2", "k3"]
AggMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
BehaviorCorrection = Literal["none", "tis", "mis", "icepop"]  # the weight pi_prox / pi_sampler: off, truncated, masked
BehaviorLevel = Literal["token", "sequence", "geometric"]  # what that weight is a ratio of (grpo.core.behavior_weights)
OldLogprobs = Literal["auto", "recompute", "sampler"]  # where the learner takes pi_old from (grpo.learner.OLD_LOGPROBS)
