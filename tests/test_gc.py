"""`grpo gc` and live attempts: a writer's heartbeat keeps its attempt, however quiet the stage and
whatever the clocks say; a dead one goes; a commit whose attempt was removed fails in one line."""

import json
import os
import time

import pytest

from flows.cli import main
from grpo.config import RetentionConfig, load_config
from grpo.gc import held_summary, plan, remove
from grpo.record.commit import StageWriter
from grpo.record.counts import is_local
from grpo.record.layout import stage_dir
from grpo.record.liveness import HEARTBEAT_NAME, lost_attempts
from grpo.record.storage import AttemptRemovedError, is_committed, list_attempts, open_storage, read_collected
from stages.common import run_stage
from stages.init import write_run_json

HOUR = 3600.0


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def storage(request, tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_HEARTBEAT_S", "0.1")
    if request.param == "file":
        storage = open_storage((tmp_path / "store").as_uri())
    else:
        for k, v in request.getfixturevalue("s3").env().items():
            monkeypatch.setenv(k, v)
        storage = open_storage(f"s3://{request.getfixturevalue('s3').bucket}/gc-{tmp_path.name}")
    write_run_json(storage, "t", load_config(None, []))
    return storage


def writer(storage, stage="snapshot", inputs=None, config=None):
    return StageWriter(
        storage,
        stage_dir(storage, "t", 0, stage),
        run_id="t",
        iteration=0,
        stage=stage,
        config=config or {},
        inputs=inputs or {},
    )


def beat(storage, w) -> dict:
    return json.loads(storage.read_bytes(f"{w.attempt_dir}/{HEARTBEAT_NAME}"))


def files_under(storage, folder: str) -> list[str]:
    """Files in a folder (an S3 server may keep the emptied folder itself: SeaweedFS does)."""
    return [p for p in storage.fs.find(folder) if p.startswith(folder + "/")]


def gc(storage, capsys, *args) -> str:
    capsys.readouterr()
    assert main(["--storage", storage.url, "gc", "--run", "t", *args]) == 0
    return capsys.readouterr().out


def test_the_heartbeat_beats_until_the_commit_and_stays_out_of_the_manifest(storage):
    w = writer(storage, stage="rollouts")
    first = beat(storage, w)
    assert first["stage"] == "rollouts" and first["pid"] == os.getpid()
    deadline = time.monotonic() + 10
    while beat(storage, w)["beat_at"] == first["beat_at"]:  # the thread rewrites it
        assert time.monotonic() < deadline, "no beat in 10 s"
        time.sleep(0.05)
    storage.fs.pipe_file(w.path("rows.bin"), b"rows")
    committed = w.commit()
    assert [f.path for f in committed.manifest.files] == ["rows.bin"]
    time.sleep(0.3)  # no beat after the commit brings it back
    assert not storage.exists(f"{w.attempt_dir}/{HEARTBEAT_NAME}")


def test_a_quiet_live_attempt_is_left_alone_and_said_so(storage, capsys):
    """Its files are older than --older-than-s (a learn writes nothing until its checkpoint), its
    heartbeat is fresh: gc --delete leaves it, says so, and the stage commits."""
    w = writer(storage)
    storage.fs.pipe_file(w.path("weights.bin"), b"w" * 100)
    if is_local(storage.fs):  # written an hour ago
        old = time.time() - 2 * HOUR
        os.utime(w.path("weights.bin"), (old, old))
        args = []
    else:  # S3 keeps its own times: wait past a short limit instead
        time.sleep(3)
        args = ["--older-than-s", "2"]
    out = gc(storage, capsys, "--delete", *args)
    assert "held back: 1 live attempt (recent heartbeat) left alone" in out
    assert w.attempt in out and "snapshot on" in out and "removed 0 item(s)" in out
    assert is_committed(storage, w.commit().attempt_dir)


def test_a_dead_attempt_goes(storage, capsys):
    """A writer killed mid-stage leaves a heartbeat that nobody refreshes: once older than the limit,
    the attempt is removed, and one closed after a failure too."""
    crashed, failed = writer(storage), writer(storage, stage="rollouts")
    crashed._heartbeat.stop()  # as if killed: the last beat stays
    failed.close()  # as run_stage does when the stage fails: marked closed
    assert "closed_at" in beat(storage, failed)
    out = gc(storage, capsys)
    assert "held back: 1 live attempt (recent heartbeat) left alone; 1 attempt newer than 1 h left alone" in out
    time.sleep(2.5)
    out = gc(storage, capsys, "--delete", "--older-than-s", "2")
    assert out.count("failed") == 2 and "held back" not in out and "removed 2 item(s)" in out
    assert not files_under(storage, crashed.attempt_dir) and not files_under(storage, failed.attempt_dir)
    assert "0 item(s)" in gc(storage, capsys, "--older-than-s", "0")  # nothing left to remove


def test_lost_attempts_are_the_uncommitted_ones_whose_writer_stopped_beating(storage, monkeypatch):
    """What the flow asks of a placed stage it waits for (flows/placement.py Watch): an attempt whose writer was killed
    is lost once it missed LEASE_BEATS beats (1 s at 0.1 s a beat); a live, a failed (closed) or a committed one
    never is."""
    crashed, failed, done = (writer(storage, stage="learn") for _ in range(3))
    monkeypatch.setenv("GRPO_HEARTBEAT_S", "1")  # a live writer beating slower: 10 s of lease, however loaded
    live = writer(storage, stage="learn")
    crashed._heartbeat.stop()  # as if killed: the last beat stays
    failed.close()
    done.commit()
    folder = stage_dir(storage, "t", 0, "learn")
    assert lost_attempts(storage, folder) == {}  # beat a moment ago
    deadline = time.monotonic() + 30
    while not lost_attempts(storage, folder):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert list(lost_attempts(storage, folder)) == [crashed.attempt_dir] and list_attempts(storage, folder)
    live.close()


def test_either_clock_behind_does_not_make_a_live_attempt_look_dead(tmp_path):
    """The heartbeat carries the writer's clock (beat_at) and the storage dates it (mtime): a live
    attempt is one that either says beat recently."""
    storage = open_storage((tmp_path / "store").as_uri())
    attempt = stage_dir(storage, "t", 0, "snapshot") + "/attempt-0001-aaaaaa"
    path = f"{attempt}/{HEARTBEAT_NAME}"
    storage.fs.makedirs(attempt)
    now, old = time.time(), time.time() - 2 * HOUR

    def state(beat_at: float, mtime: float) -> str:
        storage.fs.pipe_file(path, json.dumps({"beat_at": beat_at, "stage": "snapshot"}).encode())
        os.utime(path, (mtime, mtime))
        found = plan(storage, "t")
        assert [g.path for g in found.garbage] in ([], [attempt])
        return "dead" if found.garbage else found.held[0].group.split()[0]

    assert state(beat_at=now, mtime=old) == "live"  # the storage's clock runs 2 h behind
    assert state(beat_at=old, mtime=now) == "live"  # the writer's clock runs 2 h behind
    assert state(beat_at=old, mtime=old) == "dead"


def test_a_commit_after_the_attempt_was_removed_fails_in_one_line(storage):
    w = writer(storage)
    storage.fs.pipe_file(w.path("part.bin"), b"half")
    storage.fs.rm(w.attempt_dir, recursive=True)  # what a gc that took it for dead does
    time.sleep(0.5)  # several beats: none brings the attempt back
    assert not storage.exists(f"{w.attempt_dir}/{HEARTBEAT_NAME}")
    with pytest.raises(AttemptRemovedError) as e:
        w.commit()
    assert "\n" not in str(e.value) and w.attempt in str(e.value) and "removed before its commit" in str(e.value)
    assert not is_committed(storage, w.attempt_dir)

    def body(writer):  # through run_stage, the way every stage commits
        storage.fs.rm(writer.attempt_dir, recursive=True)
        return {}

    with pytest.raises(AttemptRemovedError, match="run the rollouts stage again"):
        run_stage(storage, "t", 0, "rollouts", config={}, inputs={}, body=body)


def test_a_failed_stage_marks_its_attempt_closed(storage):
    def body(writer):
        raise ValueError("the stage broke")

    with pytest.raises(ValueError):
        run_stage(storage, "t", 0, "snapshot", config={}, inputs={}, body=body)
    [name] = list_attempts(storage, stage_dir(storage, "t", 0, "snapshot"))
    found = plan(storage, "t")
    assert [h.group for h in found.held] == ["attempt{s} newer than 1 h"]  # not live: failed, recent


def test_superseded_attempts_wait_and_what_a_live_attempt_reads_stays(storage, capsys):
    old = writer(storage, config={"v": 1}).commit()
    new = writer(storage, config={"v": 2}).commit()
    out = gc(storage, capsys, "--delete")
    assert "held back: 1 attempt superseded less than 1 h ago left alone" in out and old.manifest.attempt in out
    reader = writer(storage, stage="rollouts", inputs={"snapshot": old.ref()})  # read before the rerun
    out = gc(storage, capsys, "--delete", "--older-than-s", "0")
    assert "1 superseded attempt read by a live attempt left alone" in out and is_committed(storage, old.attempt_dir)
    reader.close()
    out = gc(storage, capsys, "--delete", "--older-than-s", "0")
    assert "superseded" in out and not files_under(storage, old.attempt_dir) and is_committed(storage, new.attempt_dir)


def test_retention_leaves_what_a_live_attempt_reads(storage):
    """A rerun of learn 1 that is running reads learn 0's optimizer state: gc --retention keeps it."""

    def commit(k, stage, files=(), inputs=None):
        w = StageWriter(
            storage,
            stage_dir(storage, "t", k, stage),
            run_id="t",
            iteration=k,
            stage=stage,
            config={},
            inputs=inputs or {},
        )
        for name in files:
            storage.fs.pipe_file(w.path(name), name.encode())
        return w if inputs else w.commit()

    learns = []
    for k in range(3):
        commit(k, "snapshot")
        learns.append(commit(k, "learn", ["policy/model.safetensors", "optimizer.pt", "rng.pt", "metrics.parquet"]))
    rerun = commit(1, "learn", inputs={"previous": learns[0].ref()})  # uncommitted: running
    found = plan(storage, "t", retention=RetentionConfig(keep_last=1))
    assert {(g.path, g.why) for g in found.garbage} == {
        (learns[1].attempt_dir, "state"),
        (learns[1].attempt_dir, "policy"),
    }
    assert "1 learn read by a live attempt left alone" in held_summary(found.held)
    rerun.close()
    found = plan(storage, "t", retention=RetentionConfig(keep_last=1))
    assert {g.path for g in found.garbage} == {learns[0].attempt_dir, learns[1].attempt_dir}
    remove(storage, found.garbage)
    assert set(read_collected(storage, learns[0].attempt_dir)) == {"policy/model.safetensors", "optimizer.pt", "rng.pt"}
    assert files_under(storage, learns[0].attempt_dir) == sorted(
        f"{learns[0].attempt_dir}/{name}" for name in ("_manifest.json", "collected.json", "metrics.parquet")
    )
