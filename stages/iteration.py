"""What runs an iteration: the stages in order, where a run resumes, and what one process keeps
warm from one iteration to the next. `grpo run`, the flow `grpo` and the benchmarks go through here.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

from grpo.layout import POLICY_PREFIXES, STAGES, STATE_PREFIXES, stage_dir
from grpo.storage import Committed, Storage, committed_attempts, read_collected
from grpo.tracking import track
from stages import stage_function
from stages.common import load_run, stale_attempt
from stages.rewards import WARM_POOLS


def _committed(storage: Storage, run_id: str, k: int, stage: str) -> bool:
    return bool(committed_attempts(storage, stage_dir(storage, run_id, k, stage)))


def _finished(storage: Storage, run_id: str, k: int) -> bool:
    """Iteration k has a committed eval whose chain (learn, advantages, ..., snapshot) is current; an eval that
    eval.every skipped commits too (stages.eval.skip), so this holds for it alike."""
    attempts = committed_attempts(storage, stage_dir(storage, run_id, k, "eval"))
    return bool(attempts) and not stale_attempt(storage, attempts[-1])


def next_iteration(storage: Storage, run_id: str) -> int:
    """The first unfinished iteration: the first without a committed `eval`, or whose stages were
    made stale by a forced rerun of an earlier stage (the run resumes there and rebuilds them)."""
    last = 0
    while _committed(storage, run_id, last, "learn"):
        last += 1
    return next((k for k in range(last) if not _finished(storage, run_id, k)), last)


def _collected_learn(storage: Storage, run_id: str, k: int) -> str | None:
    """What `grpo gc --retention` collected of iteration k's committed learn, as a phrase ("iteration 1's policy
    and optimizer state, which was collected ... (attempt: files)"), or None: nothing (or no learn)."""
    attempts = committed_attempts(storage, stage_dir(storage, run_id, k, "learn")) if k >= 0 else []
    names = sorted(read_collected(storage, attempts[-1])) if attempts else []
    if not names:
        return None
    policy = [n for n in names if n.startswith(POLICY_PREFIXES) and not n.startswith(STATE_PREFIXES)]
    state = [n for n in names if n.startswith(STATE_PREFIXES)]
    what = " and ".join(w for w, files in (("policy", policy), ("optimizer state", state)) if files)
    shown = ", ".join((policy + state)[:3]) + (", ..." if len(names) > 3 else "")
    return (
        f"iteration {k}'s {what}, which was collected by `grpo gc --retention` ({storage.uri(attempts[-1])}: {shown})"
    )


def stuck_at(storage: Storage, run_id: str, k: int) -> str | None:
    """Why running iteration k stops at its learn, or None: the learn is stale (or missing) and rerunning it needs
    files of learn k-1 that gc collected. A forced stage no longer leaves a run so (dead_end); one forced before
    that check, or behind its back, may have."""
    learned = committed_attempts(storage, stage_dir(storage, run_id, k, "learn"))
    if learned and not stale_attempt(storage, learned[-1]):
        return None
    return _collected_learn(storage, run_id, k - 1)


def dead_end(storage: Storage, run_id: str, iteration: int, stage: str) -> str | None:
    """Why a new attempt of `stage` of `iteration` (--force) would leave the run stuck, or None. A stage before
    learn makes the iteration's learn stale, and rerunning that learn needs the previous learn's policy and
    optimizer state, which `grpo gc --retention` keeps only for the newest learn (and the one `grpo run`
    continues from). Asked before anything is written, so the run stays as it was; learn and eval read what
    they need themselves and fail, committing nothing, where it is gone."""
    if stage in ("learn", "eval") or iteration == 0:
        return None
    gone = _collected_learn(storage, run_id, iteration - 1)
    if gone is None:
        return None
    return (
        f"{stage} iteration {iteration} --force: a new attempt makes iteration {iteration}'s learn stale, and "
        f"rerunning it needs {gone}; nothing written. The run goes on with `grpo run --run {run_id} --start "
        f"{next_iteration(storage, run_id)}`"
    )


def resume_problem(storage: Storage, run_id: str, start: int) -> str | None:
    """The line refusing `grpo run --start start` where iteration `start` cannot be rebuilt (stuck_at): every later
    stage reads the stale chain (stages.common.check_chain), so the run cannot go on; its newest policy can, in a
    new run. None where the run can start there."""
    gone = stuck_at(storage, run_id, start)
    if gone is None:
        return None
    return (
        f"iteration {start} is stale and rerunning its learn needs {gone}; nothing run. This run cannot go on past "
        f"it: export its newest policy with `grpo export --run {run_id} --out DIR` and start a new run from it with "
        "`grpo init --run NEW --set model.base_model=DIR`"
    )


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
    - the reward worker pool (stages.rewards.WARM_POOLS): one for all iterations, stopped on exit;
    - the learner one learn hands to the next iteration's (stages.learn.WARM, keyed by the commit it
      made; on a GPU it waits in CPU memory);
    - the sampling engine (grpo.generation's live generators): reloaded in place with each new
      policy, asleep while the learner runs; `grpo.generation.close_generators()` stops it;
    - gc.freeze of what the first iteration loaded (WarmState.loaded), undone on exit.
    The learner and the engine outlive the block (a later block in the process takes them up again if
    its run continues theirs). Process-wide caches that need no owner, read-only and bounded: tokenizer
    and config per checkpoint files (grpo.checkpoint), file-hash stamps (grpo.storage), datasets
    (grpo.data), config type hints (grpo.config).
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
    and commits what one uninterrupted call does."""
    cfg = load_run(storage, run_id)
    with warm_state() as warm:
        for k in range(first, first + iterations):
            out = run_iteration(storage, run_id, k, last=k == first + iterations - 1)
            warm.loaded()
            track(storage, run_id, cfg)
            yield k, out
