"""The skip-or-run-then-commit wrapper every stage goes through, the run's config and lineage checks.

Where things live: grpo.layout. A stage's identity is (run, iteration, stage, config hash, input manifests):
running it again with the same identity returns the committed manifest; `force`
writes a new attempt beside the old one.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import sys
from typing import Callable

import fsspec

from grpo.config import ConfigError, RunConfig, stored_config
from grpo.errors import StageError
from grpo.layout import no_such_run, run_json, stage_dir
from grpo.storage import (
    Committed,
    CorruptArtifactError,
    NotCommittedError,
    StageWriter,
    Storage,
    committed_attempts,
    config_hash,
    find_committed,
    latest_committed,
    load_manifest,
    stage_identity,
)

log = logging.getLogger("grpo.stages")


def load_run(storage: Storage, run_id: str) -> RunConfig:
    path = run_json(storage, run_id)
    if not storage.exists(path):
        raise StageError(no_such_run(storage, run_id))
    try:
        raw = json.loads(storage.read_bytes(path))
    except ValueError as e:
        raise StageError(f"{storage.uri(path)}: not valid JSON: {e}") from e
    config = raw.get("config") if isinstance(raw, dict) else None
    sections = [f.name for f in dataclasses.fields(RunConfig) if f.name not in ("tracking", "retention")]  # optional
    missing = sections if not isinstance(config, dict) else [s for s in sections if s not in config]
    if missing:  # run.json is written whole by `grpo init`: a partial one was edited or damaged
        raise StageError(
            f"{storage.uri(path)}: config lacks {', '.join(missing)}; run.json is written whole "
            f"by `grpo init`, so this one was edited or damaged: restore it or make a new run"
        )
    try:
        cfg = stored_config(config)
    except ConfigError as e:
        raise StageError(f"{storage.uri(path)}: {e}") from e
    if cfg.task.dataset or cfg.eval.dataset:  # every read of them held to what grpo init fingerprinted
        from stages.init import pin_datasets  # init imports this module

        pin_datasets(storage, run_id)
    return cfg


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
            from stages.iteration import next_iteration  # it imports this module

            start = min(iteration, next_iteration(storage, run_id))  # an earlier iteration's learn may be stale
            raise StageError(
                f"{stage} iteration {iteration}: input {name} is stale: {reader} was made from {old}, "
                f"which {new} replaced; rebuild the chain with `grpo run --run {run_id} --start "
                f"{start}` (it reruns only the stale stages)"
            )


def committed_input(storage: Storage, run_id: str, iteration: int | None, stage: str) -> Committed:
    """The newest committed output of `stage`, verified; a clear error says what to run."""
    try:
        return latest_committed(storage, stage_dir(storage, run_id, iteration, stage))
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


def gpu_memory() -> dict[str, float]:
    """On a GPU: this process's peak allocation through torch since the stage began (`gpu_peak_gib`)
    and the device's memory in use by every process now (`gpu_used_gib`); nothing on a CPU."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30, "gpu_used_gib": (total - free) / 2**30}


def run_stage(
    storage: Storage,
    run_id: str,
    iteration: int | None,
    stage: str,
    *,
    config: dict,
    inputs: dict[str, Committed],
    body: Callable[[StageWriter], dict],
    force: bool = False,
) -> Committed:
    """Return the committed output with this identity, or run `body` in a new attempt and commit.

    `body(writer)` writes its files through `writer.path(name)` and returns the summary.
    If it raises, nothing is committed and readers keep seeing the previous attempt.
    """
    writer_args = dict(
        run_id=run_id, iteration=iteration, stage=stage, config=config, inputs={k: v.ref() for k, v in inputs.items()}
    )
    sdir = stage_dir(storage, run_id, iteration, stage)
    if not force:
        identity = stage_identity(run_id, iteration, stage, config_hash(config), writer_args["inputs"])
        found = find_committed(storage, sdir, identity)
        if found is not None:
            log.info("%s iteration %s: reused committed %s", stage, iteration, found.uri)
            return found
    writer = StageWriter(storage, sdir, **writer_args)
    log.debug("%s iteration %s: running, writing %s", stage, iteration, storage.uri(writer.attempt_dir))
    torch = sys.modules.get("torch")  # not imported yet: nothing on a GPU yet either
    if torch is not None and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with writer:  # its heartbeat tells `grpo gc` the attempt is live until the commit (or the failure)
        summary = {**body(writer), **gpu_memory()}
        if not force:  # another process committed this very stage while this one ran: ours would supersede it
            found = find_committed(storage, sdir, writer.identity, verify=False)
            race = found and raced(storage, found.attempt_dir)
            if race:
                raise StageError(race)
        committed = writer.commit(summary=summary)
        _COMMITTED_HERE.add(committed.attempt_dir)
    log.info("%s iteration %s: committed %s %s", stage, iteration, committed.uri, summary)
    return committed
