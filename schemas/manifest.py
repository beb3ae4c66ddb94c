"""The `_manifest.json` that commits one attempt of a stage.

A stage writes its files into a fresh attempt folder, then writes this manifest
last; readers only trust folders that have one and whose files match it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

MANIFEST_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: before the `io` record
MANIFEST_NAME = "_manifest.json"


@dataclass(frozen=True)
class FileEntry:
    path: str
    """Path relative to the attempt folder (or, with `uri`, a name for a referenced file)."""
    size: int
    sha256: str
    uri: str | None = None
    """Set when the file lives elsewhere in storage and is referenced, not copied."""


@dataclass(frozen=True)
class InputRef:
    uri: str
    """URI of the input stage's attempt folder."""
    manifest_sha256: str
    """sha256 of the input's manifest bytes: pins the exact committed input."""


@dataclass(frozen=True)
class Manifest:
    stage: str
    run_id: str
    iteration: int | None
    attempt: str
    identity: str
    """sha256 over (run, iteration, stage, config hash, inputs' manifest hashes)."""
    config: dict
    config_hash: str
    inputs: dict[str, InputRef]
    files: list[FileEntry]
    code_version: str
    started_at: str
    committed_at: str
    summary: dict = field(default_factory=dict)
    """Small stats for people and dashboards (counts, reward mean, loss, ...)."""
    io: dict | None = None
    """What the attempt moved through storage, measured (grpo.record.storage.IoCounts: bytes and seconds read,
    downloaded, hashed, written, uploaded; the manifest itself left out); None in a version 1 manifest."""
    manifest_version: int = MANIFEST_VERSION
    origin: InputRef | None = None
    """Set on an attempt that takes another run's committed attempt by reference (a fork, grpo.record.fork): the
    attempt first committed with these files, config and summary (through any chain of forks). Left out of
    the JSON when None, so every other manifest reads as it always did."""

    def to_json(self) -> bytes:
        raw = asdict(self)
        if raw["origin"] is None:
            del raw["origin"]
        return json.dumps(raw, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> "Manifest":
        try:
            raw = json.loads(data)
            version = raw.get("manifest_version")
            if version not in READABLE_VERSIONS:
                raise ValueError(f"manifest_version {version!r}, this code reads {READABLE_VERSIONS}")
            raw["files"] = [FileEntry(**f) for f in raw["files"]]
            raw["inputs"] = {k: InputRef(**v) for k, v in raw["inputs"].items()}
            if raw.get("origin") is not None:
                raw["origin"] = InputRef(**raw["origin"])
            return cls(**raw)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"{where}: not a valid manifest: {e}") from e

    def file(self, path: str) -> FileEntry:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(f"{self.stage} manifest has no file {path!r}; files: {[f.path for f in self.files]}")
