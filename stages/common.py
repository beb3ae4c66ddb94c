"""Run layout and the skip-or-run-then-commit wrapper every stage goes through.

    <storage>/runs/<run_id>/run.json                 resolved config, written once
    <storage>/runs/<run_id>/base/attempt-*/          the base (and reference) model
    <storage>/runs/<run_id>/iter-000k/<stage>/attempt-*/

A stage's identity is (run, iteration, stage, config hash, input manifests):
running it again with the same identity returns the committed manifest; `force`
writes a new attempt beside the old one.
"""
from __future__ import annotations

import json
import logging
from typing import Callable

from grpo.config import RunConfig, load_config
from grpo.storage import (Committed, NotCommittedError, StageWriter, Storage, config_hash, find_committed,
                          latest_committed, stage_identity)

log = logging.getLogger("grpo.stages")

STAGES = ("snapshot", "rollouts", "rewards", "advantages", "learn", "eval")


class StageError(RuntimeError):
    """A stage cannot run: missing input, bad data, or a failed check."""


def run_dir(storage: Storage, run_id: str) -> str:
    if not run_id or "/" in run_id or run_id.startswith("."):
        raise StageError(f"run id {run_id!r} must be a non-empty name without '/'")
    return storage.path("runs", run_id)


def stage_dir(storage: Storage, run_id: str, iteration: int | None, stage: str) -> str:
    if iteration is None:
        return f"{run_dir(storage, run_id)}/{stage}"
    if iteration < 0:
        raise StageError(f"iteration must be >= 0, got {iteration}")
    return f"{run_dir(storage, run_id)}/iter-{iteration:04d}/{stage}"


def load_run(storage: Storage, run_id: str) -> RunConfig:
    path = f"{run_dir(storage, run_id)}/run.json"
    if not storage.exists(path):
        raise StageError(f"{storage.uri(path)}: no such run; create it with `grpo init --run {run_id}`")
    try:
        raw = json.loads(storage.read_bytes(path))
    except ValueError as e:
        raise StageError(f"{storage.uri(path)}: not valid JSON: {e}") from e
    return load_config(raw["config"])


def committed_input(storage: Storage, run_id: str, iteration: int | None, stage: str) -> Committed:
    """The newest committed output of `stage`, verified; a clear error says what to run."""
    try:
        return latest_committed(storage, stage_dir(storage, run_id, iteration, stage))
    except NotCommittedError as e:
        where = "" if iteration is None else f" --iteration {iteration}"
        raise StageError(f"input missing: {e}; run `grpo stage {stage} --run {run_id}{where}` first") from e


def run_stage(storage: Storage, run_id: str, iteration: int | None, stage: str, *, config: dict,
              inputs: dict[str, Committed], body: Callable[[StageWriter], dict],
              force: bool = False) -> Committed:
    """Return the committed output with this identity, or run `body` in a new attempt and commit.

    `body(writer)` writes its files through `writer.path(name)` and returns the summary.
    If it raises, nothing is committed and readers keep seeing the previous attempt.
    """
    writer_args = dict(run_id=run_id, iteration=iteration, stage=stage, config=config,
                       inputs={k: v.ref() for k, v in inputs.items()})
    sdir = stage_dir(storage, run_id, iteration, stage)
    if not force:
        identity = stage_identity(run_id, iteration, stage, config_hash(config), writer_args["inputs"])
        found = find_committed(storage, sdir, identity)
        if found is not None:
            log.info("%s iteration %s: reused committed %s", stage, iteration, found.uri)
            return found
    writer = StageWriter(storage, sdir, **writer_args)
    log.debug("%s iteration %s: running, writing %s", stage, iteration, storage.uri(writer.attempt_dir))
    summary = body(writer)
    committed = writer.commit(summary=summary)
    log.info("%s iteration %s: committed %s %s", stage, iteration, committed.uri, summary)
    return committed
