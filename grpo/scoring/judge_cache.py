"""What of the judges' cache (`judge-cache/`, grpo/scoring/judge.py) nothing refers to any more, and removing it
(`grpo gc`).

The cache is the storage's, shared by its runs: an answer stays while some committed judge table of some run in
the storage (judge.parquet of a rewards attempt or of its shards, superseded ones included) holds its (judge
revision, prompt hash). The rest goes: the answers of runs since deleted, of a rubric or template since replaced,
of a stage killed and never rerun. A cache file is removed whole when none of its answers is referred to, and
rewritten with the answers that are otherwise (the new file written before the old one goes, so a stage reading
the cache meanwhile finds each kept answer in one of them). A file written less than `min_age_s` ago is left
alone: a rewards stage running now may not have committed its table yet.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass

from grpo.record.layout import run_dir, run_ids
from grpo.record.liveness import mtime, storage_clock
from grpo.record.storage import Storage, is_committed

CACHE_FOLDER = "judge-cache"
"""The folder at the storage's root that holds every judge's cache, a folder per revision (revision_folder)."""


def revision_folder(storage: Storage, revision: str) -> str:
    """The cache folder of one judge revision (`<hub id>@<commit>`, `folder:<hash>`, `<model_name>@<url>`)."""
    return storage.path(CACHE_FOLDER, hashlib.sha256(revision.encode()).hexdigest()[:32])


@dataclass(frozen=True)
class Unused:
    """A cache file holding answers no committed judge table refers to."""

    path: str
    bytes: int
    dropped: int
    """How many of its answers go."""
    kept: tuple[str, ...]
    """Its lines (answers) that stay, written to a new file before this one is removed; () removes it whole."""


def referred(storage: Storage) -> set[tuple[str, str]]:
    """{(revision folder, prompt hash)} of every answer a committed judge table of a run in `storage` holds."""
    from schemas import read_parquet, table_file  # pyarrow: not for `grpo status`, which imports grpo.gc

    out: set[tuple[str, str]] = set()
    for run in run_ids(storage):
        for path in storage.fs.glob(f"{run_dir(storage, run)}/iter-*/*/attempt-*/{table_file('judge')}"):
            if not is_committed(storage, path.rsplit("/", 1)[0]):
                continue
            table = read_parquet(storage.fs, path, "judge", columns=["judge_revision", "prompt_hash"])
            revisions, hashes = table["judge_revision"].to_pylist(), table["prompt_hash"].to_pylist()
            folders = {r: revision_folder(storage, r).rsplit("/", 1)[-1] for r in set(revisions)}
            out |= {(folders[r], h) for r, h in zip(revisions, hashes)}
    return out


def unused(storage: Storage, min_age_s: float) -> tuple[list[Unused], list[str]]:
    """(the cache files whose answers no committed judge table refers to, less those written within `min_age_s`;
    the files left alone as that recent)."""
    root = storage.path(CACHE_FOLDER)
    if not storage.exists(root):
        return [], []
    listing = storage.fs.find(root, detail=True)
    if not listing:
        return [], []
    keep, now = referred(storage), storage_clock(storage, root).storage
    out, recent = [], []
    for path, info in sorted(listing.items()):
        if not path.endswith(".jsonl"):  # a write's leftover temporary file: gc's own rule on them
            continue
        t = mtime(info)
        if t is not None and now - t < min_age_s:
            recent.append(path)
            continue
        folder = path.rsplit("/", 2)[-2]
        try:
            lines = storage.read_bytes(path).decode().splitlines()
        except FileNotFoundError:  # another gc compacted it meanwhile
            continue
        kept = tuple(line for line in lines if (folder, json.loads(line)["prompt_hash"]) in keep)
        if len(kept) < len(lines):
            out.append(Unused(path, info.get("size", 0), len(lines) - len(kept), kept))
    return out, recent


def remove_unused(storage: Storage, files: list[Unused]) -> None:
    """Remove what `unused` listed: each file's kept answers first written to a new file of its folder."""
    for f in files:
        if f.kept:
            name = f"{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(6)}.jsonl"
            storage.write_bytes_atomic(f"{f.path.rsplit('/', 1)[0]}/{name}", "".join(k + "\n" for k in f.kept).encode())
        try:
            storage.fs.rm_file(f.path)
        except FileNotFoundError:  # removed meanwhile
            pass
