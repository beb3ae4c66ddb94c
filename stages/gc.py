"""Housekeeping: what of a run's storage no committed chain needs, and removing it.

Candidates are attempts that never committed (a crash, a kill, a failed check) and
committed attempts that a newer attempt of the same stage replaced, as long as no kept
manifest reads them (an input) or references their files (a snapshot points at its
policy's files), and leftover `*.tmp-*` files. Anything written less than `min_age_s`
ago is left alone: it may belong to a stage that is running now.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from grpo.layout import STAGES, run_dir, stage_dir
from grpo.storage import Storage, committed_attempts, list_attempts, load_manifest


@dataclass(frozen=True)
class Garbage:
    path: str
    why: str  # "failed", "superseded" or "temporary"
    bytes: int


def _stage_dirs(storage: Storage, run_id: str) -> list[str]:
    dirs = [stage_dir(storage, run_id, None, "base")]
    k = 0
    while list_attempts(storage, stage_dir(storage, run_id, k, "snapshot")):
        dirs += [stage_dir(storage, run_id, k, s) for s in STAGES]
        k += 1
    return dirs


def _age_s(storage: Storage, path: str) -> float:
    """Seconds since anything under `path` was last written (inf where the store gives no time)."""
    times = []
    for info in storage.fs.find(path, detail=True, withdirs=False).values() or [storage.fs.info(path)]:
        t = info.get("mtime") or info.get("LastModified") or info.get("created")
        if t is not None:
            times.append(t.timestamp() if hasattr(t, "timestamp") else float(t))
    return time.time() - max(times) if times else float("inf")


def _size(storage: Storage, path: str) -> int:
    return sum(info.get("size", 0) for info in storage.fs.find(path, detail=True).values())


def find_garbage(storage: Storage, run_id: str, min_age_s: float = 3600.0) -> list[Garbage]:
    """Failed and superseded attempts and temporary files of a run that nothing kept uses."""
    dirs = _stage_dirs(storage, run_id)
    kept, superseded, out = [], [], []
    for d in dirs:
        committed = committed_attempts(storage, d)
        kept += committed[-1:]
        superseded += committed[:-1]
        for name in list_attempts(storage, d):
            path = f"{d}/{name}"
            if path not in committed and _age_s(storage, path) >= min_age_s:
                out.append(Garbage(path, "failed", _size(storage, path)))
    used: set[str] = set()  # uris that kept manifests read or reference
    for path in kept:
        manifest, _ = load_manifest(storage, path, verify=False)
        used |= {ref.uri.rstrip("/") for ref in manifest.inputs.values()}
        used |= {f.uri for f in manifest.files if f.uri}  # a snapshot's policy files live in another attempt
    for path in superseded:
        uri = storage.uri(path).rstrip("/")
        if not any(u == uri or u.startswith(uri + "/") for u in used):
            out.append(Garbage(path, "superseded", _size(storage, path)))
    removed = tuple(g.path + "/" for g in out)
    for path in storage.fs.find(run_dir(storage, run_id)):
        if ".tmp-" in path.rsplit("/", 1)[-1] and not path.startswith(removed) and _age_s(storage, path) >= min_age_s:
            out.append(Garbage(path, "temporary", _size(storage, path)))
    return out


def remove(storage: Storage, garbage: list[Garbage]) -> None:
    for g in garbage:
        storage.fs.rm(g.path, recursive=True)
