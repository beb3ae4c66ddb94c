"""Forks: a run that starts from another run's committed history, by reference, and follows its own settings.

    grpo fork --from demo --at 3 --run demo-gspo --set learn.loss_type=gspo

A fork's run.json names its parent and fork point (`"fork": {"parent": ..., "at": ...}`). Its base and its
iterations before `at` are the parent's committed attempts taken by reference: each gets an attempt in the fork
whose manifest lists the parent's files (URI, size, sha256: nothing is copied), the parent's config and summary,
the fork's own attempts as inputs (the fork's chain is its own: grpo.record.lineage reads it as any run's) and, as
`origin`, the attempt first committed with those files. From `at` on the fork runs with its own config, and a
stage whose lineage identity (grpo.record.identity.lineage_identity: config and inputs, not the run) equals an
ancestor's attempt at the same iteration is taken by reference as well, not recomputed (`reuse`, called by every
stage): forked with another learn.loss_type, learn `at` is the first stage that runs, on the parent's rollouts,
rewards and advantages; forked with another reward, rewards `at` and what follows run.

gc never removes what another run references (grpo.gc reads `referenced_by`), and `grpo delete` refuses a run
that another references.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import fsspec

from grpo.config import ConfigError, RunConfig, load_config
from grpo.errors import StageError
from grpo.record import reward_files
from grpo.record.commit import StageWriter
from grpo.record.counts import is_local
from grpo.record.identity import config_hash, lineage_identity, stage_identity, stored_config
from grpo.record.layout import (
    OPTIONAL_STAGES,
    STAGES,
    forking_json,
    half_made_forks,
    no_such_run,
    run_dir,
    run_ids,
    run_json,
    stage_dir,
)
from grpo.record.lineage import committed_state, next_iteration, note_committed, replay_chain
from grpo.record.storage import (
    ArtifactError,
    Committed,
    Storage,
    committed_attempts,
    file_path,
    find_committed,
    latest_committed,
    load_manifest,
    verify_files,
)
from grpo.tasks import functions
from schemas.manifest import FileEntry, InputRef

log = logging.getLogger("grpo.record.fork")


def _path(uri: str) -> str:
    return (fsspec.core.strip_protocol(uri) if "://" in uri else uri).rstrip("/")


def run_record(storage: Storage, run_id: str) -> dict:
    """run.json of a run, parsed ({} where there is none or it is not JSON: load_run says why)."""
    try:
        raw = json.loads(storage.read_bytes(run_json(storage, run_id)))
    except (FileNotFoundError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def fork_of(storage: Storage, run_id: str) -> dict | None:
    """{"parent": run id, "at": iteration} of a fork; None for a run that is none."""
    fork = run_record(storage, run_id).get("fork")
    return fork if isinstance(fork, dict) else None


def being_made(storage: Storage, run_id: str) -> dict | None:
    """{"parent", "at"} of a half-made fork (killed before its run.json: layout.forking_json); None otherwise."""
    if storage.exists(run_json(storage, run_id)):
        return None
    try:
        made = json.loads(storage.read_bytes(forking_json(storage, run_id)))
    except (FileNotFoundError, ValueError):
        return None
    return made if isinstance(made, dict) else None


def ancestors(storage: Storage, run_id: str) -> list[str]:
    """The parent of a fork, its parent, ... (nearest first); [] for a run that is no fork."""
    out, run = [], run_id
    while (fork := fork_of(storage, run)) is not None and fork.get("parent") not in out + [run_id]:
        run = fork["parent"]
        out.append(run)
    return out


def origin(committed: Committed) -> InputRef:
    """The attempt first committed with these files: the origin of one taken by reference, else itself."""
    return committed.manifest.origin or committed.ref()


def _origin_sha(storage: Storage, ref: InputRef, cache: dict[str, str]) -> str:
    """origin(...).manifest_sha256 of the attempt an input ref names (its manifest read once)."""
    if ref.manifest_sha256 not in cache:
        manifest, _ = load_manifest(storage, _path(ref.uri), verify=False)
        cache[ref.manifest_sha256] = manifest.origin.manifest_sha256 if manifest.origin else ref.manifest_sha256
    return cache[ref.manifest_sha256]


def reference(storage: Storage, run_id: str, source: Committed, inputs: dict[str, Committed]) -> Committed:
    """An attempt of run `run_id` at `source`'s iteration and stage that takes `source` by reference: its files
    (not copied), config and summary, with `inputs` (the run's own attempts) as its inputs. One made before with
    the same identity and origin is returned as it is."""
    m = source.manifest
    sdir = stage_dir(storage, run_id, m.iteration, m.stage)
    refs = {name: c.ref() for name, c in inputs.items()}
    found = find_committed(storage, sdir, stage_identity(run_id, m.iteration, m.stage, m.config_hash, refs), False)
    if found is not None and found.manifest.origin == origin(source):
        return found
    with StageWriter(
        storage, sdir, run_id=run_id, iteration=m.iteration, stage=m.stage, config=m.config, inputs=refs,
        origin=origin(source),
    ) as writer:  # fmt: skip
        for f in m.files:
            uri = f.uri or storage.uri(file_path(storage, source.attempt_dir, f))
            writer.reference(f.path, FileEntry(f.path, f.size, f.sha256, uri=uri))
        committed = writer.commit(summary={**m.summary, "referenced": source.uri})
    note_committed(committed.attempt_dir)
    return committed


def reuse(
    storage: Storage, run_id: str, iteration: int | None, stage: str, config: dict, inputs: dict[str, Committed]
) -> Committed | None:
    """In a fork: the attempt of an ancestor (nearest first) at this iteration and stage whose lineage identity
    is this stage's, taken by reference (`reference`); None where there is none, or its files were collected by
    `grpo gc --retention` or changed (the stage then runs)."""
    chain = [] if iteration is None else ancestors(storage, run_id)
    if not chain:
        return None
    want = lineage_identity(
        iteration, stage, config_hash(config), {k: origin(c).manifest_sha256 for k, c in inputs.items()}
    )
    cache: dict[str, str] = {}
    for run in chain:
        for attempt in reversed(committed_attempts(storage, stage_dir(storage, run, iteration, stage))):
            manifest, sha = load_manifest(storage, attempt, verify=False)
            try:
                origins = {name: _origin_sha(storage, ref, cache) for name, ref in manifest.inputs.items()}
            except (ArtifactError, OSError):  # an input gc removed: not the current chain of anything
                continue
            if lineage_identity(manifest.iteration, manifest.stage, manifest.config_hash, origins) != want:
                continue
            try:
                if verify_files(storage, attempt, manifest):  # collected files: the stage runs instead
                    continue
            except ArtifactError as e:
                log.warning("%s %s: not reused from run %s: %s", stage, iteration, run, e)
                continue
            found = reference(storage, run_id, Committed(storage, attempt, manifest, sha), inputs)
            log.info("%s iteration %s: reused run %s's %s by reference", stage, iteration, run, storage.uri(attempt))
            return found
    return None


def fork_config(storage: Storage, parent: str, overrides: list[str]) -> tuple[RunConfig, RunConfig]:
    """(the parent's config, the fork's: the parent's with `overrides`), refusing in one line what a fork cannot
    change: the model (the fork trains the parent's policy on), LoRA on or off (the form its policy is
    committed in). Reward files: grpo.scoring.files."""
    if not storage.exists(run_json(storage, parent)):
        raise StageError(no_such_run(storage, parent))
    try:
        before = stored_config(run_record(storage, parent).get("config"))
    except ConfigError as e:
        raise StageError(f"{storage.uri(run_json(storage, parent))}: {e}") from e
    after = load_config(before.to_dict(), overrides)
    old, new = before.to_dict(), after.to_dict()
    if changed := sorted(k for k in new["model"] if new["model"][k] != old["model"][k]):
        raise ConfigError(
            f"model.{changed[0]}: a fork trains on from its parent's policy, so its model is the parent's; "
            "start a new run with `grpo init` for another model"
        )
    if (old["learn"]["lora"] is None) != (new["learn"]["lora"] is None):
        raise ConfigError("learn.lora: a fork keeps its parent's form of policy (LoRA adapters or full weights)")
    b, a = before.rollout, after.rollout  # episodes: the tool and environment files are the parent base's too
    for setting, old, new in (("tools", b.tools, a.tools), ("environment", [b.environment], [a.environment])):
        for i, spec in enumerate(new):
            if spec and functions.is_file_spec(spec) and old[i : i + 1] != [spec]:
                raise ConfigError(
                    f"rollout.{setting}: {spec!r} is a file, and a fork runs the tool and environment files its "
                    "parent's base holds (copied at `grpo init`); name a module or start a new run"
                )
    return before, after


@dataclass(frozen=True)
class Forked:
    run_id: str
    parent: str
    at: int
    attempts: int
    """Attempts of the parent the fork takes by reference (the base and iterations before `at`)."""
    bytes_referenced: int


def _history(storage: Storage, parent: str, at: int) -> list[Committed]:
    """The parent's current attempts of its base and iterations before `at`, with every input they read (shards,
    ...), verified, inputs first; a stale chain or a changed file is refused before anything is written."""
    current = [latest_committed(storage, stage_dir(storage, parent, None, "base"))]
    for k in range(at):
        current += [latest_committed(storage, stage_dir(storage, parent, k, s)) for s in STAGES]
        current += [  # an optional stage (a teacher's) where the parent committed one
            latest_committed(storage, stage_dir(storage, parent, k, s))
            for s in OPTIONAL_STAGES
            if committed_attempts(storage, stage_dir(storage, parent, k, s))
        ]
    known = {c.uri: c for c in current}
    order: list[Committed] = []
    seen: set[str] = set()

    def visit(c: Committed) -> None:
        if c.uri in seen:
            return
        seen.add(c.uri)
        for name, ref in sorted(c.manifest.inputs.items()):
            if ref.uri not in known:  # a shard, or what a stale chain read
                sdir = _path(ref.uri).rsplit("/", 1)[0]
                newest = latest_committed(storage, sdir)
                if newest.uri != ref.uri:
                    raise StageError(
                        f"run {parent}: {c.uri} read {ref.uri}, which {newest.uri} replaced (a stale chain); "
                        f"rebuild it with `grpo run --run {parent} --start {c.manifest.iteration or 0}` first"
                    )
                known[ref.uri] = newest
            visit(known[ref.uri])
        order.append(c)

    for c in current:
        visit(c)
    return order


def resume_needs(storage: Storage, parent: str, history: list[Committed], at: int) -> list[tuple[str, Committed]]:
    """[(what, the attempt)] of `parent` the fork's learn `at` reads: learn at-1's policy and resume state, or, where
    that state was never committed, the state and policies its replay reads (grpo.record.lineage.replay_chain)."""
    learned = {c.manifest.iteration: c for c in history if c.manifest.stage == "learn"}
    replayed, read = replay_chain(storage, parent, {k: c.attempt_dir for k, c in learned.items()}, at - 1)
    needs = [(f"policy of learn {k}", learned[k]) for k in sorted({at - 1, *replayed, *(m - 1 for m in replayed)})
             if k in learned]  # fmt: skip
    if read is not None:
        held = committed_state(storage, parent, learned[read]) or learned[read]  # runs before the split: inside
        needs.append((f"optimizer state after learn {read}", held))
    return needs


def resume_gone(storage: Storage, parent: str, history: list[Committed], at: int) -> str | None:
    """What of `parent` the fork's learn `at` reads (resume_needs) that gc collected, as "run p's optimizer state
    after learn 2 (<uri>: optimizer.pt)"; None where all is there."""
    for what, c in resume_needs(storage, parent, history, at):
        if c.collected:
            return f"run {parent}'s {what} ({c.uri}: {', '.join(sorted(c.collected)[:2])})"
    return None


def fork_run(storage: Storage, parent: str, at: int, run_id: str, overrides: list[str]) -> Forked:
    """Make run `run_id` a fork of `parent` at iteration `at` (see the module's docstring). Everything is
    checked before anything is written; run.json is written last, so an interrupted fork is finished by
    running it again (the attempts it made are found by identity)."""
    run_dir(storage, run_id)  # the id is a plain name
    before, cfg = fork_config(storage, parent, overrides)
    record = {"run_id": run_id, "config": cfg.to_dict(), "fork": {"parent": parent, "at": at}}
    if storage.exists(run_json(storage, run_id)):
        old = run_record(storage, run_id)
        if {k: old.get(k) for k in record} != json.loads(json.dumps(record)):
            raise StageError(f"{storage.uri(run_json(storage, run_id))}: run {run_id!r} exists; fork into a new run id")
    if at < 0:
        raise StageError(f"--at {at}: an iteration is >= 0")
    done = next_iteration(storage, parent)
    if at > done:
        raise StageError(
            f"--at {at}: run {parent} has finished iterations before {done} only (`grpo status --run {parent}`); "
            f"fork at {done} or earlier"
        )
    history = _history(storage, parent, at)
    if at > 0 and (gone := resume_gone(storage, parent, history, at)):
        raise StageError(
            f"--at {at}: learn {at} continues from {gone}, which `grpo gc --retention` collected; nothing written. "
            f"Fork where the previous learn is whole: `grpo fork --from {parent} --at {done}` (the newest learn keeps "
            "everything)"
        )
    if is_local(storage.fs):
        storage.fs.makedirs(run_dir(storage, run_id), exist_ok=True)
    if not storage.exists(run_json(storage, run_id)):  # seen while half made (layout.forking_json)
        storage.write_bytes_atomic(forking_json(storage, run_id), json.dumps(record["fork"]).encode())
    made: dict[str, Committed] = {}
    for source in history:
        inputs = {name: made[ref.uri] for name, ref in source.manifest.inputs.items()}
        made[source.uri] = reference(storage, run_id, source, inputs)
    named = any(o.split("=", 1)[0].strip() == "reward.functions" for o in overrides)  # read the files again
    reward_files.commit_for_fork(storage, run_id, parent, cfg, read_local=named)
    data = json.dumps(record, indent=1, sort_keys=True).encode()
    storage.write_bytes_atomic(run_json(storage, run_id), data)
    if storage.exists(forking_json(storage, run_id)):
        storage.fs.rm_file(forking_json(storage, run_id))
    n_bytes = sum(f.size for c in history for f in c.manifest.files)
    return Forked(run_id, parent, at, len(history), n_bytes)


def referenced_by(storage: Storage, run_id: str) -> dict[str, set[str]]:
    """{uri under run `run_id`: the other runs that reference it}: the files, inputs and origins that the
    committed manifests of every other run name there (forks, and forks of forks: a fork's reference names the
    file where it lives), a half-made one's too (being_made). gc keeps them, and `grpo delete` refuses the run while
    any exist."""
    prefix = storage.uri(run_dir(storage, run_id)).rstrip("/") + "/"
    out: dict[str, set[str]] = {}
    for other in run_ids(storage) + half_made_forks(storage):
        if other == run_id or (fork_of(storage, other) is None and being_made(storage, other) is None):
            continue
        for path in storage.fs.find(run_dir(storage, other)):
            if not path.endswith("/_manifest.json"):
                continue
            try:
                manifest, _ = load_manifest(storage, path.rsplit("/", 1)[0], verify=False)
            except ArtifactError:
                continue
            uris = [f.uri for f in manifest.files if f.uri] + [r.uri for r in manifest.inputs.values()]
            uris += [manifest.origin.uri] if manifest.origin else []
            for u in uris:
                if u.startswith(prefix):
                    out.setdefault(u.rstrip("/"), set()).add(other)
        for u in _resume_files(storage, run_id, being_made(storage, other)):  # what a half-made fork has yet to take
            out.setdefault(u, set()).add(other)
    return out


def _resume_files(storage: Storage, run_id: str, made: dict | None) -> list[str]:
    """The uris of the files a half-made fork of `run_id` (being_made's record) will read when it is finished and
    trains: run_id's policy and optimizer state at the fork point (resume_needs); gc keeps them till then."""
    if not made or made.get("parent") != run_id or not isinstance(made.get("at"), int) or made["at"] < 1:
        return []
    try:
        needs = resume_needs(storage, run_id, _history(storage, run_id, made["at"]), made["at"])
    except (StageError, ArtifactError):  # a chain the fork could not take either: `grpo fork` says why
        return []
    return [storage.uri(f"{c.attempt_dir}/{f.path}") for _, c in needs for f in c.manifest.files if f.uri is None]
