"""Artifact storage over fsspec: the facade, a stage's attempts, their manifests, and verifying what is read.

One URL configures it: `file:///abs/dir` (the default is `./storage` under the
working directory) or `s3://bucket/prefix` through s3fs, with the endpoint and
credentials from the standard AWS variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION).

A stage folder holds attempts: `<stage>/attempt-0001-3fa2c1/`, committed once its `_manifest.json` exists
(grpo.record.commit writes it last). Readers take the newest committed attempt and check the size and sha256 of
each file they read against it (`Committed.read_path`, `verify_files`); a file hashed once on this machine is not
hashed again while its stamp holds (grpo.record.digests). Every byte moved through the storage's filesystem is
counted into the attempt's `io` record (grpo.record.io, grpo.record.counts).

`grpo gc --retention` may later remove a committed attempt's weights and optimizer state, and `grpo gc` a
shard's table once its stage merged it; gc lists them first in the attempt's `collected.json`: verification
skips them, and reading one fails naming it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
from fsspec import AbstractFileSystem

from grpo.errors import StageError
from grpo.record.counts import is_local
from grpo.record.digests import file_digest
from grpo.record.io import counted_fs
from schemas.manifest import MANIFEST_NAME, FileEntry, InputRef, Manifest

DEFAULT_STORAGE = "storage"
COLLECTED_NAME = "collected.json"  # in a committed attempt: its files that `grpo gc --retention` removed


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


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


# ---------------------------------------------------------------- attempts


def attempt_number(name: str) -> int:
    try:
        return int(name.split("-")[1])
    except (IndexError, ValueError):
        return -1


def list_attempts(storage: Storage, stage_dir: str) -> list[str]:
    """Attempt folders of a stage, oldest first (committed or not)."""
    if not storage.exists(stage_dir):
        return []
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in storage.fs.ls(stage_dir, detail=False)]
    names = [n for n in names if n.startswith("attempt-") and attempt_number(n) >= 0]
    return sorted(names, key=lambda n: (attempt_number(n), n))


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
    records.update({name: {"at": now(), "why": why} for name, why in files.items()})
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
