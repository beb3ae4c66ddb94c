"""Housekeeping: what of a run's storage nothing needs any more, and removing it (`grpo gc`).

Always: attempts that never committed (a crash, a kill, a failed check), committed attempts that
a newer attempt of the same stage replaced, as long as no kept manifest reads them (an input) or
references their files (a snapshot points at its policy's files), leftover `*.tmp-*` files, and the
tables of shards their stage merged (listed in the shard's collected.json; its manifest stays).

With retention (`grpo gc --retention`, the run's RetentionConfig): also the weights and optimizer
state of older learns, and nothing else: tables, manifests, run.json and summaries stay, so every
iteration still answers `grpo query`. A learn's policy stays when it is among the last
`keep_last` learns, its iteration a multiple of `keep_every`, the best by eval (eval.metric), or the next learn's
KL reference (learn.ref_update_every) or a policy the next iterations sample (rollout.staleness); its optimizer
state only in the newest learn, or, where the newest learns' states were never committed (learn.state_every, a
state commit killed), in the newest learn that has one, with the policies the next learn replays from it
(replay_chain). Before removing
them gc lists them in the attempt's collected.json (grpo.record.storage.mark_collected): verification skips
them, a stage that needs one fails naming it.

Left alone, and said so: an uncommitted attempt whose heartbeat is recent (its writer is alive,
however long its stage writes nothing else: beat within `min_age_s`, and never fewer than
LEASE_BEATS beats ago), anything written or superseded less than `min_age_s` ago, and whatever
a live attempt reads (its heartbeat lists its inputs). File ages are taken by the storage's own
clock (storage_clock), so a storage clock behind this machine's does not age them.

Every gc also looks at the storage's judge cache (`judge-cache/`, shared by its runs): answers that no committed
judge table of any run refers to go, in files older than `min_age_s` (grpo/scoring/judge_cache.py).

Never removed: what another run references (a fork: grpo.record.fork.referenced_by), superseded attempts and
retention's files alike; `grpo delete --run FORK` removes a fork, and the next gc may free them.

The newest learn (and the one `grpo run` continues from, where a stale chain resumes earlier) keeps
everything: the run resumes, reruns its newest eval and the next iteration's stages. Older
iterations cannot rerun their learn (its previous optimizer state is gone).
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from grpo import query
from grpo.config import RetentionConfig
from grpo.errors import StageError
from grpo.record.counts import is_local
from grpo.record.fork import being_made, referenced_by
from grpo.record.layout import (
    OPTIONAL_STAGES,
    POLICY_PREFIXES,
    SHARD_FOLDER,
    STAGES,
    STATE_PREFIXES,
    STATE_STAGE,
    no_such_run,
    run_dir,
    run_json,
    shard_dirs,
    stage_dir,
)
from grpo.record.lineage import (
    collected_learn_files,
    next_iteration,
    policy_version,
    reference_iteration,
    replay_chain,
)
from grpo.record.liveness import (
    LEASE_BEATS,
    beat_interval,
    last_beat,
    mtime,
    read_by_live,
    running_attempts,
    storage_clock,
)
from grpo.record.storage import (
    MERGED_SHARD,
    Storage,
    committed_attempts,
    is_committed,
    list_attempts,
    load_manifest,
    mark_collected,
    read_collected,
)
from grpo.scoring.judge_cache import Unused
from grpo.scoring.judge_cache import unused as unused_answers
from schemas import table_file
from schemas.manifest import MANIFEST_NAME


@dataclass(frozen=True)
class Garbage:
    path: str
    """An attempt folder or a file; with `files`, the committed attempt they are in (the rest stays)."""
    why: str
    """"failed", "superseded", "temporary", "merged" (a shard's table); with retention also "policy" and "state"."""
    bytes: int
    files: tuple[str, ...] = ()
    """Retention and merged shards: the attempt's files to remove, relative to it."""
    note: str = ""
    """Retention and merged shards: why they go (recorded in collected.json, named by a stage that needs them)."""


@dataclass(frozen=True)
class Held:
    """Something gc could have removed but left alone."""

    path: str
    group: str
    """What it is, for the count: "attempt{s} newer than 1 h"."""
    note: str


@dataclass
class Plan:
    garbage: list[Garbage] = field(default_factory=list)
    held: list[Held] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    """Retention: the policies and optimizer states that stay, and why."""
    judge_cache: list[Unused] = field(default_factory=list)
    """The storage's judge-cache files holding answers no run's committed judge table refers to
    (grpo/scoring/judge_cache.py)."""


def _span(s: float) -> str:
    """3600 -> '1 h', 90 -> '2 min', 5 -> '5 s'."""
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    return f"{s / 60:.0f} min" if s >= 90 else f"{max(s, 0):.0f} s"


def _iterations(storage: Storage, run_id: str) -> int:
    k = 0
    while list_attempts(storage, stage_dir(storage, run_id, k, "snapshot")):
        k += 1
    return k


def _stage_dirs(storage: Storage, run_id: str) -> list[str]:
    """The run's stage folders: base, the warm start (sft, where there is one), every iteration's stages and their
    shards' (stages.shards)."""
    dirs = [stage_dir(storage, run_id, None, "base"), stage_dir(storage, run_id, None, "sft")]
    for k in range(_iterations(storage, run_id)):
        dirs += [stage_dir(storage, run_id, k, s) for s in (*STAGES, *OPTIONAL_STAGES, STATE_STAGE)]
        idir = stage_dir(storage, run_id, k, STAGES[0]).rsplit("/", 1)[0]
        names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in storage.fs.ls(idir, detail=False))
        dirs += [f"{idir}/{name}" for name in names if SHARD_FOLDER.match(name)]
    return dirs


def _by_attempt(listing: dict[str, dict]) -> dict[str, list[dict]]:
    """Infos of a run's files grouped by the attempt folder holding them."""
    out = defaultdict(list)
    for path, info in listing.items():
        i = path.find("/attempt-")
        if i >= 0:
            j = path.find("/", i + 1)
            out[path if j < 0 else path[:j]].append(info)
    return out


def _under(uri: str, uris: set[str]) -> bool:
    return any(u == uri or u.startswith(uri + "/") for u in uris)


def kept_policies(
    iterations: list[int], keep_last: int | None, keep_every: int | None, best: int | None
) -> dict[int, str]:
    """{iteration: why its policy stays} among `iterations` (those with a committed learn, ascending).

    >>> kept_policies([0, 1, 2, 3, 4], keep_last=1, keep_every=2, best=1)
    {0: 'a multiple of 2', 1: 'the best eval', 2: 'a multiple of 2', 4: 'among the last 1, a multiple of 2'}
    >>> kept_policies([0, 1], keep_last=None, keep_every=None, best=None)
    {0: 'no retention rule set', 1: 'no retention rule set'}
    """
    if keep_last is None and keep_every is None:
        return {k: "no retention rule set" for k in iterations}
    last = set(iterations[-keep_last:]) if keep_last else set()
    why = {}
    for k in iterations:
        reasons = [f"among the last {keep_last}"] if k in last else []
        reasons += [f"a multiple of {keep_every}"] if keep_every and k % keep_every == 0 else []
        reasons += ["the best eval"] if k == best else []
        if reasons:
            why[k] = ", ".join(reasons)
    return why


def best_iteration(storage: Storage, run_id: str, iterations: list[int]) -> int | None:
    """The iteration of `iterations` with the best eval by the run's eval.metric (grpo.query.best_iteration, as
    `grpo status`, the report and `grpo export --best` pick it); None when none has an eval that ran."""
    best = query.best_iteration(storage, run_id, iterations)
    return None if best is None else best.iteration


def _retention(
    storage: Storage, run_id: str, rules: RetentionConfig, listing: dict, live: set[str], out: Plan, forks: dict
):
    """Add to `out` the policies and optimizer states of older learns that `rules` do not keep, less the files
    that other runs reference (`forks`: grpo.record.fork.referenced_by)."""
    learned = {}
    for k in range(_iterations(storage, run_id)):
        attempts = committed_attempts(storage, stage_dir(storage, run_id, k, "learn"))
        if attempts:
            learned[k] = attempts[-1]
    if not learned:
        return
    newest = max(learned)
    # whole: what `grpo run` continues from (and the newest eval reruns on); a stale learn resumes earlier
    n = next_iteration(storage, run_id)
    whole = {n - 1: "where `grpo run` continues", newest: "the newest learn"}
    best = best_iteration(storage, run_id, sorted(learned))
    kept = kept_policies(sorted(learned), rules.keep_last, rules.keep_every, best)
    config = json.loads(storage.read_bytes(run_json(storage, run_id)))["config"]
    ref = reference_iteration(n, config["learn"].get("ref_update_every"))
    if ref is not None:  # learn.ref_update_every: the next learn's KL reference is the policy learn ref - 1 committed
        kept.setdefault(ref - 1, f"the KL reference of iteration {n}")
    staleness = config["rollout"].get("staleness", 0)
    for m in range(n, n + staleness + 1):  # rollout.staleness: the next snapshots freeze older learns' policies
        if policy_version(m, staleness) >= 0:
            kept.setdefault(policy_version(m, staleness), f"the policy iteration {m} samples")
    resumes = {}  # {iteration: why} of the older states a learn built from files reads, replaying the learns after
    for start in sorted(whole):
        replayed, read = replay_chain(storage, run_id, learned, start)
        for m in replayed:  # each replay starts from the policy before it, is checked against its own, and has a KL
            at = reference_iteration(m, config["learn"].get("ref_update_every"))  # reference
            for j in [m - 1, m] + ([policy_version(at, staleness)] if at is not None else []):
                if j >= 0:
                    kept.setdefault(j, f"replayed by the learn after iteration {start} (its state is not committed)")
        if read is not None and read not in whole:
            resumes[read] = f"the learn after iteration {start} replays iterations {read + 1}..{start} from it"
    dropped = [f"not among the last {rules.keep_last}"] if rules.keep_last else []
    dropped += [f"not a multiple of {rules.keep_every}"] if rules.keep_every else []
    dropped += [f"not the best eval (iteration {best})" if best is not None else "no eval committed"]
    for k, attempt in sorted(learned.items()):
        if k in whole:
            out.kept.append(f"iteration {k}: policy and optimizer state ({whole[k]})")
            continue
        if _under(storage.uri(attempt).rstrip("/"), live):
            out.held.append(Held(attempt, "learn{s} read by a live attempt", f"iteration {k}'s policy and state"))
            continue
        here, shared = _unshared(storage, attempt, listing, forks, out, k)
        state = [f for f in here if f.path.startswith(STATE_PREFIXES)]  # runs made before the state's own commit
        policy = [f for f in here if f.path.startswith(POLICY_PREFIXES) and f not in state]
        why = f"optimizer state of iteration {k}: only the newest learn ({newest}) keeps it"
        if k in resumes:
            out.kept.append(f"iteration {k}: optimizer state ({resumes[k]})")
        for held, files in [(attempt, state), *_states(storage, run_id, k, listing, live, forks, out)]:
            if files and k not in resumes:
                size = sum(f.size for f in files)
                out.garbage.append(Garbage(held, "state", size, tuple(f.path for f in files), why))
        if k in kept and (policy or not shared):  # a policy a fork keeps whole is said so above
            out.kept.append(f"iteration {k}: policy ({kept[k]})")
        elif policy:
            why = f"policy of iteration {k}: " + ", ".join(dropped)
            out.garbage.append(
                Garbage(attempt, "policy", sum(f.size for f in policy), tuple(f.path for f in policy), why)
            )


def _unshared(storage: Storage, attempt: str, listing: dict, forks: dict, out: Plan, k: int) -> tuple[list, list]:
    """(the files an attempt holds itself and still has, less those other runs reference; those), the second said
    in `out` (kept for a fork)."""
    manifest, _ = load_manifest(storage, attempt, verify=False)
    here = [f for f in manifest.files if f.uri is None and f"{attempt}/{f.path}" in listing]
    shared = [f for f in here if storage.uri(f"{attempt}/{f.path}") in forks]
    if shared:
        runs = sorted({r for f in shared for r in forks[storage.uri(f"{attempt}/{f.path}")]})
        out.kept.append(f"iteration {k}: {len(shared)} file(s) referenced by run {', '.join(runs)} (a fork)")
    return [f for f in here if f not in shared], shared


def half_made(storage: Storage, run_id: str) -> str:
    """gc's line on a fork killed before its run.json (grpo.record.fork.being_made), which it keeps files for."""
    made = being_made(storage, run_id)
    return (
        f"run {run_id}: a fork of {made.get('parent')} at {made.get('at')} killed while it was made: `grpo fork` "
        f"with the same arguments finishes it, `grpo delete --run {run_id} --yes` removes it"
    )


def _states(storage: Storage, run_id: str, k: int, listing: dict, live: set, forks: dict, out: Plan) -> list:
    """[(attempt, its files retention may collect)] of iteration k's committed state attempts (STATE_STAGE)."""
    found = []
    for attempt in committed_attempts(storage, stage_dir(storage, run_id, k, STATE_STAGE)):
        if _under(storage.uri(attempt).rstrip("/"), live):
            out.held.append(Held(attempt, "state{s} read by a live attempt", f"iteration {k}'s optimizer state"))
        else:
            found.append((attempt, _unshared(storage, attempt, listing, forks, out, k)[0]))
    return found


def plan(storage: Storage, run_id: str, min_age_s: float = 3600.0, retention: RetentionConfig | None = None) -> Plan:
    """What gc would remove of a run, and what it leaves alone and why; with `retention`, also the
    weights and optimizer state those rules do not keep."""
    rdir = run_dir(storage, run_id)
    clock = storage_clock(storage, rdir)
    listing = storage.fs.find(rdir, detail=True)
    files = _by_attempt(listing)
    span, out = _span(min_age_s), Plan()

    def age(infos: list[dict]) -> float:  # since the newest of them was written; inf where no time is given
        times = [t for t in map(mtime, infos) if t is not None]
        return clock.storage - max(times) if times else float("inf")

    kept, superseded, beats = [], [], {}
    for d in _stage_dirs(storage, run_id):
        committed = committed_attempts(storage, d)
        kept += committed[-1:]
        superseded += zip(committed[:-1], committed[1:])
        for path in (f"{d}/{name}" for name in list_attempts(storage, d)):
            if path in committed or (path not in files and not is_local(storage.fs)):
                continue  # no object under it: an empty folder of an S3 server that keeps them (SeaweedFS)
            beat = last_beat(storage, path, listing, clock)
            if beat is not None and beat[0] < max(min_age_s, LEASE_BEATS * beat_interval(beat[1])):
                beats[path] = b = beat[1]
                who = f"{b.get('stage')} on {b.get('host')}, pid {b.get('pid')}"
                out.held.append(Held(path, "live attempt{s} (recent heartbeat)", f"{who}: beat {_span(beat[0])} ago"))
            elif (a := age(files.get(path, []))) >= min_age_s:
                out.garbage.append(Garbage(path, "failed", sum(i.get("size", 0) for i in files.get(path, []))))
            else:
                out.held.append(Held(path, f"attempt{{s}} newer than {span}", f"uncommitted, written {_span(a)} ago"))
    live = read_by_live(storage, beats)
    forks = referenced_by(storage, run_id)  # what other runs (forks) reference here: never garbage
    out.kept += [half_made(storage, r) for r in sorted(set().union(*forks.values())) if being_made(storage, r)]
    used = set(live)  # uris that kept manifests or live attempts read or reference
    for path in kept:
        manifest, _ = load_manifest(storage, path, verify=False)
        used |= {ref.uri.rstrip("/") for ref in manifest.inputs.values()}
        used |= {f.uri for f in manifest.files if f.uri}  # a snapshot's policy files live in another attempt
    for path, newer in superseded:
        uri = storage.uri(path).rstrip("/")
        since = age([listing.get(f"{newer}/{MANIFEST_NAME}", {})])
        if _under(uri, live):
            out.held.append(Held(path, "superseded attempt{s} read by a live attempt", "superseded, still read"))
        elif shared := sorted({r for u, runs in forks.items() if u == uri or u.startswith(uri + "/") for r in runs}):
            note = f"referenced by run {', '.join(shared)}"
            out.held.append(Held(path, "superseded attempt{s} a fork references", note))
        elif _under(uri, used):
            continue  # the current chain reads it: not garbage
        elif since < min_age_s:
            out.held.append(
                Held(path, f"attempt{{s}} superseded less than {span} ago", f"superseded {_span(since)} ago")
            )
        else:
            out.garbage.append(Garbage(path, "superseded", sum(i.get("size", 0) for i in files.get(path, []))))
    skip = tuple(x.path + "/" for x in out.garbage + out.held)  # attempts already listed, with their files
    for path, info in listing.items():
        if ".tmp-" in path.rsplit("/", 1)[-1] and not path.startswith(skip):
            if (a := age([info])) >= min_age_s:
                out.garbage.append(Garbage(path, "temporary", info.get("size", 0)))
            else:
                out.held.append(Held(path, f"temporary file{{s}} newer than {span}", f"written {_span(a)} ago"))
    merged = [t for k in range(_iterations(storage, run_id)) for t in merged_shard_tables(storage, run_id, k)]
    for attempt, name, why in merged:  # shard tables their stage merged: its table holds the rows
        if not _under(storage.uri(attempt).rstrip("/"), live):
            size = listing.get(f"{attempt}/{name}", {}).get("size", 0)
            out.garbage.append(Garbage(attempt, "merged", size, (name,), why))
    if retention is not None:
        _retention(storage, run_id, retention, listing, live, out, forks)
    out.judge_cache, recent = unused_answers(storage, min_age_s)  # the storage's, shared by its runs
    out.held += [
        Held(p, f"judge-cache file{{s}} newer than {span}", "a judge's answers, written recently") for p in recent
    ]
    return out


def find_garbage(storage: Storage, run_id: str, min_age_s: float = 3600.0) -> list[Garbage]:
    """Failed and superseded attempts and temporary files of a run that nothing kept uses."""
    return plan(storage, run_id, min_age_s).garbage


def held_summary(held: list[Held]) -> str:
    """'1 live attempt (recent heartbeat) left alone; 2 attempts newer than 1 h left alone'."""
    counts = Counter(h.group for h in held)
    return "; ".join(f"{n} {group.format(s='' if n == 1 else 's')} left alone" for group, n in counts.items())


def remove(storage: Storage, garbage: list[Garbage]) -> None:
    """Remove what `plan` listed. Retention's files are first listed in their attempt's collected.json,
    then removed one by one; the rest of the attempt (tables, manifest) stays."""
    collect = defaultdict(list)
    for g in garbage:
        if g.files:
            collect[g.path].append(g)
        elif g.why == "failed" and is_committed(storage, g.path):
            continue  # it committed after the plan: not failed after all
        else:
            try:
                storage.fs.rm(g.path, recursive=True)
            except FileNotFoundError:  # removed meanwhile
                pass
    for attempt, items in collect.items():
        mark_collected(storage, attempt, {name: g.note for g in items for name in g.files})
        names = [name for g in items for name in g.files]
        for name in names:
            storage.fs.rm_file(f"{attempt}/{name}")
        if is_local(storage.fs):  # folders left empty (policy/, dcp/): deepest first
            for d in sorted({os.path.dirname(f"{attempt}/{n}") for n in names if "/" in n}, key=len, reverse=True):
                try:
                    os.rmdir(d)
                except OSError:
                    pass


def collected_summary(storage: Storage, run_id: str) -> str | None:
    """One line on what `grpo gc --retention` removed of a run (for `grpo status`); None when nothing."""
    policy, state = [], []
    for k in range(_iterations(storage, run_id)):
        names = [n for here in collected_learn_files(storage, run_id, k).values() for n in here]
        if any(n.startswith(STATE_PREFIXES) for n in names):
            state.append(str(k))
        if any(n.startswith(POLICY_PREFIXES) and not n.startswith(STATE_PREFIXES) for n in names):
            policy.append(str(k))
    if not policy and not state:
        return None
    parts = [f"policy of iteration {', '.join(policy)}"] if policy else []
    parts += [f"optimizer state of iteration {', '.join(state)}"] if state else []
    return f"collected by `grpo gc --retention` (each learn's collected.json): {'; '.join(parts)}"


def merged_shard_tables(storage: Storage, run_id: str, iteration: int) -> list[tuple[str, str, str]]:
    """(shard attempt, its table, why it may go) of each shard table of the iteration that the newest committed
    attempt of its stage merged and that is still there: the stage's table holds the same rows, so `grpo gc`
    collects them (the shard's manifest and summary stay, for lineage and `grpo status`)."""
    out = []
    for stage, dirs in shard_dirs(storage, run_id, iteration).items():
        merged = committed_attempts(storage, stage_dir(storage, run_id, iteration, stage))
        if not merged:
            continue
        inputs = load_manifest(storage, merged[-1], verify=False)[0].inputs
        for k in range(len(dirs)):
            ref = inputs.get(f"shard-{k}")
            attempt = ref and next((a for a in committed_attempts(storage, dirs[k]) if storage.uri(a) == ref.uri), None)
            name = table_file(stage)
            if attempt and name not in read_collected(storage, attempt) and storage.exists(f"{attempt}/{name}"):
                out.append((attempt, name, f"{MERGED_SHARD}{storage.uri(merged[-1])}"))
    return out


def run_files(storage: Storage, run_id: str) -> tuple[int, int]:
    """(files, bytes) a run's folder holds; refused in one line while another run (a fork) references any of
    them or a stage of the run is running."""
    if not storage.exists(run_json(storage, run_id)) and being_made(storage, run_id) is None:  # half made: removable
        raise StageError(no_such_run(storage, run_id))
    if forks := referenced_by(storage, run_id):
        runs = sorted(set().union(*forks.values()))
        raise StageError(
            f"run {run_id}: run {', '.join(runs)} references {len(forks)} of its files or attempts (a fork); "
            f"delete {'it' if len(runs) == 1 else 'them'} first (`grpo delete --run {runs[0]}`)"
        )
    if running := running_attempts(storage, run_id):
        raise StageError(f"run {run_id}: {len(running)} stage(s) running now ({sorted(running)[0]}); stop them first")
    found = storage.fs.find(run_dir(storage, run_id), detail=True)
    return len(found), sum(i.get("size", 0) for i in found.values())


def delete_run(storage: Storage, run_id: str) -> None:
    """Remove a run's folder, run.json first (the run is gone for every reader at once); see run_files."""
    run_files(storage, run_id)
    if storage.exists(run_json(storage, run_id)):
        storage.fs.rm_file(run_json(storage, run_id))
    storage.fs.rm(run_dir(storage, run_id), recursive=True)
