"""Committing a stage's output: a new attempt, its files, and the manifest written last (StageWriter).

A writer always opens a fresh attempt folder, so committed files are never written over; the attempt is committed
once its `_manifest.json` exists, and that file is written last (a single object PUT on S3, a rename on a local
disk). The files are listed with the sha256 they were hashed with as they were written (grpo.record.digests), and
what the attempt moved is its manifest's `io` record (grpo.record.counts). From its creation to its commit the
attempt has a heartbeat (grpo.record.liveness).
"""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
import socket
import subprocess
import weakref
from pathlib import Path

from grpo.record.counts import IoCounts, count_io, is_local
from grpo.record.digests import file_digest, remember_digest, settle, written_digest
from grpo.record.identity import config_hash, stage_identity
from grpo.record.liveness import HEARTBEAT_NAME, Heartbeat, heartbeat_interval_s
from grpo.record.storage import (
    ArtifactError,
    AttemptRemovedError,
    Committed,
    Storage,
    attempt_number,
    list_attempts,
    now,
)
from schemas.manifest import MANIFEST_NAME, FileEntry, InputRef, Manifest


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("grpo-flow")
    except PackageNotFoundError:
        v = "0+unknown"
    here = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        sha = ""
    return f"{v}+g{sha}" if sha else v


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
        number = attempt_number(previous[-1]) + 1 if previous else 1
        self.attempt = f"attempt-{number:04d}-{secrets.token_hex(3)}"
        self.attempt_dir = f"{stage_dir}/{self.attempt}"
        if is_local(storage.fs):
            storage.fs.makedirs(self.attempt_dir, exist_ok=False)
        self.started_at = now()
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
            committed_at=now(),
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
