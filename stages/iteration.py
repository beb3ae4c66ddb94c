"""What runs an iteration: the stages in order, where a run resumes, and what one process keeps
warm from one iteration to the next. `grpo run`, the flow `grpo` and the benchmarks go through here.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

from grpo.record.layout import STAGES
from grpo.record.storage import Committed, Storage
from grpo.runtime.pool import WARM_POOLS
from grpo.tracking import track, tracking
from stages import stage_function
from stages.common import load_run


def run_iteration(
    storage: Storage, run_id: str, iteration: int, force: bool = False, last: bool = True
) -> dict[str, Committed]:
    """All stages of one iteration in order; committed ones with the same identity are reused. `last`: the
    iteration ends its caller's run, so its eval runs whatever eval.every says (stages.eval.due)."""
    extra = {"eval": {"last": last}}
    return {
        name: stage_function(name)(storage, run_id, iteration, force=force, **extra.get(name, {})) for name in STAGES
    }


class WarmState:
    """Handle of `warm_state`: call `loaded()` after each iteration."""

    def __init__(self):
        self.frozen = False

    def loaded(self) -> None:
        """After the first iteration: imports, engine and models are millions of objects that live as
        long as the process; freeze them out of later full collections (~0.3 s every ~10 iterations)."""
        if not self.frozen:
            gc.freeze()
            self.frozen = True


@contextmanager
def warm_state() -> Iterator[WarmState]:
    """Everything one process keeps between the iterations it runs, entered once by the flow and by
    `grpo run`:
    - the reward worker pool (grpo.runtime.pool.WARM_POOLS): one for all iterations, stopped on exit;
    - the learner one learn hands to the next iteration's (stages.learn.WARM, keyed by the commit it
      made; on a GPU it waits in CPU memory, unless it has a device of its own: grpo.devices.apart);
    - the sampling engine (grpo.sampling's live generators): reloaded in place with each new
      policy, asleep while the learner runs on its device; `grpo.engines.close_generators()` stops it;
    - gc.freeze of what the first iteration loaded (WarmState.loaded), undone on exit.
    The learner and the engine outlive the block (a later block in the process takes them up again if
    its run continues theirs). Process-wide caches that need no owner, read-only and bounded: tokenizer
    and config per checkpoint files (grpo.record.checkpoint), file-hash stamps (grpo.record.storage), datasets
    (grpo.data), config type hints (grpo.config); the first two locked, as the flow's learn may run in a
    thread beside the sampling stages (flows/placement.py overlapping).
    """
    state = WarmState()
    with WARM_POOLS.keep():
        try:
            yield state
        finally:
            if state.frozen:
                gc.unfreeze()


def run_warm(storage: Storage, run_id: str, first: int, iterations: int) -> Iterator[tuple[int, dict]]:
    """Iterations first.. in this process, warm: yields (k, run_iteration's committed outputs); each
    committed iteration goes to the experiment tracker (tracking.backend). The last one is evaluated whatever
    eval.every says: a resumed call (first = next_iteration) ending where the stopped one would have evaluates
    and commits what one uninterrupted call does. The devices every stage runs on exist here (a ConfigError naming
    the field), checked before the first stage commits anything."""
    cfg = load_run(storage, run_id)
    if iterations > 0:
        from grpo import devices  # torch: a finished run's no-op (`grpo demo` again) imports none

        devices.check(cfg, set(STAGES))
        if cfg.sft is not None:  # the warm start first (where none is committed), and GRPO only past its gate
            from stages.sft import warm_start

            warm_start(storage, run_id)
    with warm_state() as warm, tracking(storage, run_id, cfg):  # the tracker run ended with the iterations
        for k in range(first, first + iterations):
            out = run_iteration(storage, run_id, k, last=k == first + iterations - 1)
            warm.loaded()
            track(storage, run_id, cfg)
            yield k, out
