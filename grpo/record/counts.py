"""What moves between storage and this machine, counted: the `io` record of a stage attempt, where this machine keeps
its copies, and whether a filesystem is its own disk.

`counting_io()` opens an IoCounts; every byte read, downloaded, hashed, written or uploaded while it is open (in this
thread, or a thread started with its context: `in_context`) is added to it and to the ones around it. The stage
functions open one (stages.common.measured) and the commit records it in the manifest (`io`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from fsspec import AbstractFileSystem


def cache_root() -> Path:
    """This machine's cache folder: $GRPO_CACHE, else ~/.cache/grpo-flow (downloaded checkpoints, hashes)."""
    return Path(os.environ.get("GRPO_CACHE", Path.home() / ".cache" / "grpo-flow"))


def is_local(fs: AbstractFileSystem) -> bool:
    """Whether `fs` is this machine's disk (file://), not object storage."""
    return "file" in fs.protocol or "local" in fs.protocol


# ---------------------------------------------------------------- the io record


@dataclasses.dataclass
class IoCounts:
    """Bytes a stage attempt moved, and the seconds each kind took (kinds overlap in time: a parallel
    upload hashes while it sends, so the seconds need not add up to the stage's)."""

    read_bytes: int = 0
    """Read from storage into this process: manifests, tables, files hashed where they lie."""
    read_s: float = 0.0
    download_bytes: int = 0
    """Copied from storage into local files (checkpoints, optimizer state)."""
    download_s: float = 0.0
    hash_bytes: int = 0
    """Put through sha256: files verified, and files hashed as they were written or uploaded."""
    hash_s: float = 0.0
    write_bytes: int = 0
    """Written into storage from this process (tables; on file://, files a stage wrote into its attempt in
    place, whose seconds are the stage's own and not counted here)."""
    write_s: float = 0.0
    upload_bytes: int = 0
    """Copied from local files into storage (checkpoints on S3)."""
    upload_s: float = 0.0

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        setattr(self, f"{kind}_bytes", getattr(self, f"{kind}_bytes") + nbytes)
        setattr(self, f"{kind}_s", getattr(self, f"{kind}_s") + seconds)

    def record(self) -> dict:
        """The manifest's `io`: every field, seconds to 0.1 ms."""
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default)


_OPEN: contextvars.ContextVar[tuple[IoCounts, ...]] = contextvars.ContextVar("grpo_io", default=())
_LOCK = threading.Lock()


@contextmanager
def counting_io(reuse: bool = False) -> Iterator[IoCounts]:
    """A fresh IoCounts that counts until the block ends; with `reuse`, the innermost one already open (a
    fresh one when none is)."""
    stack = _OPEN.get()
    if reuse and stack:
        yield stack[-1]
        return
    counts = IoCounts()
    token = _OPEN.set((*stack, counts))
    try:
        yield counts
    finally:
        _OPEN.reset(token)


@contextmanager
def uncounted() -> Iterator[None]:
    """Nothing moved in the block counts (bookkeeping such as a heartbeat, not the stage's data)."""
    token = _OPEN.set(())
    try:
        yield
    finally:
        _OPEN.reset(token)


def count_io(kind: str, nbytes: int, seconds: float) -> None:
    """Add to every IoCounts open here (read, download, hash, write or upload)."""
    with _LOCK:
        for counts in _OPEN.get():
            counts.add(kind, nbytes, seconds)


def in_context(pool: ThreadPoolExecutor, fn, *args):
    """pool.submit(fn, *args), run in a copy of this context: what it moves counts here."""
    return pool.submit(contextvars.copy_context().run, fn, *args)
