"""Bytes between storage and this machine, measured: the `io` record of a stage attempt, the counted
filesystem every storage access goes through, the hashes kept across processes, many files at once.

- `counting_io()` opens an IoCounts; every byte read, downloaded, hashed, written or uploaded while it is
  open (in this thread, or a thread started with its context) is added to it and to the ones around it.
  The stage functions open one (stages.common.measured) and the commit records it in the manifest (`io`).
- `counted_fs(fs)`: the storage's filesystem, of a subclass of its own class whose open, cat_file,
  pipe_file, get_file and put_file count what they move, and which hashes what is written through it as
  it goes (`written_digest`), so a commit never reads its own files back.
- `StampCache`: the sha256 of files verified on this machine, by where they are and their stamp (size and
  ETag on S3; size, times and inode on a local disk), in an SQLite file under the cache folder: a file
  verified once is not hashed again, in this process or another, while its stamp holds.
- `put_files` / `get_files`: a folder's files in one call, concurrent requests on S3 (s3fs's batch_size,
  multipart parts of `PART_BYTES` in parallel for large files).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import fsspec.asyn
from fsspec import AbstractFileSystem

log = logging.getLogger("grpo.record.io")
CHUNK = 1 << 20
BATCH = 8  # files in flight at once on S3
PART_BYTES = 16 << 20  # S3 multipart part size; files of 2 parts and more upload their parts in parallel


def cache_root() -> Path:
    """This machine's cache folder: $GRPO_CACHE, else ~/.cache/grpo-flow (downloaded checkpoints, hashes)."""
    return Path(os.environ.get("GRPO_CACHE", Path.home() / ".cache" / "grpo-flow"))


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
_BUSY: contextvars.ContextVar[bool] = contextvars.ContextVar("grpo_io_busy", default=False)
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


@contextmanager
def _quiet() -> Iterator[None]:
    """Inside a counted call: the filesystem's own nested calls (open inside cat_file) count nothing more."""
    token = _BUSY.set(True)
    try:
        yield
    finally:
        _BUSY.reset(token)


# ---------------------------------------------------------------- hashing


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


def note_written(path: str, size: int, digest: str) -> None:
    with _LOCK:
        _WRITTEN[path] = size, digest
        _WRITTEN.move_to_end(path)
        while len(_WRITTEN) > _WRITTEN_MAX:
            _WRITTEN.popitem(last=False)


def written_digest(path: str, size: int) -> str | None:
    """The sha256 of what this process wrote to `path` through a counted filesystem, when it wrote `size`
    bytes there (taken: asked once)."""
    with _LOCK:
        known = _WRITTEN.pop(path, None)
    return known[1] if known is not None and known[0] == size else None


class _CountedFile:
    """A file of a counted filesystem: reads count as read, writes as written and are hashed on the way."""

    def __init__(self, f, path: str, mode: str):
        self._f, self._path = f, path
        self._hash = hashlib.sha256() if "w" in mode else None  # an append, or a write after a seek, gives it up
        self._size, self._hash_s = 0, 0.0

    def __getattr__(self, name):
        return getattr(self._f, name)

    def read(self, n: int = -1) -> bytes:
        t0 = time.perf_counter()
        data = self._f.read(n)
        count_io("read", len(data), time.perf_counter() - t0)
        return data

    def readinto(self, buffer) -> int:
        t0 = time.perf_counter()
        n = self._f.readinto(buffer)
        count_io("read", n or 0, time.perf_counter() - t0)
        return n

    def write(self, data) -> int:
        if self._hash is not None and self._f.tell() != self._size:
            self._hash = None  # bytes written out of order (a seek): the commit hashes the file instead
        t0 = time.perf_counter()
        n = self._f.write(data)
        t1 = time.perf_counter()
        if self._hash is not None:
            self._hash.update(data)
            self._size += len(data) if isinstance(data, bytes) else memoryview(data).nbytes
        t2 = time.perf_counter()
        count_io("write", n if isinstance(n, int) else len(data), t1 - t0)
        self._hash_s += t2 - t1
        return n

    def close(self) -> None:
        t0 = time.perf_counter()
        self._f.close()  # an S3 file sends its last part here
        if self._hash is not None:
            count_io("write", 0, time.perf_counter() - t0)
            count_io("hash", self._size, self._hash_s)
            note_written(self._path, self._size, self._hash.hexdigest())
            self._hash = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self):
        return iter(self._f)


class Counted:
    """Mixed into a filesystem class (counted_fs): open, cat_file, pipe_file, get_file and put_file count
    what they move into the open IoCounts; what is written is hashed on the way (written_digest)."""

    def _own(self, name: str):
        """The filesystem's own method `name`, which counts nothing: an async filesystem's coroutine run to
        its end (s3fs: its concurrent multipart and batch transfers), else the class's method."""
        coroutine = getattr(self, f"_{name}", None)
        if getattr(self, "async_impl", False) and inspect.iscoroutinefunction(coroutine):
            return functools.partial(fsspec.asyn.sync, self.loop, coroutine)
        return getattr(super(), name)

    def open(self, path, mode="rb", **kwargs):
        f = super().open(path, mode, **kwargs)
        return f if _BUSY.get() else _CountedFile(f, self._strip_protocol(path), mode)

    def cat_file(self, path, start=None, end=None, **kwargs):
        t0 = time.perf_counter()
        with _quiet():
            data = self._own("cat_file")(path, start=start, end=end, **kwargs)
        count_io("read", len(data), time.perf_counter() - t0)
        return data

    def pipe_file(self, path, value, **kwargs):
        t0 = time.perf_counter()
        with _quiet():
            self._own("pipe_file")(path, value, **kwargs)
        t1 = time.perf_counter()
        digest = hashlib.sha256(value).hexdigest()
        count_io("write", len(value), t1 - t0)
        count_io("hash", len(value), time.perf_counter() - t1)
        note_written(self._strip_protocol(path), len(value), digest)

    def get_file(self, rpath, lpath, **kwargs):
        t0 = time.perf_counter()
        with _quiet():
            self._own("get_file")(rpath, lpath, **kwargs)
        count_io("download", os.path.getsize(lpath), time.perf_counter() - t0)

    def put_file(self, lpath, rpath, **kwargs):
        digest = sha256_local(str(lpath))
        t0 = time.perf_counter()
        with _quiet():
            self._own("put_file")(lpath, rpath, **kwargs)
        size = os.path.getsize(lpath)
        count_io("upload", size, time.perf_counter() - t0)
        note_written(self._strip_protocol(rpath), size, digest)

    def __reduce__(self):
        return counted_instance, (type(self).__mro__[2], self.storage_args, self.storage_options)


_CLASSES: dict[type, type] = {}


def counted_class(cls: type) -> type:
    """`cls` with Counted mixed in (one class per filesystem class). Its instances are cached in the same dict
    as `cls`'s (under their own keys): clearing `cls`'s cache (new credentials) clears them too."""
    if cls not in _CLASSES:
        counted = type(f"Counted{cls.__name__}", (Counted, cls), {"__module__": __name__})
        counted._cache = cls._cache
        _CLASSES[cls] = counted
    return _CLASSES[cls]


def counted_instance(cls: type, args: tuple, options: dict) -> AbstractFileSystem:
    return counted_class(cls)(*args, **options)


def counted_fs(fs: AbstractFileSystem) -> AbstractFileSystem:
    """A counted filesystem like `fs` (same class, same options; a filesystem of its own, not fsspec's
    shared instance, so that nothing else's reads count as the storage's)."""
    if isinstance(fs, Counted):
        return fs
    return counted_instance(type(fs), fs.storage_args, fs.storage_options)


# ---------------------------------------------------------------- many files


def _is_local(fs: AbstractFileSystem) -> bool:
    return "file" in fs.protocol or "local" in fs.protocol


def _plain(fs: AbstractFileSystem, name: str):
    """`fs`'s own method `name`, uncounted (Counted._own)."""
    return fs._own(name) if isinstance(fs, Counted) else getattr(fs, name)


def put_files(fs: AbstractFileSystem, pairs: list[tuple[str, str]]) -> dict[str, tuple[int, str]]:
    """Upload (local file, storage path) pairs: on S3 `BATCH` files at once and large ones in parallel
    parts, each hashed from its local copy while the uploads run. Returns {storage path: (size, sha256)}."""
    if not pairs:
        return {}
    with ThreadPoolExecutor(max_workers=min(4, len(pairs))) as pool:
        digests = [in_context(pool, sha256_local, str(local)) for local, _ in pairs]
        t0 = time.perf_counter()
        with _quiet():
            if _is_local(fs):
                for local, remote in pairs:
                    _plain(fs, "put_file")(str(local), remote)
            else:
                _plain(fs, "put")(
                    [str(p) for p, _ in pairs], [r for _, r in pairs], batch_size=BATCH, chunksize=PART_BYTES
                )
        seconds = time.perf_counter() - t0
        out = {remote: (os.path.getsize(local), d.result()) for (local, remote), d in zip(pairs, digests)}
    count_io("upload", sum(size for size, _ in out.values()), seconds)
    for remote, (size, digest) in out.items():
        note_written(remote, size, digest)
    return out


def get_files(fs: AbstractFileSystem, pairs: list[tuple[str, str]]) -> None:
    """Download (storage path, local file) pairs: on S3 `BATCH` files at once, large ones in parallel
    ranges (s3fs's max_concurrency)."""
    if not pairs:
        return
    for _, local in pairs:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with _quiet():
        if _is_local(fs):
            for remote, local in pairs:
                _plain(fs, "get_file")(remote, local)
        else:
            _plain(fs, "get")([r for r, _ in pairs], [str(p) for _, p in pairs], batch_size=BATCH)
    count_io("download", sum(os.path.getsize(local) for _, local in pairs), time.perf_counter() - t0)


# ---------------------------------------------------------------- hashes kept across processes


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
