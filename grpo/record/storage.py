"""Artifact storage over fsspec, with stage outputs committed by a manifest written last.

One URL configures it: `file:///abs/dir` (the default is `./storage` under the
working directory) or `s3://bucket/prefix` through s3fs, with the endpoint and
credentials from the standard AWS variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION).

A stage folder holds attempts: `<stage>/attempt-0001-3fa2c1/`. A writer always
opens a fresh attempt folder, so committed files are never written over; the
attempt is committed once its `_manifest.json` exists, and that file is written
last (a single object PUT on S3, a rename on a local disk). Readers take the
newest committed attempt and check the size and sha256 of each file they read
against it (`Committed.read_path`, `verify_files`); a commit hashes its files as
they are written (grpo.record.io), and a file hashed once on this machine is not
hashed again while its stamp holds (`file_digest`). Every byte moved through the
storage's filesystem is counted into the attempt's `io` record (grpo.record.io).

While a writer runs, its attempt holds a `.heartbeat` it rewrites every ~30 s (Heartbeat), so that
`grpo gc` can tell a live attempt from a dead one however long its stage writes nothing else.
`grpo gc --retention` may later remove a committed attempt's weights and optimizer state, and `grpo gc` a
shard's table once its stage merged it; gc lists them first in the attempt's `collected.json`: verification
skips them, and reading one fails naming it.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import socket
import subprocess
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import fsspec
from fsspec import AbstractFileSystem

from grpo.errors import StageError
from grpo.record.identity import config_hash, stage_identity
from grpo.record.io import STAMPS, IoCounts, count_io, counted_fs, uncounted, written_digest
from schemas.manifest import MANIFEST_NAME, FileEntry, InputRef, Manifest

DEFAULT_STORAGE = "storage"
HEARTBEAT_NAME = ".heartbeat"  # in an attempt being written: refreshed while its writer lives, never in a manifest
COLLECTED_NAME = "collected.json"  # in a committed attempt: its files that `grpo gc --retention` removed
_CHUNK = 1 << 20
log = logging.getLogger("grpo.record.storage")


class ArtifactError(RuntimeError):
    """A stage output is missing, uncommitted or corrupt."""


class NotCommittedError(ArtifactError):
    pass


class CorruptArtifactError(ArtifactError, StageError):
    """A committed file's bytes are not its manifest's: the stage reading it fails in one line, as on any
    input it refuses (a StageError), saying what to remake."""


class CollectedError(ArtifactError):
    """A committed file that `grpo gc --retention` removed is needed."""


class AttemptRemovedError(ArtifactError):
    """The attempt being written was removed (by `grpo gc --delete`) before its commit."""


def default_storage_url() -> str:
    return os.environ.get("GRPO_STORAGE") or Path(DEFAULT_STORAGE).resolve().as_uri()


@dataclass(frozen=True)
class Storage:
    """A filesystem plus the root path every artifact path is relative to."""

    fs: AbstractFileSystem
    root: str
    url: str

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *(p.strip("/") for p in parts if p)])

    def uri(self, path: str) -> str:
        """Full URI of an fs path, usable by pandas, DuckDB and other processes."""
        return self.fs.unstrip_protocol(path)

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def read_bytes(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        """Readers see either nothing or all of `data` at `path`."""
        if is_local(self.fs):
            tmp = f"{path}.tmp-{secrets.token_hex(4)}"
            self.fs.pipe_file(tmp, data)
            os.replace(tmp, path)  # atomic rename on one filesystem
        else:
            self.fs.pipe_file(path, data)  # one object PUT: atomic on S3


def is_local(fs: AbstractFileSystem) -> bool:
    return "file" in fs.protocol or "local" in fs.protocol


def _s3_options() -> dict:
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    opts: dict = {"use_listings_cache": False}  # other processes write beside us
    if endpoint:
        opts["client_kwargs"] = {"endpoint_url": endpoint}
    return opts


def url_to_fs(url: str):
    """(filesystem, path) of any fsspec URL; s3:// takes the same endpoint settings as the storage."""
    return fsspec.core.url_to_fs(url, **(_s3_options() if url.startswith(("s3://", "s3a://")) else {}))


def open_storage(url: str | None = None) -> Storage:
    """Open `url` (default: $GRPO_STORAGE or ./storage); local roots are created."""
    url = url or default_storage_url()
    if "://" not in url:
        url = Path(url).resolve().as_uri()
    protocol = url.split("://", 1)[0]
    opts = _s3_options() if protocol in ("s3", "s3a") else {}
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs = counted_fs(fs)  # every byte it moves counts into the open io record
    if is_local(fs):
        fs.makedirs(root, exist_ok=True)
    return Storage(fs=fs, root=root, url=url)


def sha256_file(fs: AbstractFileSystem, path: str) -> str:
    h, n, t0 = hashlib.sha256(), 0, time.perf_counter()
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
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


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("grpo-flow")
    except PackageNotFoundError:
        v = "0+unknown"
    here = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        sha = ""
    return f"{v}+g{sha}" if sha else v


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


# ---------------------------------------------------------------- attempts


def _attempt_number(name: str) -> int:
    try:
        return int(name.split("-")[1])
    except (IndexError, ValueError):
        return -1


def list_attempts(storage: Storage, stage_dir: str) -> list[str]:
    """Attempt folders of a stage, oldest first (committed or not)."""
    if not storage.exists(stage_dir):
        return []
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in storage.fs.ls(stage_dir, detail=False)]
    names = [n for n in names if n.startswith("attempt-") and _attempt_number(n) >= 0]
    return sorted(names, key=lambda n: (_attempt_number(n), n))


def is_committed(storage: Storage, attempt_dir: str) -> bool:
    return storage.exists(f"{attempt_dir}/{MANIFEST_NAME}")


def committed_attempts(storage: Storage, stage_dir: str) -> list[str]:
    """Folders of the committed attempts of a stage, oldest first."""
    dirs = [f"{stage_dir}/{name}" for name in list_attempts(storage, stage_dir)]
    return [d for d in dirs if is_committed(storage, d)]


def load_manifest(storage: Storage, attempt_dir: str, verify: bool = True) -> tuple[Manifest, str]:
    """Manifest of one attempt and the sha256 of its bytes; with `verify`, check every file."""
    mpath = f"{attempt_dir}/{MANIFEST_NAME}"
    if not storage.exists(mpath):
        raise NotCommittedError(f"{storage.uri(attempt_dir)}: not committed (no {MANIFEST_NAME})")
    data = storage.read_bytes(mpath)
    try:
        manifest = Manifest.from_json(data, storage.uri(mpath))
    except ValueError as e:
        raise CorruptArtifactError(str(e)) from e
    if verify:
        verify_files(storage, attempt_dir, manifest)
    return manifest, hashlib.sha256(data).hexdigest()


def file_path(storage: Storage, attempt_dir: str, entry: FileEntry) -> str:
    if entry.uri:
        return fsspec.core.strip_protocol(entry.uri) if "://" in entry.uri else entry.uri
    return f"{attempt_dir}/{entry.path}"


def read_collected(storage: Storage, attempt_dir: str) -> dict[str, dict]:
    """{file path in the attempt: {"at", "why"}} of the files `grpo gc --retention` removed from it."""
    path = f"{attempt_dir}/{COLLECTED_NAME}"
    try:
        return json.loads(storage.read_bytes(path))["files"]
    except FileNotFoundError:
        return {}
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptArtifactError(f"{storage.uri(path)}: not a valid {COLLECTED_NAME}: {e}") from e


MERGED_SHARD = "shard table merged into "
"""How the why of a shard table `grpo gc` collected begins (grpo.gc.merged_shard_tables)."""


def mark_collected(storage: Storage, attempt_dir: str, files: dict[str, str]) -> None:
    """List {file path in the attempt: why} in its collected.json, before gc removes them."""
    records = read_collected(storage, attempt_dir)
    records.update({name: {"at": _now(), "why": why} for name, why in files.items()})
    data = json.dumps({"by": "grpo gc --retention", "files": records}, indent=1, sort_keys=True).encode()
    storage.write_bytes_atomic(f"{attempt_dir}/{COLLECTED_NAME}", data)


def _collected_note(storage: Storage, path: str, known: dict[str, dict]) -> str | None:
    """The one-line error for a missing file that gc collected (looked up in the collected.json of the
    attempt holding it: a snapshot's files live in a learn's attempt); None when it was not collected."""
    parts = path.split("/")
    at = max((i for i, p in enumerate(parts) if p.startswith("attempt-")), default=None)
    if at is None:
        return None
    owner = "/".join(parts[: at + 1])
    if owner not in known:
        known[owner] = read_collected(storage, owner)
    record = known[owner].get("/".join(parts[at + 1 :]))
    if record is None:
        return None
    if record["why"].startswith(MERGED_SHARD):  # plain gc: the stage's table holds the same rows
        return (
            f"{storage.uri(path)} was collected by `grpo gc` at {record['at']} ({record['why']}); its rows are in "
            "that table: read it, or remake the shard with `grpo stage ... --shard K --force`"
        )
    return (
        f"{storage.uri(path)} was collected by `grpo gc --retention` at {record['at']} ({record['why']}); "
        "it cannot be read back: only the newest learn keeps all its files, so continue the run from there "
        "(`grpo run`), or start a new run from a kept policy"
    )


def collected_files(storage: Storage, attempt_dir: str, manifest: Manifest) -> dict[str, str]:
    """{manifest path: one-line error} of the listed files `grpo gc --retention` collected, from the
    collected.json of the attempts holding them (no file is read or hashed)."""
    collected, known = {}, {}
    for entry in manifest.files:
        path = file_path(storage, attempt_dir, entry)
        note = _collected_note(storage, path, known)
        if note is not None:
            collected[entry.path] = note
    return collected


def _remake(storage: Storage, manifest: Manifest, entry: FileEntry) -> str:
    """What to do about a damaged file of `manifest`: remake the stage whose attempt holds it (a referenced
    file: the input it came from), in words for the one-line error."""
    owner = manifest
    for ref in manifest.inputs.values() if entry.uri else ():
        if entry.uri.startswith(ref.uri.rstrip("/") + "/"):
            path = fsspec.core.strip_protocol(ref.uri) if "://" in ref.uri else ref.uri
            owner = load_manifest(storage, path, verify=False)[0]
    if owner.iteration is None:
        return f"the run's {owner.stage} model changed after its commit; restore its files or make a new run"
    stage, shard = owner.stage, ""
    if match := re.match(r"(?P<stage>\w+)-shard-(?P<shard>\d+)-of-\d+$", stage):
        stage, shard = match["stage"], f" --shard {match['shard']}"
    return (
        f"the committed {owner.stage} changed after its commit; make a new attempt with `grpo stage {stage} "
        f"--run {owner.run_id} --iteration {owner.iteration}{shard} --force` (the damaged one stays for inspection)"
    )


def check_entry(storage: Storage, manifest: Manifest, entry: FileEntry, where: str, size: int, digest: str) -> None:
    """CorruptArtifactError, one line saying what to rerun, when (size, digest) are not the manifest entry's."""
    if size != entry.size:
        what = f"size {size} != manifest's {entry.size}"
    elif digest != entry.sha256:
        what = f"sha256 {digest[:12]}… != manifest's {entry.sha256[:12]}…"
    else:
        return
    raise CorruptArtifactError(f"{where}: {what}: {_remake(storage, manifest, entry)}")


def verify_files(
    storage: Storage, attempt_dir: str, manifest: Manifest, only: set[str] | None = None
) -> dict[str, str]:
    """Check the size and sha256 of every file (of `only`, manifest paths, when given) against the
    manifest. Returns {manifest path: one-line error} of the files `grpo gc --retention` collected:
    skipped here, refused by Committed.path."""
    collected, known = {}, {}
    for entry in manifest.files:
        if only is not None and entry.path not in only:
            continue
        path = file_path(storage, attempt_dir, entry)
        where = storage.uri(path)
        try:
            size, digest = file_digest(storage.fs, path)
        except FileNotFoundError:
            note = _collected_note(storage, path, known)
            if note is not None:
                collected[entry.path] = note
                continue
            raise CorruptArtifactError(f"{where}: listed in the manifest but missing") from None
        check_entry(storage, manifest, entry, where, size, digest)
    return collected


@dataclass(frozen=True)
class Committed:
    """A committed stage output: where it is and what its manifest says."""

    storage: Storage
    attempt_dir: str
    manifest: Manifest
    manifest_sha256: str
    collected: dict[str, str] = field(default_factory=dict, compare=False)
    """{manifest path: one-line error} of its files `grpo gc --retention` removed (known once verified)."""

    def path(self, name: str) -> str:
        """Storage path of a listed file; CollectedError names a file gc collected."""
        if name in self.collected:
            raise CollectedError(self.collected[name])
        return file_path(self.storage, self.attempt_dir, self.manifest.file(name))

    def read_path(self, name: str) -> str:
        """Storage path of a listed file about to be read, its size and sha256 checked first (not hashed
        again while its stamp holds); CorruptArtifactError or CollectedError in one line."""
        path = self.path(name)
        collected = verify_files(self.storage, self.attempt_dir, self.manifest, only={name})
        if name in collected:
            raise CollectedError(collected[name])
        return path

    @property
    def uri(self) -> str:
        return self.storage.uri(self.attempt_dir)

    def ref(self) -> InputRef:
        return InputRef(uri=self.uri, manifest_sha256=self.manifest_sha256)


def latest_committed(storage: Storage, stage_dir: str, verify: bool = True) -> Committed:
    """The newest committed attempt of a stage; uncommitted attempts are never read. With `verify`, every
    file is checked (a stage checks only what it reads: lineage.committed_input)."""
    attempts = committed_attempts(storage, stage_dir)
    if attempts:
        manifest, sha = load_manifest(storage, attempts[-1], verify=False)
        collected = verify_files(storage, attempts[-1], manifest) if verify else {}
        return Committed(storage, attempts[-1], manifest, sha, collected)
    raise NotCommittedError(f"{storage.uri(stage_dir)}: no committed attempt")


def find_committed(storage: Storage, stage_dir: str, identity: str, verify: bool = True) -> Committed | None:
    """The newest committed attempt whose identity is `identity`, if any."""
    for attempt_dir in reversed(committed_attempts(storage, stage_dir)):
        manifest, sha = load_manifest(storage, attempt_dir, verify=False)
        if manifest.identity == identity:
            collected = verify_files(storage, attempt_dir, manifest) if verify else {}
            return Committed(storage, attempt_dir, manifest, sha, collected)
    return None


def heartbeat_interval_s() -> float:
    """Seconds between two beats of a writer's heartbeat: $GRPO_HEARTBEAT_S, else 30."""
    return float(os.environ.get("GRPO_HEARTBEAT_S", "30"))


class Heartbeat:
    """`.heartbeat` in an attempt being written, rewritten every `interval_s` by a daemon thread.

    Its JSON says who writes the attempt (host, pid, stage), what it reads (`inputs`: URIs gc must
    keep) and `beat_at`, this machine's clock at the beat; the storage dates each beat too (the
    file's mtime). `grpo gc` leaves an uncommitted attempt alone while its heartbeat is recent.
    A beat never recreates a heartbeat that is gone: the attempt was removed, and the writer fails
    at commit instead of committing what is left of it.
    """

    def __init__(self, storage: Storage, attempt_dir: str, info: dict, interval_s: float):
        self.storage, self.path = storage, f"{attempt_dir}/{HEARTBEAT_NAME}"
        self.info = {**info, "interval_s": interval_s}
        self.lost = False  # the heartbeat was found removed
        self._stop = threading.Event()
        self._write()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="grpo-heartbeat", daemon=True)
        self._thread.start()

    def _write(self, **extra) -> None:
        data = json.dumps({**self.info, "beat_at": time.time(), **extra}, sort_keys=True).encode()
        with uncounted():  # bookkeeping, not the stage's data
            self.storage.write_bytes_atomic(self.path, data)

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                if not self.storage.exists(self.path):
                    self.lost = True
                    return
                self._write()
            except Exception as e:  # a storage hiccup: the next beat tries again
                log.warning("heartbeat %s: %s: %s", self.storage.uri(self.path), type(e).__name__, e)

    def alive(self) -> bool:
        """Whether the heartbeat is still there (nobody removed the attempt)."""
        return not self.lost and self.storage.exists(self.path)

    def stop(self, then: str | None = None) -> None:
        """Stop beating; then "remove" the heartbeat (committed) or mark it "closed" (failed: gc no
        longer sees the attempt live, and removes it once it is older than its age limit)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=60)  # a beat in flight finishes first
        if then is None or not self.alive():
            return
        try:
            if then == "remove":
                self.storage.fs.rm_file(self.path)
            else:
                self._write(closed_at=time.time())
        except Exception as e:  # the commit stands; a stale heartbeat only delays gc
            log.warning("heartbeat %s: %s: %s", self.storage.uri(self.path), type(e).__name__, e)


class StageWriter:
    """Writes one new attempt of a stage; nothing is visible to readers until `commit`.

    usage:
        with StageWriter(storage, stage_dir, run_id=..., iteration=..., stage=..., config=..., inputs=...) as w:
            with storage.fs.open(w.path("rollouts.parquet"), "wb") as f: ...
            committed = w.commit(summary={...})

    From its creation to its commit the attempt has a heartbeat (Heartbeat); leaving the `with`
    block (or `close()`) without a commit marks it closed.
    """

    def __init__(
        self,
        storage: Storage,
        stage_dir: str,
        *,
        run_id: str,
        iteration: int | None,
        stage: str,
        config: dict,
        inputs: dict[str, InputRef],
        origin: InputRef | None = None,
    ):
        self.storage, self.stage_dir = storage, stage_dir
        self.origin = origin  # a fork's attempt that takes another run's by reference (grpo.record.fork)
        self.run_id, self.iteration, self.stage = run_id, iteration, stage
        self.config, self.inputs = config, inputs
        self.config_hash = config_hash(config)
        self.identity = stage_identity(run_id, iteration, stage, self.config_hash, inputs)
        previous = list_attempts(storage, stage_dir)
        number = _attempt_number(previous[-1]) + 1 if previous else 1
        self.attempt = f"attempt-{number:04d}-{secrets.token_hex(3)}"
        self.attempt_dir = f"{stage_dir}/{self.attempt}"
        if is_local(storage.fs):
            storage.fs.makedirs(self.attempt_dir, exist_ok=False)
        self.started_at = _now()
        self._referenced: list[FileEntry] = []
        self._committed = False
        info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "stage": stage,
            "iteration": iteration,
            "started_at": self.started_at,
            "inputs": {name: ref.uri for name, ref in sorted(inputs.items())},
        }
        self._heartbeat = Heartbeat(storage, self.attempt_dir, info, heartbeat_interval_s())
        weakref.finalize(self, self._heartbeat.stop)  # a writer dropped unclosed stops beating

    def __enter__(self) -> StageWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the heartbeat; an attempt left uncommitted is marked closed (failed)."""
        if not self._committed:
            self._heartbeat.stop(then="closed")

    def _check_attempt(self) -> None:
        """Fail, in one line, when the attempt folder was removed while the stage ran."""
        if not self._heartbeat.alive():
            raise AttemptRemovedError(
                f"{self.storage.uri(self.attempt_dir)}: this attempt was removed before its commit (its "
                f"{HEARTBEAT_NAME} is gone: `grpo gc --delete` took it for dead?); nothing was committed, "
                f"run the {self.stage} stage again"
            )

    def path(self, name: str) -> str:
        path = f"{self.attempt_dir}/{name}"
        if is_local(self.storage.fs) and "/" in name:
            self.storage.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        return path

    def bind_inputs(self, inputs: dict[str, InputRef]) -> None:
        """Name the attempt's inputs now, before its commit: an attempt opened before the commit it reads
        existed (a learn's state, whose shards are written while the learn commits)."""
        if self._committed:
            raise ArtifactError(f"{self.storage.uri(self.attempt_dir)}: already committed")
        self.inputs = inputs
        self.identity = stage_identity(self.run_id, self.iteration, self.stage, self.config_hash, inputs)

    def reference(self, name: str, entry: FileEntry) -> None:
        """List a file that already lives, committed and immutable, elsewhere in storage."""
        self._referenced.append(FileEntry(path=name, size=entry.size, sha256=entry.sha256, uri=entry.uri))

    def _own_files(self) -> list[FileEntry]:
        """The attempt's files with their sha256: as hashed while this process wrote them (grpo.record.io),
        else (a file written in place on a local disk, or by another process) hashed now."""
        fs = self.storage.fs
        found = fs.find(self.attempt_dir, detail=True) if fs.exists(self.attempt_dir) else {}
        entries = []
        for p in sorted(found):
            rel = p[len(self.attempt_dir) + 1 :]
            if rel in (MANIFEST_NAME, HEARTBEAT_NAME) or ".tmp-" in rel:
                continue
            size = found[p]["size"]
            digest = written_digest(p, size)
            if is_local(fs):  # done writing: a reader on this machine trusts what the commit hashed
                settle(p)
            if digest is None:
                if is_local(fs):  # written in place (a learner's torch.save): not seen by the counters
                    count_io("write", size, 0.0)
                size, digest = file_digest(fs, p)
            else:
                remember_digest(fs, p, digest)  # a reader on this machine need not hash it again
            entries.append(FileEntry(path=rel, size=size, sha256=digest, uri=None))
        return entries

    def commit(self, summary: dict | None = None, io: IoCounts | None = None) -> Committed:
        """List every file written with its hash, then write the manifest last (the heartbeat beats on
        meanwhile); `io`, what the attempt moved (its own manifest left out), is recorded in it."""
        if self._committed:
            raise ArtifactError(f"{self.storage.uri(self.attempt_dir)}: already committed")
        self._check_attempt()
        files = self._own_files() + self._referenced
        manifest = Manifest(
            stage=self.stage,
            run_id=self.run_id,
            iteration=self.iteration,
            attempt=self.attempt,
            identity=self.identity,
            config=self.config,
            config_hash=self.config_hash,
            inputs=self.inputs,
            files=files,
            code_version=code_version(),
            started_at=self.started_at,
            committed_at=_now(),
            summary=summary or {},
            origin=self.origin,
            io=None if io is None else io.record(),
        )
        data = manifest.to_json()
        self._check_attempt()  # hashing a large checkpoint takes a while: still there?
        self.storage.write_bytes_atomic(f"{self.attempt_dir}/{MANIFEST_NAME}", data)
        self._committed = True
        self._heartbeat.stop(then="remove")
        return Committed(self.storage, self.attempt_dir, manifest, hashlib.sha256(data).hexdigest())
