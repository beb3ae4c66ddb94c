"""Every file hashed once: the sha256 of what this machine wrote or verified, kept while the file's stamp holds.

- As written: a counted filesystem (grpo.record.io) hashes what it writes on the way and notes it here
  (`note_written`), so a commit lists its files without reading them back (`written_digest`).
- By stamp: a file hashed on this machine, by this process or another, is not hashed again while its stamp holds
  (size and ETag on S3; size, times and inode on a local disk): `file_digest`. This process keeps them in memory;
  `StampCache` keeps them across processes in an SQLite file under the cache folder.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from typing import Iterator

from fsspec import AbstractFileSystem

from grpo.record.counts import cache_root, count_io, is_local

log = logging.getLogger("grpo.record")
CHUNK = 1 << 20


def sha256_local(path: str) -> str:
    """sha256 of a local file, counted as hashed (not read from storage)."""
    h, n, t0 = hashlib.sha256(), 0, time.perf_counter()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            n += len(chunk)
    count_io("hash", n, time.perf_counter() - t0)
    return h.hexdigest()


_WRITTEN: OrderedDict[str, tuple[int, str]] = OrderedDict()  # storage path -> (size, sha256) as written here
_WRITTEN_MAX = 4096
_WRITTEN_LOCK = threading.Lock()


def note_written(path: str, size: int, digest: str) -> None:
    with _WRITTEN_LOCK:
        _WRITTEN[path] = size, digest
        _WRITTEN.move_to_end(path)
        while len(_WRITTEN) > _WRITTEN_MAX:
            _WRITTEN.popitem(last=False)


def written_digest(path: str, size: int) -> str | None:
    """The sha256 of what this process wrote to `path` through a counted filesystem, when it wrote `size`
    bytes there (taken: asked once)."""
    with _WRITTEN_LOCK:
        known = _WRITTEN.pop(path, None)
    return known[1] if known is not None and known[0] == size else None


class StampCache:
    """{(where, stamp): sha256} of files hashed on this machine, in `<cache>/hashes.sqlite` (one
    transaction a write: another process sees it whole or not at all). A damaged or locked cache only
    costs a hash: every failure here is logged and taken as a miss."""

    def __init__(self):
        self._lock = threading.Lock()
        self._con: sqlite3.Connection | None = None
        self._where: tuple[str, int] | None = None

    def _connect(self) -> sqlite3.Connection:
        path = cache_root() / "hashes.sqlite"
        if self._where != (str(path), os.getpid()):  # another cache folder (GRPO_CACHE), or a forked child
            path.parent.mkdir(parents=True, exist_ok=True)
            self._con = sqlite3.connect(path, timeout=30, check_same_thread=False, isolation_level=None)
            self._con.execute("CREATE TABLE IF NOT EXISTS hashes (key TEXT PRIMARY KEY, stamp TEXT, sha256 TEXT)")
            self._where = (str(path), os.getpid())
        return self._con

    def get(self, key: str, stamp: tuple) -> str | None:
        try:
            with self._lock:
                row = self._connect().execute("SELECT stamp, sha256 FROM hashes WHERE key = ?", (key,)).fetchone()
        except sqlite3.Error as e:
            log.warning("hash cache %s: %s", cache_root(), e)
            return None
        return row[1] if row is not None and row[0] == json.dumps(list(stamp)) else None

    def put(self, key: str, stamp: tuple, digest: str) -> None:
        try:
            with self._lock:
                self._connect().execute(
                    "INSERT OR REPLACE INTO hashes VALUES (?, ?, ?)", (key, json.dumps(list(stamp)), digest)
                )
        except sqlite3.Error as e:
            log.warning("hash cache %s: %s", cache_root(), e)


STAMPS = StampCache()


def sha256_file(fs: AbstractFileSystem, path: str) -> str:
    h, n, t0 = hashlib.sha256(), 0, time.perf_counter()
    with fs.open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            n += len(chunk)
    count_io("hash", n, time.perf_counter() - t0)
    return h.hexdigest()


_HASHED: OrderedDict[str, tuple[tuple, str]] = OrderedDict()  # path -> (stamp, sha256) hashed by this process
_HASHED_MAX = 4096
_HASHED_LOCK = threading.Lock()  # a learn in a thread of the flow beside the sampling stages (flows/placement.py)
# a local file last written less than this long before it is hashed may still change keeping its
# timestamps: they advance in kernel ticks (at most 10 ms on Linux), whole seconds on ext3, FAT, some NFS
_RACY_S, _RACY_WHOLE_SECOND_S = 0.02, 2.0


# change only with tests test_unchanged_files_are_not_reread_and_a_rewrite_is_caught and
# test_an_edited_download_cache_is_fetched_again in view
def _stamp(fs: AbstractFileSystem, path: str) -> tuple[tuple | None, int]:
    """(stamp, size): the stamp changes whenever the file's bytes do, None where nothing does.

    Local: size, mtime, ctime and inode, trusted only for a file last written well before now
    (timestamps are coarse: a same-size rewrite within one tick keeps them, git's "racy" entries).
    S3: size and ETag (a digest of the content).
    """
    if is_local(fs):
        st = os.stat(path)
        margin = _RACY_WHOLE_SECOND_S if st.st_mtime_ns % 1_000_000_000 == 0 else _RACY_S
        racy = time.time_ns() - st.st_mtime_ns < margin * 1e9
        return (None if racy else (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)), st.st_size
    info = fs.info(path)
    etag = info.get("ETag") or info.get("etag")
    return ((info["size"], etag) if etag else None), info["size"]


def _where(fs: AbstractFileSystem, path: str) -> str:
    """A file's key in the hash caches: its path, and on S3 the endpoint too."""
    if is_local(fs):
        return path
    endpoint = (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url", "")
    return f"{fs.protocol[0] if isinstance(fs.protocol, tuple) else fs.protocol}://{endpoint}|{path}"


def _remember(key: str, stamp: tuple, digest: str) -> None:
    with _HASHED_LOCK:
        _HASHED[key] = stamp, digest
        _HASHED.move_to_end(key)
        while len(_HASHED) > _HASHED_MAX:
            _HASHED.popitem(last=False)
    STAMPS.put(key, stamp, digest)


_REHASH: contextvars.ContextVar[bool] = contextvars.ContextVar("grpo_rehash", default=False)


@contextlib.contextmanager
def rehashing() -> Iterator[None]:
    """Every file verified in the block is hashed, whatever this machine hashed before (`grpo status --verify`:
    a disk that changes bytes and keeps their stamp is caught too)."""
    token = _REHASH.set(True)
    try:
        yield
    finally:
        _REHASH.reset(token)


def _known(fs: AbstractFileSystem, path: str) -> tuple[tuple | None, int, str | None]:
    """(stamp, size, the sha256 hashed on this machine while the stamp held, or None); FileNotFoundError."""
    stamp, size = _stamp(fs, path)
    if stamp is None or _REHASH.get():
        return stamp, size, None
    key = _where(fs, path)
    with _HASHED_LOCK:
        known = _HASHED.get(key)
    if known is not None and known[0] == stamp:
        return stamp, size, known[1]
    digest = STAMPS.get(key, stamp)  # hashed by another process on this machine
    if digest is not None:
        with _HASHED_LOCK:
            _HASHED[key] = stamp, digest
    return stamp, size, digest


def known_digest(fs: AbstractFileSystem, path: str) -> tuple[int, str | None]:
    """(size, sha256 hashed on this machine while the file's stamp held, or None); FileNotFoundError."""
    _, size, digest = _known(fs, path)
    return size, digest


def settle(path: str) -> None:
    """Date a local file this process has finished writing back by 10 s, so that its stamp is trusted at
    once (a file just written is "racy", see _stamp); any later write dates it now again, and its ctime
    changes either way."""
    past = time.time_ns() - 10_000_000_000
    os.utime(path, ns=(past, past))


def remember_digest(fs: AbstractFileSystem, path: str, digest: str) -> None:
    """Record the sha256 of a file whose bytes are known (hashed as written, or a verified download)."""
    stamp, _ = _stamp(fs, path)
    if stamp is not None:
        _remember(_where(fs, path), stamp, digest)


def file_digest(fs: AbstractFileSystem, path: str) -> tuple[int, str]:
    """(size, sha256) of a file; raises FileNotFoundError.

    A file hashed on this machine before, by this process or another (grpo.record.io.StampCache), is not
    read again while its stamp is unchanged: a run verifies the same checkpoint in several stages and
    processes, and each re-read of a large model costs seconds.
    """
    stamp, size, digest = _known(fs, path)
    if digest is not None:
        return size, digest
    digest = sha256_file(fs, path)
    if stamp is not None:
        _remember(_where(fs, path), stamp, digest)
    return size, digest
