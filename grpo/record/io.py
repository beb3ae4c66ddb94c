"""The counted filesystem every storage access goes through, and many files at once.

- `counted_fs(fs)`: the storage's filesystem, of a subclass of its own class whose open, cat_file, pipe_file,
  get_file and put_file count what they move (grpo.record.counts), and which hashes what is written through it as
  it goes (grpo.record.digests.note_written), so a commit never reads its own files back.
- `put_files` / `get_files`: a folder's files in one call, concurrent requests on S3 (s3fs's batch_size,
  multipart parts of `PART_BYTES` in parallel for large files).
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import inspect
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import fsspec.asyn
from fsspec import AbstractFileSystem

from grpo.record.counts import count_io, in_context, is_local
from grpo.record.digests import note_written, sha256_local

BATCH = 8  # files in flight at once on S3
PART_BYTES = 16 << 20  # S3 multipart part size; files of 2 parts and more upload their parts in parallel
_BUSY: contextvars.ContextVar[bool] = contextvars.ContextVar("grpo_io_busy", default=False)


@contextmanager
def _quiet() -> Iterator[None]:
    """Inside a counted call: the filesystem's own nested calls (open inside cat_file) count nothing more."""
    token = _BUSY.set(True)
    try:
        yield
    finally:
        _BUSY.reset(token)


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
            if is_local(fs):
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
        if is_local(fs):
            for remote, local in pairs:
                _plain(fs, "get_file")(remote, local)
        else:
            _plain(fs, "get")([r for r, _ in pairs], [str(p) for _, p in pairs], batch_size=BATCH)
    count_io("download", sum(os.path.getsize(local) for _, local in pairs), time.perf_counter() - t0)
