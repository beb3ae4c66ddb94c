"""Storage layer: commit protocol, refusal of uncommitted or corrupt stages, on file:// and S3."""

import json
import os
import time

import pandas as pd
import pytest

import grpo.record.digests
import grpo.record.storage
from grpo.record.commit import StageWriter
from grpo.record.counts import is_local
from grpo.record.storage import (
    CorruptArtifactError,
    NotCommittedError,
    find_committed,
    latest_committed,
    list_attempts,
    open_storage,
)
from schemas import MANIFEST_NAME, read_parquet, write_parquet

ROWS = {
    "run_id": ["r", "r"],
    "iteration": [0, 0],
    "prompt_id": [0, 1],
    "prompt": ["sort 2 1 :", "sort 1 3 :"],
    "ground_truth": ["1 2", "1 3"],
}


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def storage(request, tmp_path):
    if request.param == "file":
        return open_storage(tmp_path.as_uri())
    s3, mp = request.getfixturevalue("s3"), request.getfixturevalue("monkeypatch")
    for k, v in s3.env().items():  # botocore reads credentials at the first request
        mp.setenv(k, v)
    return open_storage(f"s3://{s3.bucket}/{tmp_path.name}")


def write_stage(storage, stage_dir, config=None, rows=ROWS):
    w = StageWriter(storage, stage_dir, run_id="r", iteration=0, stage="prompts", config=config or {"n": 2}, inputs={})
    write_parquet(storage.fs, w.path("prompts.parquet"), "prompts", rows)
    return w, w.commit(summary={"rows": len(rows["prompt_id"])})


def test_commit_round_trip(storage):
    stage_dir = storage.path("runs/r/iter-0000/prompts")
    w, committed = write_stage(storage, stage_dir)
    got = latest_committed(storage, stage_dir)
    assert got.manifest == committed.manifest
    assert got.manifest.summary == {"rows": 2}
    [entry] = got.manifest.files
    assert entry.path == "prompts.parquet" and entry.size > 0 and len(entry.sha256) == 64
    table = read_parquet(storage.fs, got.path("prompts.parquet"), "prompts")
    assert table.column("prompt").to_pylist() == ROWS["prompt"]
    # pandas reads the committed file directly by URI
    uri = storage.uri(got.path("prompts.parquet"))
    opts = dict(storage.fs.storage_options) if uri.startswith("s3://") else None
    assert pd.read_parquet(uri, storage_options=opts)["prompt_id"].tolist() == [0, 1]


def test_uncommitted_attempt_is_invisible(storage):
    stage_dir = storage.path("runs/r/iter-0000/prompts")
    with pytest.raises(NotCommittedError, match="no committed attempt"):
        latest_committed(storage, stage_dir)
    w, first = write_stage(storage, stage_dir)
    # a crashed writer: files written, manifest never
    crashed = StageWriter(storage, stage_dir, run_id="r", iteration=0, stage="prompts", config={"n": 3}, inputs={})
    write_parquet(storage.fs, crashed.path("prompts.parquet"), "prompts", ROWS)
    assert len(list_attempts(storage, stage_dir)) == 2
    assert latest_committed(storage, stage_dir).attempt_dir == first.attempt_dir


def test_missing_manifest_and_hash_mismatch_are_refused(storage):
    stage_dir = storage.path("runs/r/iter-0000/prompts")
    w, committed = write_stage(storage, stage_dir)
    fpath = committed.path("prompts.parquet")
    good = storage.read_bytes(fpath)
    storage.fs.pipe_file(fpath, good[:-1] + bytes([good[-1] ^ 1]))  # same size, one bit off
    with pytest.raises(CorruptArtifactError, match="sha256"):
        latest_committed(storage, stage_dir)
    storage.fs.pipe_file(fpath, good)
    latest_committed(storage, stage_dir)
    storage.fs.rm(f"{committed.attempt_dir}/{MANIFEST_NAME}")
    with pytest.raises(NotCommittedError, match=MANIFEST_NAME.replace(".", r"\.") + "|no committed"):
        latest_committed(storage, stage_dir)


def test_unchanged_files_are_not_reread_and_a_rewrite_is_caught(storage, monkeypatch):
    """A file this process hashed is not read again while its stamp holds (local: size, mtime,
    ctime, inode of a file written over a second ago; S3: the ETag); a same-size rewrite is."""
    stage_dir = storage.path("runs/r/iter-0000/prompts")
    _, committed = write_stage(storage, stage_dir)
    fpath = committed.path("prompts.parquet")
    if is_local(storage.fs):  # just written: its mtime could survive a rewrite in the same tick
        long_ago = time.time() - 10
        os.utime(fpath, (long_ago, long_ago))
    reads = []
    real = grpo.record.digests.sha256_file
    monkeypatch.setattr(grpo.record.digests, "sha256_file", lambda fs, path: reads.append(path) or real(fs, path))
    latest_committed(storage, stage_dir)
    reads.clear()
    latest_committed(storage, stage_dir)
    assert reads == []
    good = storage.read_bytes(fpath)
    storage.fs.pipe_file(fpath, good[:-1] + bytes([good[-1] ^ 1]))  # same size, one bit off
    with pytest.raises(CorruptArtifactError, match="sha256"):
        latest_committed(storage, stage_dir)
    assert reads == [fpath]


def test_corrupt_manifest_json_is_refused(storage):
    stage_dir = storage.path("runs/r/iter-0000/prompts")
    w, committed = write_stage(storage, stage_dir)
    storage.fs.pipe_file(f"{committed.attempt_dir}/{MANIFEST_NAME}", b"{not json")
    with pytest.raises(CorruptArtifactError, match="not a valid manifest"):
        latest_committed(storage, stage_dir)


def test_new_attempt_never_overwrites_and_identity_lookup(storage):
    stage_dir = storage.path("runs/r/iter-0000/prompts")
    w1, c1 = write_stage(storage, stage_dir, config={"n": 2})
    before = storage.read_bytes(c1.path("prompts.parquet"))
    w2, c2 = write_stage(storage, stage_dir, config={"n": 2})  # a forced rerun
    assert c2.attempt_dir != c1.attempt_dir and c2.manifest.identity == c1.manifest.identity
    assert storage.read_bytes(c1.path("prompts.parquet")) == before
    assert latest_committed(storage, stage_dir).attempt_dir == c2.attempt_dir
    w3, c3 = write_stage(storage, stage_dir, config={"n": 5})
    assert c3.manifest.identity != c1.manifest.identity
    assert find_committed(storage, stage_dir, c1.manifest.identity).attempt_dir == c2.attempt_dir
    assert find_committed(storage, stage_dir, "0" * 64) is None


def test_manifest_records_inputs_config_and_code(storage):
    stage_dir = storage.path("runs/r/iter-0000/prompts")
    _, upstream = write_stage(storage, stage_dir)
    w = StageWriter(
        storage,
        storage.path("runs/r/iter-0000/next"),
        run_id="r",
        iteration=0,
        stage="next",
        config={"a": 1},
        inputs={"prompts": upstream.ref()},
    )
    storage.fs.pipe_file(w.path("x.bin"), b"abc")
    c = w.commit()
    raw = json.loads(storage.read_bytes(f"{c.attempt_dir}/{MANIFEST_NAME}"))
    assert raw["inputs"]["prompts"] == {"uri": upstream.uri, "manifest_sha256": upstream.manifest_sha256}
    assert raw["config"] == {"a": 1} and len(raw["config_hash"]) == 64
    assert raw["code_version"] and raw["started_at"] <= raw["committed_at"]
    assert raw["files"][0]["sha256"] == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_referenced_file_is_verified(storage):
    _, upstream = write_stage(storage, storage.path("runs/r/iter-0000/prompts"))
    entry = upstream.manifest.file("prompts.parquet")
    from schemas import FileEntry

    w = StageWriter(
        storage, storage.path("runs/r/iter-0000/snap"), run_id="r", iteration=0, stage="snap", config={}, inputs={}
    )
    w.reference(
        "prompts.parquet",
        FileEntry(entry.path, entry.size, entry.sha256, uri=storage.uri(upstream.path("prompts.parquet"))),
    )
    w.commit()
    got = latest_committed(storage, storage.path("runs/r/iter-0000/snap"))
    assert got.path("prompts.parquet") == upstream.path("prompts.parquet")
    storage.fs.pipe_file(upstream.path("prompts.parquet"), b"tampered")
    with pytest.raises(CorruptArtifactError, match="size"):
        latest_committed(storage, storage.path("runs/r/iter-0000/snap"))
