"""Every variant name, declared once: grpo.core registers its functions under these names (the episode engine its
environment adapters: grpo.episodes.adapters.KINDS) and grpo.config accepts exactly these (an unknown name fails
there, listing the valid ones); an environment's kind is decided here, once (environment_kind)."""

from typing import Literal

AdvantageMode = Literal["naive", "centered", "normalized"]
LossType = Literal["naive", "reinforce_baseline", "grpo_clip", "gspo", "cispo"]
DualClipLossType = Literal["grpo_clip", "gspo"]  # the losses learn.dual_clip_c bounds (clipped surrogates)
KLEstimator = Literal["k1", "k2", "k3"]
AggMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
BehaviorCorrection = Literal["none", "tis", "mis", "icepop"]  # the weight pi_prox / pi_sampler: off, truncated, masked
BehaviorLevel = Literal["token", "sequence", "geometric"]  # what that weight is a ratio of (grpo.core.behavior_weights)
TeacherMode = Literal["reverse_kl", "add"]  # the teacher's token advantage alone, or added to GRPO's (grpo.core)
OldLogprobs = Literal["auto", "recompute", "sampler"]  # where the learner takes pi_old from (grpo.learner.OLD_LOGPROBS)
SERVERS = {"http": "openenv", "https": "openenv", "ws": "openenv", "wss": "openenv"}
"""A URL's scheme -> the kind of environment server rollout.environment names by it (grpo.episodes.adapters.KINDS: a
class or a function is named path/to/file.py:name or package.module:name instead)."""


def is_url(spec: str | None) -> bool:
    """Whether rollout.environment names a server (a URL of a scheme in SERVERS) rather than a class.

    >>> is_url("http://127.0.0.1:8000"), is_url("wss://env.example/x"), is_url("envs/game.py:Game"), is_url(None)
    (True, True, False, False)
    """
    return bool(spec) and spec.split("://", 1)[0] in SERVERS


def environment_kind(environment: str | None, tools: list[str]) -> str | None:
    """The adapter kind (a key of grpo.episodes.adapters.KINDS) that rollout.environment and rollout.tools name,
    decided here once for the config's check and the adapters alike; None: single-turn rollouts.

    >>> environment_kind(None, []), environment_kind(None, ["m:f"]), environment_kind("m:C", ["m:f"])
    (None, 'tools', 'environment')
    >>> environment_kind("http://127.0.0.1:8000", [])
    'openenv'
    """
    if environment:
        return SERVERS[environment.split("://", 1)[0]] if is_url(environment) else "environment"
    return "tools" if tools else None
