"""The datasets a run is pinned to: `grpo init` records each dataset's `fingerprint` (what identifies its bytes), and a
run's stages read a dataset only while it still has that fingerprint (`pin`, `pinned_version`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re

from grpo.errors import DatasetChangedError, DatasetError
from grpo.record.counts import is_local
from grpo.record.digests import file_digest
from grpo.record.storage import url_to_fs

log = logging.getLogger("grpo.data")

_CONTENT_TAGS = ("ETag", "etag", "VersionId", "generation", "Content-MD5", "Digest", "md5Hash", "crc32c")
"""What an object store or web server may say of an object's content, in the order they are read: a new tag
for new content. A modification time is none (an edit may keep it: `cp -p`, rsync -t, HTTP's whole seconds)."""


def _object_version(info: dict) -> str | None:
    """An object's size and content tag (ETag: opaque, a multipart one is no MD5; or a version id, Content-MD5,
    ...); None where the store gives no tag.

    >>> _object_version({"size": 3, "ETag": '"abc"', "Last-Modified": "x"}), _object_version({"size": 3, "mtime": 1})
    ('3:abc', None)
    """
    tag = next((str(info[k]).strip('"') for k in _CONTENT_TAGS if info.get(k)), None)
    return None if tag is None else f"{info.get('size')}:{tag}"


def _content_digest(fs, path: str, uri: str, size: int | None) -> str:
    """sha256 of an object's bytes, read through once (an HTTP server's in one streamed GET); a DatasetError
    where they cannot be read whole: nothing then says which bytes the run was made from."""
    h, n = hashlib.sha256(), 0
    stream = {"block_size": 0} if "http" in fs.protocol else {}  # no range requests: not every server takes them
    try:
        with fs.open(path, "rb", **stream) as f:
            while chunk := f.read(2**20):
                h.update(chunk)
                n += len(chunk)
    except Exception as e:  # noqa: BLE001 (each store raises its own kinds; aiohttp's are no OSError)
        raise DatasetError(
            f"dataset {uri}: the store gives no content tag (ETag, Content-MD5, a version id) and its bytes could "
            f"not be read whole to hash them ({type(e).__name__}: {e}); serve it with an ETag, or copy it to local "
            "or S3 storage"
        ) from e
    if size is not None and n != size:
        raise DatasetError(
            f"dataset {uri}: the store gives no content tag (ETag, Content-MD5, a version id) and sent {n} of its "
            f"{size} bytes; serve it with an ETag, or copy it to local or S3 storage"
        )
    return h.hexdigest()


def _is_http(fs) -> bool:
    return any(p in ("http", "https") for p in ([fs.protocol] if isinstance(fs.protocol, str) else fs.protocol))


_DIGEST = re.compile(r"[0-9a-f]{32}|[0-9a-f]{40}|[0-9a-f]{64}")


def content_validator(info: dict) -> str | None:
    """What a web server says of an object that changes with its content, as `size:tag`: a Content-MD5 or
    Digest, or an ETag that is a content digest (32, 40 or 64 hex digits: MD5, SHA-1, SHA-256, as S3 behind a
    CDN or the Hugging Face Hub send); None for a weak validator (W/), and for an ETag made of the file's size
    and modification time, as nginx ("5f3c1a2b-1a4") and Apache ("1a4-5f3c1a2b3c4d5") make theirs: an edit that
    keeps both (cp -p, rsync -t) keeps the tag.

    >>> content_validator({"size": 420, "ETag": '"5f3c1a2b-1a4"'}), content_validator({"size": 4, "ETag": 'W/"x"'})
    (None, None)
    >>> content_validator({"size": 420, "ETag": '"d41d8cd98f00b204e9800998ecf8427e"'})
    '420:d41d8cd98f00b204e9800998ecf8427e'
    """
    tag = next((str(info[k]) for k in ("Content-MD5", "Digest") if info.get(k)), None)
    etag = str(info.get("ETag") or "").strip()
    if tag is None and not etag.startswith("W/") and _DIGEST.fullmatch(etag.strip('"').lower()):
        tag = etag.strip('"').lower()
    return None if tag is None else f"{info.get('size')}:{tag}"


def validator(uri: str) -> str | None:
    """content_validator of a dataset on a web server, which `grpo init` records beside its fingerprint: a later
    read checks the dataset by it without a download; None elsewhere (and where the server gives none: each
    check then reads the bytes)."""
    fs, path = url_to_fs(uri)
    return content_validator(fs.info(path)) if _is_http(fs) and not fs.isdir(path) else None


def fingerprint(uri: str) -> str:
    """What identifies the dataset's bytes: `sha256:` of a local file's content (of each file's name and
    content in a save_to_disk folder), `etag:` a hash of each object's size and content tag (ETag) on
    object storage, `sha256:` of each object's bytes where the store gives no tag and on a web server,
    whatever its ETag says (nginx's and Apache's are the file's size and mtime: a same-size edit that keeps
    the mtime keeps them); a DatasetError when the bytes do not read whole.

    Local files are hashed once a process while their stat stamp holds (grpo.record.storage.file_digest);
    tagged objects cost one metadata request each, web servers' and untagged ones a download each time
    (pinned_version spares it while a server's content_validator holds).
    """
    fs, path = url_to_fs(uri)
    if not fs.exists(path):
        raise DatasetError(f"dataset {uri}: no such file or folder")
    folder = fs.isdir(path)
    if is_local(fs):
        files = sorted(fs.find(path)) if folder else [path]
        parts = [(f[len(path) :], *file_digest(fs, f)) for f in files]
        if not folder:
            return f"sha256:{parts[0][2]}"
        kind = "sha256"
    else:
        infos = fs.find(path, detail=True) if folder else {path: fs.info(path)}
        tags = {f: _object_version(info) for f, info in infos.items()}
        if all(tags.values()) and not _is_http(fs):
            parts = [(f[len(path) :], tags[f]) for f in sorted(infos)]
            kind = "etag"
        else:
            parts = [(f[len(path) :], _content_digest(fs, f, uri, infos[f].get("size"))) for f in sorted(infos)]
            if not folder:
                return f"sha256:{parts[0][1]}"
            kind = "sha256"
    return f"{kind}:{hashlib.sha256(json.dumps(parts).encode()).hexdigest()}"


_PINNED: dict[str, tuple[str, str, str | None]] = {}  # dataset uri -> (config field, fingerprint, validator) of init


def pin(datasets: dict[str, dict] | None) -> None:
    """Hold the datasets of the run being loaded to their recorded fingerprints: `datasets` is
    {field: {"uri", "fingerprint", ...}} as grpo init recorded it, and replaces the pins of the run loaded
    before. None (a run made before fingerprints were recorded) pins nothing: its datasets are read as
    they are."""
    global _PINNED
    _PINNED = {
        facts["uri"]: (name, facts["fingerprint"], facts.get("validator")) for name, facts in (datasets or {}).items()
    }  # swapped whole


def _short(fingerprint_: str) -> str:
    """`kind:` and the first 12 hex digits, enough to tell two fingerprints apart in one line."""
    kind, _, digest = fingerprint_.partition(":")
    return f"{kind}:{digest[:12]}"


def _size_only(uri: str, tagged: bool = False) -> str:
    """The fingerprint a file on a web server got before its bytes were hashed: its size alone where the server
    gave no ETag, its size and ETag with `tagged`."""
    fs, path = url_to_fs(uri)
    info = fs.info(path)
    parts = [("", (_object_version(info) if tagged else None) or f"{info.get('size')}:")]
    return f"etag:{hashlib.sha256(json.dumps(parts).encode()).hexdigest()}"


_SIZE_PINNED: set[str] = set()  # datasets of runs pinned by size (and ETag) alone, said once a process


def pinned_version(uri: str) -> str:
    """The dataset's fingerprint; a DatasetChangedError when the run pinned it (`pin`) to another. On a web server
    whose content_validator still is the one recorded, the recorded fingerprint without a download. A run made
    when a web server's file was pinned by its size (and ETag) alone goes on while they hold, said once (its
    bytes were never recorded: a new run pins them)."""
    name, then, checked = _PINNED.get(uri, ("", None, None))
    if then is not None and checked is not None and validator(uri) == checked:
        return then
    now = fingerprint(uri)
    then = now if then is None else then
    legacy = {_size_only(uri, tagged=True): "size and ETag", _size_only(uri): "size"}  # no ETag: the size
    if now != then and now.startswith("sha256:") and then in legacy:
        if uri not in _SIZE_PINNED:
            _SIZE_PINNED.add(uri)
            log.warning(
                "%s %s was pinned by its %s alone when the run was made: an edit of the same size (that keeps the "
                "file's time) goes unseen in this run; a new run pins its bytes",
                name,
                uri,
                legacy[then],
            )
        return now
    if now != then:
        raise DatasetChangedError(
            f"{name} {uri} changed since grpo init (fingerprint {_short(then)}, now {_short(now)}); "
            "restore it, or start a new run with grpo init --run NEW"
        )
    return now
