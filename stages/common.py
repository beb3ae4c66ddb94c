"""The skip-or-run-then-commit wrapper every stage goes through, and the run's config with its pinned datasets.

Where things live: grpo.record.layout. A stage's identity is (run, iteration, stage, config hash, input manifests):
running it again with the same identity returns the committed manifest; `force`
writes a new attempt beside the old one. In a fork (grpo.record.fork), an ancestor's attempt at the same iteration
and stage with the same config and inputs is taken by reference instead of running the stage.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import sys
from typing import Callable

from grpo import data
from grpo.config import ConfigError, RunConfig
from grpo.errors import StageError
from grpo.record import pins
from grpo.record.commit import StageWriter
from grpo.record.counts import counting_io
from grpo.record.fork import reuse
from grpo.record.identity import config_hash, stage_identity, stored_config
from grpo.record.layout import no_such_run, run_json, stage_dir
from grpo.record.lineage import note_committed, raced
from grpo.record.storage import Committed, Storage, committed_attempts, find_committed, load_manifest
from grpo.tasks import Example

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
    optional = ("tracking", "retention", "sft")
    sections = [f.name for f in dataclasses.fields(RunConfig) if f.name not in optional]
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
        pin_datasets(storage, run_id)
    return cfg


def gpu_memory() -> dict[str, float]:
    """On a GPU: this process's peak allocation through torch since the stage began (`gpu_peak_gib`)
    and the device's memory in use by every process now (`gpu_used_gib`); nothing on a CPU."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30, "gpu_used_gib": (total - free) / 2**30}


def measured(stage_fn: Callable[..., Committed]) -> Callable[..., Committed]:
    """A stage function whose reads of its inputs count into the `io` of the attempt it commits: everything
    moved through storage from its call to its commit (run_stage; a sharded stage's first commit takes
    the reads before it, each later commit what it moved since the one before)."""

    @functools.wraps(stage_fn)
    def stage(*args, **kwargs) -> Committed:
        with counting_io():
            return stage_fn(*args, **kwargs)

    return stage


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
    The manifest's `io` is what the stage moved through storage (see `measured`).
    """
    writer_args = dict(
        run_id=run_id, iteration=iteration, stage=stage, config=config, inputs={k: v.ref() for k, v in inputs.items()}
    )
    sdir = stage_dir(storage, run_id, iteration, stage)
    if not force:
        identity = stage_identity(run_id, iteration, stage, config_hash(config), writer_args["inputs"])
        found = find_committed(storage, sdir, identity, verify=False)  # its readers check what they read
        if found is None:  # a fork: an ancestor's attempt with the same config and inputs, by reference
            found = reuse(storage, run_id, iteration, stage, config, inputs)
        if found is not None:
            log.info("%s iteration %s: reused committed %s", stage, iteration, found.uri)
            return found
    writer = StageWriter(storage, sdir, **writer_args)
    log.debug("%s iteration %s: running, writing %s", stage, iteration, storage.uri(writer.attempt_dir))
    torch = sys.modules.get("torch")  # not imported yet: nothing on a GPU yet either
    if torch is not None and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    # its heartbeat tells `grpo gc` the attempt is live until the commit (or the failure)
    with writer, counting_io(reuse=True) as io:
        summary = {**body(writer), **gpu_memory()}
        if not force:  # another process committed this very stage while this one ran: ours would supersede it
            found = find_committed(storage, sdir, writer.identity, verify=False)
            race = found and raced(storage, found.attempt_dir)
            if race:
                raise StageError(race)
        committed = writer.commit(summary=summary, io=io)
        io.reset()  # a next commit in the same stage call (a sharded stage's merge) counts from here
        note_committed(committed.attempt_dir)
    log.info("%s iteration %s: committed %s %s", stage, iteration, committed.uri, summary)
    return committed


def run_datasets(cfg: RunConfig) -> dict[str, str]:
    """{config field: uri} of the datasets the run reads."""
    return {name: uri for name, uri in (("task.dataset", cfg.task.dataset), ("eval.dataset", cfg.eval.dataset)) if uri}


def dataset_examples(cfg: RunConfig, name: str, uri: str) -> tuple[Example, ...]:
    """The rows of dataset `name` as the stages read them (stages.prompts), a bad one naming the field."""
    t = cfg.task
    try:
        return data.load_examples(uri, t.prompt_column, t.answer_column, t.skip_invalid_rows, pins.pinned_version(uri))
    except pins.DatasetChangedError as e:
        raise StageError(str(e)) from e
    except data.DatasetError as e:
        raise ConfigError(f"{name}: {e}") from e


def dataset_facts(cfg: RunConfig) -> dict[str, dict]:
    """{config field: {uri, fingerprint, rows, skipped_rows}} of each dataset, and the web server's `validator`
    where it sends one that follows the content: what the base manifest's summary records, the run's pins
    (pins.pin)."""
    t, facts = cfg.task, {}
    for name, uri in run_datasets(cfg).items():
        rows = dataset_examples(cfg, name, uri)
        skipped = data.blank_row_count(uri, t.prompt_column, t.answer_column) if t.skip_invalid_rows else 0
        facts[name] = {"uri": uri, "fingerprint": pins.pinned_version(uri), "rows": len(rows), "skipped_rows": skipped}
        if checked := pins.validator(uri):
            facts[name]["validator"] = checked
    return facts


def recorded_datasets(storage: Storage, run_id: str) -> dict[str, dict] | None:
    """The datasets' facts the run's committed base recorded (dataset_facts); None before the base is
    committed or for a run made before they were recorded (then not pinned: its datasets read as they are)."""
    attempts = committed_attempts(storage, stage_dir(storage, run_id, None, "base"))
    if not attempts:
        return None
    return load_manifest(storage, attempts[-1], verify=False)[0].summary.get("datasets")


def pin_datasets(storage: Storage, run_id: str) -> None:
    """Hold this process's reads of the run's datasets to the fingerprints its init recorded."""
    pins.pin(recorded_datasets(storage, run_id))


def check_datasets(storage: Storage, run_id: str) -> None:
    """A StageError naming the first dataset of the run that changed since grpo init."""
    recorded = recorded_datasets(storage, run_id)
    pins.pin(recorded)
    for facts in (recorded or {}).values():
        try:
            pins.pinned_version(facts["uri"])
        except data.DatasetError as e:
            raise StageError(str(e)) from e
