"""Whether an attempt's writer is alive: the heartbeat it keeps while it writes, and the readers that ask.

While a writer runs, its attempt holds a `.heartbeat` it rewrites every ~30 s (Heartbeat), so that anyone can tell
a live attempt from a dead one however long its stage writes nothing else: `grpo gc` (which leaves live attempts
and what they read alone), placement (a stage whose writer died fails the flow in one line), the learn waiting
for a state being committed (grpo.record.resume) and `grpo status`. Two clocks date a beat: the storage's (the
file's mtime, against `storage_clock`) and the writer's (`beat_at` in the file, against this machine's).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass

import fsspec

from grpo.record.counts import uncounted
from grpo.record.layout import run_dir
from grpo.record.storage import ArtifactError, Storage, load_manifest

log = logging.getLogger("grpo.record")
HEARTBEAT_NAME = ".heartbeat"  # in an attempt being written: refreshed while its writer lives, never in a manifest
LEASE_BEATS = 10  # a heartbeat is live for this many of its writer's beats at least, whatever min_age_s


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


@dataclass(frozen=True)
class Clock:
    storage: float  # now by the storage's clock: compare file mtimes with it
    local: float  # now by this machine's: compare times a writer put in a file with it


def mtime(info: dict) -> float | None:
    t = info.get("mtime") or info.get("LastModified") or info.get("created")
    return None if t is None else t.timestamp() if hasattr(t, "timestamp") else float(t)


def storage_clock(storage: Storage, folder: str) -> Clock:
    """Now by the storage's own clock, read as the mtime of a probe file written and removed at once
    (this machine's clock where the storage gives no time or refuses the write)."""
    local = time.time()
    probe = f"{folder}/.gc-clock.tmp-{secrets.token_hex(4)}"  # a leftover is a temporary file gc removes
    try:
        storage.fs.pipe_file(probe, b"")
        try:
            t = mtime(storage.fs.info(probe))
        finally:
            storage.fs.rm_file(probe)
    except OSError:
        t = None
    return Clock(storage=local if t is None else t, local=local)


def last_beat(storage: Storage, attempt: str, listing: dict, clock: Clock) -> tuple[float, dict] | None:
    """(seconds since the last beat, the heartbeat's JSON) of an uncommitted attempt; None when it has
    no heartbeat or its writer closed it (the stage failed)."""
    path = f"{attempt}/{HEARTBEAT_NAME}"
    if path not in listing:
        return None
    try:
        beat = json.loads(storage.read_bytes(path))
    except FileNotFoundError:  # committed or removed since the listing
        return None
    except ValueError:
        beat = {}
    if beat.get("closed_at") is not None:
        return None
    # Two clocks date a beat: the storage's (the file's mtime, against the storage's now) and the
    # writer's (beat_at in the file, against this machine's now). Either can be off: the storage's
    # where the probe could not read it, the writer's or this machine's when out of sync. Removing a
    # live attempt loses its work and fails its stage at commit; keeping a dead one costs its space
    # until a later gc. So the younger age wins: live when either clock says it beat recently.
    ages = [] if (t := mtime(listing[path])) is None else [clock.storage - t]
    if isinstance(beat.get("beat_at"), (int, float)):
        ages.append(clock.local - beat["beat_at"])
    return (min(ages) if ages else float("inf")), beat


def running_attempts(storage: Storage, run_id: str, beats: int = 3) -> set[str]:
    """The run's uncommitted attempts whose writer beat within its last `beats` intervals: running now,
    as far as anyone can tell (a writer killed without closing stops beating and drops out)."""
    rdir = run_dir(storage, run_id)
    listing = storage.fs.find(rdir, detail=True)
    paths = {p.rsplit("/", 1)[0] for p in listing if p.endswith("/" + HEARTBEAT_NAME)}
    if not paths:
        return set()
    clock = storage_clock(storage, rdir)
    live = {p: last_beat(storage, p, listing, clock) for p in paths}
    return {p for p, b in live.items() if b is not None and b[0] < beats * beat_interval(b[1])}


def lost_attempts(storage: Storage, folder: str) -> dict[str, float]:
    """{attempt: seconds since its writer's last beat} of the uncommitted attempts in stage folder `folder` whose
    writer stopped beating, neither committing nor closing them, LEASE_BEATS beats ago or more: a writer killed
    (SIGKILL, a machine lost) mid-stage, as gc judges it."""
    listing = storage.fs.find(folder, detail=True) if storage.exists(folder) else {}
    paths = sorted({p.rsplit("/", 1)[0] for p in listing if p.endswith("/" + HEARTBEAT_NAME)})
    clock = storage_clock(storage, folder) if paths else None
    beats = {p: last_beat(storage, p, listing, clock) for p in paths}
    return {p: b[0] for p, b in beats.items() if b is not None and b[0] >= LEASE_BEATS * beat_interval(b[1])}


def beat_interval(beat: dict) -> float:
    """Seconds between its writer's beats (30 where the heartbeat does not say)."""
    return float(beat["interval_s"]) if isinstance(beat.get("interval_s"), (int, float)) else 30.0


def read_by_live(storage: Storage, beats: dict[str, dict]) -> set[str]:
    """URIs that live attempts read: their inputs, and the files those reference (a snapshot's policy)."""
    uris = set()
    for beat in beats.values():
        for uri in (beat.get("inputs") or {}).values():
            uris.add(uri.rstrip("/"))
            try:
                manifest, _ = load_manifest(storage, fsspec.core.strip_protocol(uri).rstrip("/"), verify=False)
            except (ArtifactError, OSError):
                continue
            uris |= {f.uri for f in manifest.files if f.uri}
    return uris
