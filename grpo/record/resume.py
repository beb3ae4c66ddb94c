"""The learner's resume state after learn k, committed apart from its policy: stage `state` of an iteration.

    <run>/iter-000k/state/attempt-*/   optimizer.pt (or dcp/ under fsdp2), rng.pt, (master.safetensors)

AdamW's moments and the float32 master weights are 12 of the 14 bytes a parameter that a learn of full
fine-tuning writes, and only the next learn built from files reads them. So learn k commits its policy first
(what snapshot k+1 and the rollouts read) and this process commits the state afterwards, in the background
(`commit_later`), every learn.state_every-th iteration. The learn that reads it (`read`) waits for a state
still being written (its attempt's heartbeat beats); where none is committed or coming (the writer was killed
between the two commits, or learn.state_every skipped it), stages.learn replays the updates since the last
committed state and checks each against its committed policy, so a resumed run commits the same bytes.
Which state a learn reads is fixed by its inputs: the commit's timing decides only when it may start.
Runs made before this kept the state inside the learn attempt: it is read from there.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path

import fsspec

from grpo.config import RunConfig
from grpo.errors import StageError
from grpo.record.checkpoint import cache_intact, download_verified, remember_copies
from grpo.record.commit import StageWriter
from grpo.record.counts import cache_root, count_io, counting_io, is_local
from grpo.record.digests import note_written
from grpo.record.fork import reference
from grpo.record.io import put_files
from grpo.record.layout import STATE_DCP, STATE_PREFIXES, STATE_STAGE, stage_dir
from grpo.record.lineage import note_committed
from grpo.record.liveness import running_attempts
from grpo.record.storage import Committed, Storage, collected_files, committed_attempts, list_attempts, load_manifest
from grpo.runtime import exits

log = logging.getLogger("grpo.stages")

STAGE = STATE_STAGE
POLL_S = 0.5  # between looks at a state another process is committing


def due(cfg: RunConfig, iteration: int) -> bool:
    """Whether learn `iteration` commits its state: every learn.state_every-th (iterations K-1, 2K-1, ...)."""
    return (iteration + 1) % cfg.learn.state_every == 0


def shards_later(cfg: RunConfig, iteration: int) -> bool:
    """Whether learn `iteration`'s ranks write their fsdp2 shards after its policy, into its state's attempt
    (Shards): under torchrun on one machine, where the state is due."""
    one_machine = cfg.learn.num_processes > 1 and cfg.learn.nodes == 1
    return one_machine and cfg.learn.sharding == "fsdp2" and due(cfg, iteration)


class Shards:
    """The state attempt of a learn whose fsdp2 ranks write their shards of the weights and AdamW state once its
    policy is written, while the learn commits it: opened before the ranks start, so that they write straight
    into it (local storage) or each upload its own shards to it, in parallel (object storage; the local copies
    in `held` stay in this machine's cache), and committed by `commit_later` once they have ended. The learn
    stage starts the ranks with `target` and hands them in (`hand_in`): anything with finish() (wait for their
    end, raising where one failed) and stop()."""

    def __init__(self, storage: Storage, config: dict, run_id: str, iteration: int, held: str):
        self.storage, self.held = storage, held
        self.writer = _writer(storage, config, run_id, iteration, inputs={})  # named at commit_later
        self.reports = tempfile.mkdtemp(prefix="grpo-shards-")  # each rank's uploads: sizes, hashes, seconds
        self.ready = f"{self.reports}/ready"  # rank 0 writes it once the policy is written
        self.ranks = None

    def target(self) -> dict:
        """Where the ranks put their shards: straight into the attempt (local storage: DCP writes dcp/ into it),
        else into `held` and from there each uploads its own; `digests`: where each reports what it uploaded."""
        if is_local(self.storage.fs):
            return {"dir": self.writer.attempt_dir, "digests": self.reports}
        return {
            "dir": self.held,
            "storage_url": self.storage.url,
            "to": self.writer.attempt_dir,
            "digests": self.reports,
        }

    def hand_in(self, ranks) -> None:
        self.ranks = ranks

    def finish(self) -> None:
        """Wait for the ranks to end (their failure raised); take in what they uploaded: the commit lists it by the
        hashes they made, and counts it as this attempt's upload."""
        self.ranks.finish()
        for report in sorted(Path(self.reports).glob("rank-*.json")):
            done = json.loads(report.read_text())
            for path, (size, digest) in done["files"].items():
                note_written(path, size, digest)
                count_io("hash", size, 0.0)  # hashed by the rank, on the way
            count_io("upload", sum(size for size, _ in done["files"].values()), done["seconds"])

    def close(self) -> None:
        """Stop the ranks where they still run; the attempt, uncommitted, is marked closed."""
        if self.ranks is not None:
            self.ranks.stop()
        self.writer.close()
        shutil.rmtree(self.reports, ignore_errors=True)


class Background:
    """This process's state commit running in a thread: at most one (the next waits for it). Its failure is kept
    for `wait`, which raises it in the stage that needs the state, or `settled`, which logs it."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.what = ""

    def start(self, storage: Storage, writer: StageWriter, held: str, shards: Shards | None) -> None:
        self.wait()
        self.what, self.error = f"state iteration {writer.iteration}", None
        self.thread = threading.Thread(target=self._run, args=(storage, writer, held, shards), name="grpo-state")
        self.thread.start()
        exits.before_thread_shutdown(settled)

    def _run(self, storage: Storage, writer: StageWriter, held: str, shards: Shards | None) -> None:
        try:
            _commit(storage, writer, held, shards)
        except BaseException as e:  # noqa: BLE001 (handed to wait(), which raises it in the stage that needs it)
            self.error = e
            log.error("%s: the background commit failed: %s: %s", self.what, type(e).__name__, e)

    def wait(self) -> None:
        thread, self.thread = self.thread, None
        if thread is None:
            return
        thread.join()
        if self.error is not None:
            e, self.error = self.error, None
            raise StageError(f"{self.what}: the background commit failed: {type(e).__name__}: {e}") from e


BACKGROUND = Background()
"""This process's background state commit (one at a time)."""


def commit_later(
    storage: Storage, config: dict, run_id: str, learned: Committed, held: str, shards: Shards | None = None
) -> None:
    """Commit the state files in the local folder `held` (which this takes over and removes) as learn
    `learned`'s state, in a thread of this process; its attempt and heartbeat exist before this returns, so
    another process reading the state waits for it. `config`: what its identity covers (the learn's).
    `shards`: the attempt the learn's ranks are writing their shards into; the thread waits for them first.
    The commit finishes before the interpreter's shutdown stops thread pools (grpo.runtime.exits)."""
    BACKGROUND.wait()
    k, inputs = learned.manifest.iteration, {"learn": learned.ref()}
    writer = shards.writer if shards else _writer(storage, config, run_id, k, inputs)
    writer.bind_inputs(inputs)
    BACKGROUND.start(storage, writer, held, shards)


def commit_now(storage: Storage, config: dict, run_id: str, learned: Committed, held: str) -> Committed:
    """Commit the state files in `held` (taken over and removed) as learn `learned`'s state, here and now."""
    inputs = {"learn": learned.ref()}
    return _commit(storage, _writer(storage, config, run_id, learned.manifest.iteration, inputs), held)


def wait() -> None:
    """Wait for this process's background state commit; its failure raised as a StageError (the state it
    would have committed is replayed by the learn that needs it)."""
    BACKGROUND.wait()


def settled() -> None:
    """`wait`, its failure logged, not raised: the learn that needs the state it would have committed finds none
    and replays it (a rank that died writing its shards, storage that failed the upload)."""
    try:
        wait()
    except StageError as e:
        log.warning("%s; the learn that reads it replays it", e)


def _writer(storage: Storage, config: dict, run_id: str, iteration: int, inputs: dict) -> StageWriter:
    return StageWriter(
        storage,
        stage_dir(storage, run_id, iteration, STAGE),
        run_id=run_id,
        iteration=iteration,
        stage=STAGE,
        config=config,
        inputs=inputs,
    )


def _commit(storage: Storage, writer: StageWriter, held: str, shards: Shards | None = None) -> Committed:
    """Move (local storage) or upload the files of `held` into the writer's attempt and commit it; on object
    storage `held` then stays in this machine's cache for the next learn here (the newest of the run's only).
    With `shards`, first wait for the ranks writing theirs (their dcp/ files are in the attempt then)."""
    try:
        with writer, counting_io() as io:
            if shards is not None:
                shards.finish()
            mine = [p for p in sorted(Path(held).rglob("*")) if p.is_file()]
            if shards is not None:  # the ranks put dcp/ in place (held keeps their local copies)
                mine = [p for p in mine if not p.relative_to(held).as_posix().startswith(f"{STATE_DCP}/")]
            if is_local(storage.fs):  # a rename where `held` is on the storage's disk, else a copy
                for f in mine:
                    shutil.move(str(f), writer.path(f.relative_to(held).as_posix()))
            else:
                put_files(storage.fs, [(str(f), writer.path(f.relative_to(held).as_posix())) for f in mine])
            committed = writer.commit(summary={}, io=io)
            note_committed(committed.attempt_dir)
        if not is_local(storage.fs):
            _keep(committed, held)
    finally:
        if shards is not None:
            shards.close()
        shutil.rmtree(held, ignore_errors=True)
    log.info("state iteration %s: committed %s", committed.manifest.iteration, committed.uri)
    return committed


def _cached(committed: Committed) -> Path:
    """Where this machine keeps a committed state it wrote: <GRPO_CACHE>/state/<run>-<iteration>-<manifest>."""
    m = committed.manifest
    return cache_root() / "state" / f"{m.run_id}-{m.iteration:04d}-{committed.manifest_sha256[:16]}"


def _keep(committed: Committed, held: str) -> None:
    """Take `held`, whose files `committed` lists as uploaded and hashed, into the cache, in place of the run's
    states kept before (the next learn reads the newest)."""
    target = _cached(committed)
    target.parent.mkdir(parents=True, exist_ok=True)
    for old in target.parent.glob(f"{committed.manifest.run_id}-*"):
        shutil.rmtree(old, ignore_errors=True)
    try:
        Path(held).rename(target)
    except OSError:  # another disk: the next learn downloads it
        return
    remember_copies(committed, target, prefix="", written=True)


def _kept(committed: Committed) -> str | None:
    """The cached copy of a committed state, where this machine wrote it and it is intact (its stamps known)."""
    target = _cached(committed)
    return str(target) if cache_intact(committed, target, prefix="") else None


def committed_state(storage: Storage, run_id: str, learned: Committed) -> Committed | None:
    """The newest committed state made after learn `learned` (an attempt whose input is that very commit)."""
    sdir = stage_dir(storage, run_id, learned.manifest.iteration, STAGE)
    ref = learned.ref()
    for attempt in reversed(committed_attempts(storage, sdir)):
        manifest, sha = load_manifest(storage, attempt, verify=False)
        if manifest.inputs.get("learn") == ref:  # what gc collected of it fails a read naming that
            return Committed(storage, attempt, manifest, sha, collected_files(storage, attempt, manifest))
    return None


def being_written(storage: Storage, run_id: str, learned: Committed) -> bool:
    """Whether a live writer (its heartbeat recent) is committing a state of iteration `learned`'s."""
    sdir = stage_dir(storage, run_id, learned.manifest.iteration, STAGE)
    attempts = {f"{sdir}/{a}" for a in list_attempts(storage, sdir)}
    return bool(attempts & {a.rstrip("/") for a in running_attempts(storage, run_id)})


def read(storage: Storage, run_id: str, learned: Committed, dest: str) -> str | None:
    """Learn `learned`'s state, downloaded and checked into the local folder `dest`: from the learn's own attempt
    (runs made before the split, and learn.nodes > 1) or its committed state, waiting for one being written;
    None where there is none to wait for (replay it)."""
    settled()
    inside = [f.path for f in learned.manifest.files if f.path.startswith(STATE_PREFIXES)]
    source = learned if inside else from_origin(storage, run_id, learned)
    while source is None:
        source = committed_state(storage, run_id, learned)
        if source is None and not being_written(storage, run_id, learned):
            source = committed_state(storage, run_id, learned)  # committed between the two looks?
            if source is None:
                return None
        if source is None:
            time.sleep(POLL_S)
    if not inside and (kept := _kept(source)):  # this machine committed it: no download, no hash
        return kept
    names = inside or [f.path for f in source.manifest.files]
    download_verified(source, {name: f"{dest}/{name}" for name in names})
    return dest


def from_origin(storage: Storage, run_id: str, learned: Committed) -> Committed | None:
    """A fork's learn taken by reference (grpo.record.fork): the state its origin's run committed after it, taken by
    reference as well (gc then keeps it for the fork); None otherwise."""
    if learned.manifest.origin is None or committed_state(storage, run_id, learned) is not None:
        return None
    path = fsspec.core.strip_protocol(learned.manifest.origin.uri).rstrip("/")
    manifest, sha = load_manifest(storage, path, verify=False)
    source = committed_state(storage, manifest.run_id, Committed(storage, path, manifest, sha))
    return None if source is None else reference(storage, run_id, source, {"learn": learned})
