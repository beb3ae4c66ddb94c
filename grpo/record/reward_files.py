"""Where a run's reward files live: the copies of `reward.functions` file specs its scorer imports.

`grpo init` copies them into the run's base (`reward/<i>-<name>.py`). A fork or rescore whose `--set` names
`reward.functions` reads the files named there again, here: where their bytes differ from what its parent scores
with (a fixed verifier), the fork commits its own copies as `reward_files` (run-wide, beside its base, each file
hashed in its manifest) before its run.json, and its stages score with those from then on. Every stage that scores
takes the holder of the files as an input (`base`, or `reward_files` where the run has one), so its identity covers
the bytes it scored with, and a run without reward files of its own keeps the identities it always had.
"""

from __future__ import annotations

from pathlib import Path

from grpo.config import RunConfig
from grpo.errors import StageError
from grpo.record.commit import StageWriter
from grpo.record.digests import sha256_local
from grpo.record.identity import config_hash, stage_identity
from grpo.record.layout import stage_dir
from grpo.record.lineage import committed_input, note_committed
from grpo.record.storage import Committed, Storage, committed_attempts, find_committed
from grpo.tasks import functions

STAGE = "reward_files"
"""The run-wide folder of a fork's own reward files (runs/<fork>/reward_files/attempt-*)."""


def holder_input(storage: Storage, run_id: str) -> dict[str, Committed]:
    """{input name: the committed attempt whose reward/ folder holds the files run `run_id` scores with}: its own
    `reward_files` where it has them, else its base."""
    if committed_attempts(storage, stage_dir(storage, run_id, None, STAGE)):
        return {STAGE: committed_input(storage, run_id, None, STAGE)}
    return {"base": committed_input(storage, run_id, None, "base")}


def holder_of(inputs: dict[str, Committed]) -> Committed | None:
    """The holder of the reward files among a stage's inputs (holder_input's), None without reward files."""
    return inputs.get(STAGE) or inputs.get("base")


def held_files(holder: Committed) -> dict[str, str]:
    """{committed file name (reward/<i>-<name>.py): sha256} of the reward files an attempt holds."""
    return {f.path: f.sha256 for f in holder.manifest.files if f.path.startswith(functions.REWARD_PREFIX)}


def wanted_files(cfg: RunConfig, read_local: bool, held: dict[str, str]) -> dict[str, str | None]:
    """{committed name: the local file to copy, or None to keep the held copy} of each file spec of `cfg`: with
    `read_local` (the fork's --set names reward.functions) the file named, else the copy the parent holds; one
    that is neither fails in one line."""
    out = {}
    for i, spec in enumerate(cfg.reward.functions):
        if not functions.has_copy(spec):
            continue
        name, path = functions.committed_name(i, spec), functions.split_spec(spec)[0]
        if read_local and functions.is_file_spec(spec) and Path(path).is_file():
            out[name] = path
        elif name in held:
            out[name] = None
        else:
            raise StageError(
                f"reward.functions: {spec!r}: no file {path} here, and its parent holds no copy of it; "
                "run where the file is"
            )
    return out


def changed_files(cfg: RunConfig, read_local: bool, held: dict[str, str]) -> list[str]:
    """The committed names whose bytes a fork of `cfg` would hold other than its parent's (wanted_files)."""
    want = wanted_files(cfg, read_local, held)
    return [n for n, path in want.items() if path is not None and sha256_local(path) != held.get(n)] + [
        n for n in held if n not in want
    ]


def commit_for_fork(storage: Storage, run_id: str, parent: str, cfg: RunConfig, read_local: bool) -> Committed | None:
    """A fork's own reward_files where the files it scores with differ from its parent's (changed_files), or
    where its parent scores with reward_files of its own; None where its base's copies, the parent's by
    reference, are the ones."""
    ((name, holder),) = holder_input(storage, parent).items()
    held = held_files(holder)
    if not cfg.reward.functions or (name == "base" and not changed_files(cfg, read_local, held)):
        return None
    want = wanted_files(cfg, read_local, held)
    digests = {n: sha256_local(p) if p is not None else held[n] for n, p in want.items()}
    config = {"reward_functions": list(cfg.reward.functions), "sha256": digests}
    sdir = stage_dir(storage, run_id, None, STAGE)
    identity = stage_identity(run_id, None, STAGE, config_hash(config), {})
    if found := find_committed(storage, sdir, identity):
        return found
    with StageWriter(storage, sdir, run_id=run_id, iteration=None, stage=STAGE, config=config, inputs={}) as w:
        for n, path in want.items():
            if path is not None:  # the file named, as it is here now
                storage.fs.put_file(path, w.path(n))
            else:  # the parent's copy, checked as it is read
                storage.fs.copy(holder.read_path(n), w.path(n))
        committed = w.commit(summary={"reward_functions": list(cfg.reward.functions), "from": parent})
    note_committed(committed.attempt_dir)
    return committed
