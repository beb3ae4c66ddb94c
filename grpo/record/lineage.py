"""A run's lineage: which committed attempt of a stage is current, whether an attempt's inputs were replaced
since (stale), where a run resumes, which policy an iteration samples (rollout.staleness) and which iteration
is the KL reference of another. Stages check their inputs here before running; `grpo run`, `grpo status` and gc
ask the same questions.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

import fsspec

from grpo.errors import StageError
from grpo.record.layout import POLICY_PREFIXES, STATE_PREFIXES, STATE_STAGE, stage_dir
from grpo.record.storage import (
    Committed,
    CorruptArtifactError,
    NotCommittedError,
    Storage,
    collected_files,
    committed_attempts,
    latest_committed,
    load_manifest,
    read_collected,
)


def _newest_ref(storage: Storage, stage_dir: str) -> tuple[str, str] | None:
    """(uri, manifest sha256) of the newest committed attempt in `stage_dir`, or None."""
    attempts = committed_attempts(storage, stage_dir)
    if not attempts:
        return None
    return storage.uri(attempts[-1]), load_manifest(storage, attempts[-1], verify=False)[1]


def stale_input(storage: Storage, committed: Committed, seen: set | None = None) -> tuple[str, str, str] | None:
    """The first input of `committed`'s chain that a newer attempt replaced: (attempt that read it,
    the input it read, the newer one); None when the chain is current.

    Follows the inputs of the same run down to the previous iteration's `learn` and the base model
    (their own chains were checked when they ran): after `grpo stage rollouts --force`, the rewards,
    advantages and learn made from the old rollouts are stale.
    """
    seen = set() if seen is None else seen
    for name, ref in sorted(committed.manifest.inputs.items()):
        path = fsspec.core.strip_protocol(ref.uri) if "://" in ref.uri else ref.uri
        newest = _newest_ref(storage, path.rstrip("/").rsplit("/", 1)[0])
        if newest is not None and newest[1] != ref.manifest_sha256:
            return committed.uri, ref.uri, newest[0]
        if ref.manifest_sha256 in seen:
            continue
        seen.add(ref.manifest_sha256)
        manifest, sha = load_manifest(storage, path, verify=False)
        if manifest.iteration is not None and manifest.iteration == committed.manifest.iteration:
            found = stale_input(storage, Committed(storage, path, manifest, sha), seen)
            if found:
                return found
    return None


def stale_attempt(storage: Storage, attempt_dir: str) -> bool:
    """Whether a committed attempt was made from inputs a newer attempt replaced (stale_input)."""
    manifest, sha = load_manifest(storage, attempt_dir, verify=False)
    return stale_input(storage, Committed(storage, attempt_dir, manifest, sha)) is not None


# what tells this process's commits from another's: when it started, and the attempts it committed
_STARTED = dt.datetime.now(dt.timezone.utc)


_COMMITTED_HERE: set[str] = set()


def note_committed(attempt_dir: str) -> None:
    """Record an attempt this process committed (`raced` then never calls it another's)."""
    _COMMITTED_HERE.add(attempt_dir)


def raced(storage: Storage, attempt_dir: str) -> str | None:
    """The message for a committed attempt that another process committed after this one started
    (two processes driving one run, or a stage forced beside a running one); None when it was this
    process's own, or older."""
    if attempt_dir in _COMMITTED_HERE:
        return None
    manifest, _ = load_manifest(storage, attempt_dir, verify=False)
    if dt.datetime.fromisoformat(manifest.committed_at) < _STARTED:
        return None
    where = manifest.stage if manifest.iteration is None else f"{manifest.stage} {manifest.iteration}"
    return f"another process committed {where} ({manifest.attempt}) while this one ran; nothing to do"


def check_chain(storage: Storage, run_id: str, iteration: int, stage: str, inputs: dict[str, Committed]) -> None:
    """Every input of a stage must come from the current chain of its iteration (see stale_input);
    the error names both attempts and the command that rebuilds the chain, or, when another process
    committed the newer attempt while this one ran, says so (this one lost the race; see `raced`)."""
    seen: set = set()
    for name, committed in inputs.items():
        found = stale_input(storage, committed, seen)
        if found:
            reader, old, new = found
            race = raced(storage, fsspec.core.strip_protocol(new) if "://" in new else new)
            if race:
                raise StageError(race)
            start = min(iteration, next_iteration(storage, run_id))  # an earlier iteration's learn may be stale
            raise StageError(
                f"{stage} iteration {iteration}: input {name} is stale: {reader} was made from {old}, "
                f"which {new} replaced; rebuild the chain with `grpo run --run {run_id} --start "
                f"{start}` (it reruns only the stale stages)"
            )


def committed_input(storage: Storage, run_id: str, iteration: int | None, stage: str) -> Committed:
    """The newest committed output of `stage`; a clear error says what to run. Its files are checked as
    they are read (Committed.read_path, grpo.record.checkpoint), only those: a snapshot reads manifests alone, a
    sampler the policy and not the optimizer state."""
    try:
        found = latest_committed(storage, stage_dir(storage, run_id, iteration, stage), verify=False)
        return dataclasses.replace(found, collected=collected_files(storage, found.attempt_dir, found.manifest))
    except CorruptArtifactError as e:
        if stage == "base":
            raise StageError(
                f"{e}: the run's base model changed after its commit; restore its files or make a new run"
            ) from e
        raise StageError(
            f"{e}: the committed {stage} changed after its commit; make a new attempt with "
            f"`grpo stage {stage} --run {run_id} --iteration {iteration} --force` (the damaged "
            "one stays for inspection)"
        ) from e
    except NotCommittedError as e:
        if stage == "base":  # an init that stopped after run.json: running it again finishes it
            raise StageError(
                f"input missing: {e}; run `grpo init --run {run_id}` (it reads run.json) to commit the base model"
            ) from e
        raise StageError(
            f"input missing: {e}; run `grpo stage {stage} --run {run_id} --iteration {iteration}` first"
        ) from e


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


def newest_learn(storage: Storage, run_id: str) -> int:
    """The last iteration of the unbroken chain of committed learns from 0 (-1: none yet), stale or not."""
    k = -1
    while _committed(storage, run_id, k + 1, "learn"):
        k += 1
    return k


def first_stale_learn(storage: Storage, run_id: str) -> int | None:
    """The first iteration whose newest committed learn is stale (stale_input): its policy, and every later one made
    from it, is not the run's current chain. None: every committed learn is current."""
    for k in range(newest_learn(storage, run_id) + 1):
        if stale_attempt(storage, committed_attempts(storage, stage_dir(storage, run_id, k, "learn"))[-1]):
            return k
    return None


def newest_current_learn(storage: Storage, run_id: str) -> tuple[int, int | None]:
    """(the newest iteration whose committed learn is current, -1 for none; the first stale one, None for none): the
    policy status, hints and `grpo export` offer as the run's newest."""
    stale = first_stale_learn(storage, run_id)
    return (newest_learn(storage, run_id) if stale is None else stale - 1), stale


def policy_version(iteration: int, staleness: int) -> int:
    """The policy iteration `iteration` samples with rollout.staleness S: the iteration of the learn that committed
    it, k - 1 - S, or -1 for the base while that is negative. The rollouts table's `policy_version`.

    >>> [policy_version(k, 1) for k in range(4)], [policy_version(k, 0) for k in range(3)], policy_version(2, 5)
    ([-1, -1, 0, 1], [-1, 0, 1], -1)
    """
    return max(iteration - 1 - staleness, -1)


def version_of(policy: Committed) -> int:
    """The policy version of a committed policy: a learn's iteration, -1 for the base or the warm start (sft)."""
    if policy.manifest.stage not in ("learn", "base", "sft"):
        raise StageError(f"{policy.uri}: a {policy.manifest.stage} holds no policy of its own")
    return policy.manifest.iteration if policy.manifest.stage == "learn" else -1


def first_policy(storage: Storage, run_id: str, warm_start: bool) -> Committed:
    """The committed policy of version -1, which the iterations before learn 0's policy sample: the warm start's
    (`grpo sft`) where the run's config has one (sft set), else the base. Which is fixed by the config, never by
    what happens to be committed: a run with sft set and none committed is refused in one line."""
    if not warm_start:
        return committed_input(storage, run_id, None, "base")
    try:
        return latest_committed(storage, stage_dir(storage, run_id, None, "sft"), verify=False)
    except NotCommittedError:
        raise StageError(
            f"run {run_id} starts from a warm start (its config sets sft), and none is committed; run `grpo sft "
            f"--run {run_id}` first (`grpo run` and the flow run it)"
        ) from None


def frozen_version(storage: Storage, snapshot: Committed) -> int:
    """The policy version a committed snapshot froze, read from its `policy` input (the policy's own manifest, not
    what the snapshot says of it)."""
    ref = snapshot.manifest.inputs["policy"]
    path = fsspec.core.strip_protocol(ref.uri) if "://" in ref.uri else ref.uri
    manifest, sha = load_manifest(storage, path, verify=False)
    return version_of(Committed(storage, path, manifest, sha))


def check_policy(run_id: str, iteration: int, stage: str, version: int, staleness: int) -> None:
    """Iteration `iteration` samples exactly policy_version(iteration, staleness); a stage whose policy is another
    (a snapshot forced from elsewhere, committed by other code) is refused, naming both."""
    expected = policy_version(iteration, staleness)
    if version != expected:

        def name(v: int) -> str:
            return "the base" if v < 0 else f"learn {v}'s policy"

        raise StageError(
            f"{stage} iteration {iteration}: the policy frozen for it is {name(version)}, but "
            f"rollout.staleness={staleness} samples {name(expected)} there; make the snapshot again with "
            f"`grpo stage snapshot --run {run_id} --iteration {iteration} --force`"
        )


def reference_iteration(iteration: int, every: int | None) -> int | None:
    """The iteration whose snapshot is the KL reference of `iteration` with learn.ref_update_every = `every`:
    the last multiple of it (every, 2 * every, ...) at or before `iteration`; None (the base model) before
    the first, or without refresh.

    >>> [reference_iteration(k, 2) for k in range(6)], reference_iteration(3, 1), reference_iteration(9, None)
    ([None, None, 2, 2, 4, 4], 3, None)
    """
    return None if every is None or iteration < every else iteration // every * every


def reference_policy(storage: Storage, run_id: str, iteration: int, every: int | None, warm_start: bool) -> Committed:
    """The committed checkpoint the KL of `iteration` is measured against with learn.ref_update_every = `every`: the
    snapshot of reference_iteration (the policy that iteration sampled from, as committed: a cold resume reads the
    same), or before the first the base model, or with `warm_start` the warm start's policy (first_policy: the SFT
    model is the reference, as InstructGPT's and DeepSeekMath's)."""
    at = reference_iteration(iteration, every)
    if at is None:
        return first_policy(storage, run_id, warm_start)
    return committed_input(storage, run_id, at, "snapshot")


def committed_state(storage: Storage, run_id: str, learned: Committed) -> Committed | None:
    """The newest committed resume state made after learn `learned` (an attempt of stage STATE_STAGE whose input is
    that very commit: grpo/record/resume.py)."""
    sdir = stage_dir(storage, run_id, learned.manifest.iteration, STATE_STAGE)
    ref = learned.ref()
    for attempt in reversed(committed_attempts(storage, sdir)):
        manifest, sha = load_manifest(storage, attempt, verify=False)
        if manifest.inputs.get("learn") == ref:  # what gc collected of it fails a read naming that
            return Committed(storage, attempt, manifest, sha, collected_files(storage, attempt, manifest))
    return None


def replay_chain(storage: Storage, run_id: str, learned: dict[int, str], start: int) -> tuple[list[int], int | None]:
    """(the learns a learn built from files after learn `start` replays, newest first: those back from `start` whose
    resume state was never committed (learn.state_every, a state commit killed); the iteration whose committed
    state the first replay reads, or None where the replays go back to the first learn). `learned`: {iteration:
    committed learn attempt}."""
    replayed, k = [], start
    while k in learned:
        manifest, sha = load_manifest(storage, learned[k], verify=False)
        inside = any(f.path.startswith(STATE_PREFIXES) for f in manifest.files)  # runs made before the state split
        if inside or committed_state(storage, run_id, Committed(storage, learned[k], manifest, sha)) is not None:
            return replayed, k
        replayed.append(k)
        k -= 1
    return replayed, None


def collected_learn_files(storage: Storage, run_id: str, k: int) -> dict[str, list[str]]:
    """{attempt: the files `grpo gc --retention` collected of it} of iteration k's newest committed learn and
    state (STATE_STAGE) attempts, those that lost any."""
    attempts = []
    for stage in ("learn", STATE_STAGE) if k >= 0 else ():
        attempts += committed_attempts(storage, stage_dir(storage, run_id, k, stage))[-1:]
    found = {a: sorted(read_collected(storage, a)) for a in attempts}
    return {a: names for a, names in found.items() if names}


def _collected_learn(storage: Storage, run_id: str, k: int) -> str | None:
    """What `grpo gc --retention` collected of iteration k's committed learn, as a phrase ("iteration 1's policy
    and optimizer state, which was collected ... (attempt: files)"), or None: nothing (or no learn)."""
    collected = collected_learn_files(storage, run_id, k)
    if not collected:
        return None
    names = sorted(n for here in collected.values() for n in here)
    policy = [n for n in names if n.startswith(POLICY_PREFIXES) and not n.startswith(STATE_PREFIXES)]
    state = [n for n in names if n.startswith(STATE_PREFIXES)]
    what = " and ".join(w for w, files in (("policy", policy), ("optimizer state", state)) if files)
    where = [  # the learn's, then the state's (grpo/record/resume.py)
        f"{storage.uri(a)}: {', '.join(here[:3])}{', ...' if len(here) > 3 else ''}" for a, here in collected.items()
    ]
    return f"iteration {k}'s {what}, which was collected by `grpo gc --retention` ({'; '.join(where)})"


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
    stage reads the stale chain (check_chain), so the run cannot go on; its newest policy can, in a
    new run. None where the run can start there."""
    gone = stuck_at(storage, run_id, start)
    if gone is None:
        return None
    return (
        f"iteration {start} is stale and rerunning its learn needs {gone}; nothing run. This run cannot go on past "
        f"it: export its newest policy with `grpo export --run {run_id} --iteration {newest_learn(storage, run_id)} "
        "--out DIR` (stale: made before the rerun) and start a new run from it with "
        "`grpo init --run NEW --set model.base_model=DIR`"
    )
