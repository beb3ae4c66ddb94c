"""The learner one learn hands to the next iteration's in the same process, keyed by the commit it made."""

from __future__ import annotations

import json

from grpo.config import RunConfig
from grpo.learner.state import Learner


class WarmLearners:
    """At most one Learner kept after a committed `learn`, keyed by that commit's URI.

    The next iteration's learn takes it when its `previous` input is that commit, with the same
    learn config; anything else (a forced rerun, another run, a failed step that left the model
    half-updated) builds a fresh Learner from the committed files. The reference is not part of the
    key: a learner taken loads the iteration's reference when it holds another (Learner.use_reference;
    learn.ref_update_every moves it).
    On a GPU the kept learner waits in CPU memory, leaving the GPU to the sampler, unless the sampler has a
    device of its own (grpo.devices.apart): then it stays on its device.
    Change the key only with tests test_warm_iterations_commit_what_cold_ones_do and
    test_optimizer_state_carries_to_next_iteration in view.
    """

    def __init__(self):
        self._key: tuple | None = None
        self._learner: Learner | None = None

    @staticmethod
    def key(cfg: RunConfig, learn_uri: str) -> tuple:
        return learn_uri, json.dumps(cfg.to_dict()["learn"], sort_keys=True)

    def keep(self, key: tuple, learner: Learner, offload: bool = True) -> None:
        if offload:
            learner.to("cpu")
        self._key, self._learner = key, learner

    def take(self, key: tuple) -> Learner | None:
        learner = self._learner if key == self._key else None
        self._key = self._learner = None  # taken or stale: either way not reusable again
        if learner is not None:
            learner.to(learner.device)
        return learner


WARM = WarmLearners()
