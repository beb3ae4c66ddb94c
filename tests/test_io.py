"""What stages move through storage, measured (the manifests' `io`), hashed once, and verified where read."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_stages import TINY, learned_path

import grpo.record.digests
import grpo.record.storage
import stages.learn
from flows.cli import main
from grpo.config import load_config
from grpo.query import query
from grpo.record import resume as state
from grpo.record.checkpoint import local_checkpoint
from grpo.record.commit import StageWriter
from grpo.record.counts import counting_io
from grpo.record.digests import rehashing
from grpo.record.layout import STAGES, STATE_PREFIXES, STATE_STAGE, stage_dir
from grpo.record.storage import committed_attempts, latest_committed, load_manifest, open_storage
from grpo.report import write_report
from schemas import MANIFEST_NAME
from stages import stage_function
from stages.init import init_run
from stages.iteration import run_iteration

ROOT = Path(__file__).resolve().parent.parent


def own_bytes(committed, prefix: str = "") -> int:
    """Bytes of the files an attempt holds itself (not referenced) under `prefix`."""
    return sum(f.size for f in committed.manifest.files if f.uri is None and f.path.startswith(prefix))


def newest(storage, k, stage):
    return latest_committed(storage, stage_dir(storage, "t", k, stage), verify=False)


@pytest.mark.s3
def test_a_tiny_runs_io_counts_match_the_files_it_moved(s3_env, s3_prefix, tmp_path, monkeypatch):
    """On S3 with an empty cache: the base uploads its checkpoint; a snapshot reads manifests and nothing else;
    rollouts download the policy, which the base's commit hashed, and hash only their own table as they write
    it; a learn uploads its policy, and the state commit after it the optimizer state, each hashed once on the
    way and never read back; `grpo query` shows the same counts."""
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    storage = open_storage(s3_prefix)
    base = init_run(storage, "t", load_config(None, TINY))
    run_iteration(storage, "t", 0)
    state.wait()  # the state commit after the learn's
    c = {stage: newest(storage, 0, stage) for stage in (*STAGES, STATE_STAGE)}
    policy = own_bytes(base, "policy/")
    assert policy > 100_000 and base.manifest.io["upload_bytes"] == policy == own_bytes(base)
    assert base.manifest.io["hash_bytes"] == policy + base.manifest.io["write_bytes"]  # + the small files it wrote

    snap = c["snapshot"].manifest.io
    manifests = [
        f"{a}/_manifest.json"
        for s in ["base", *STAGES]
        for a in committed_attempts(storage, stage_dir(storage, "t", None if s == "base" else 0, s))
    ]
    run_json = storage.fs.size(storage.path("runs/t/run.json"))
    assert 0 < snap["read_bytes"] <= sum(storage.fs.size(m) for m in manifests) + run_json
    assert snap["download_bytes"] == snap["hash_bytes"] == snap["write_bytes"] == snap["upload_bytes"] == 0

    ro = c["rollouts"].manifest.io
    assert ro["download_bytes"] == policy  # the base's policy/, into the empty cache
    assert ro["hash_bytes"] == ro["write_bytes"] == own_bytes(c["rollouts"])  # its table, as written
    assert ro["upload_bytes"] == 0

    learn = c["learn"].manifest.io
    written = own_bytes(c["learn"])
    assert written > policy and learn["upload_bytes"] == written and learn["hash_bytes"] == written
    assert learn["read_bytes"] < 0.2 * policy  # tables and manifests; its upload is never read back
    assert learn["download_bytes"] == 0  # the snapshot and the reference are the base, cached already
    assert not any(f.path.startswith(STATE_PREFIXES) for f in c["learn"].manifest.files)  # off the critical path
    held = c[STATE_STAGE].manifest.io
    assert held["upload_bytes"] == held["hash_bytes"] == own_bytes(c[STATE_STAGE]) > policy  # AdamW: 2x the policy
    assert held["download_bytes"] == 0 and held["read_bytes"] < 0.2 * policy
    for a in ("learn", STATE_STAGE):  # uploaded in parallel, each under its own name: hashed from storage here
        for f in c[a].manifest.files:
            assert hashlib.sha256(storage.read_bytes(c[a].path(f.path))).hexdigest() == f.sha256, f.path

    ev = c["eval"].manifest.io
    assert ev["download_bytes"] == 0  # the learn left its policy in this machine's cache (checkpoint.keep_written)
    assert ev["hash_bytes"] == own_bytes(c["eval"])  # the policy was hashed as the learn uploaded it

    seen = query(storage, "t", "SELECT stage, upload_bytes, download_bytes FROM io WHERE iteration = 0")
    assert dict(zip(seen["stage"], seen["upload_bytes"])) == {s: c[s].manifest.io["upload_bytes"] for s in c}
    assert dict(zip(seen["stage"], seen["download_bytes"])) == {s: c[s].manifest.io["download_bytes"] for s in c}
    write_report(storage, "t")  # a panel of bytes per stage per iteration beside the progress plots
    assert storage.read_bytes(storage.path("runs/t/io.png")).startswith(b"\x89PNG")
    assert "(io.png)" in storage.read_bytes(storage.path("runs/t/report.md")).decode()
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "another-machine"))
    ev = stage_function("eval")(storage, "t", 0, force=True).manifest.io
    assert ev["download_bytes"] == own_bytes(c["learn"], "policy/")  # the new policy, not the optimizer state


def hashed_in_a_new_process(url: str, stage: str, iteration: int, env: dict) -> int:
    """Bytes a fresh process hashes to verify every file of a committed stage and get its policy folder."""
    code = f"""
from grpo.record.checkpoint import local_checkpoint
from grpo.record.layout import stage_dir
from grpo.record.storage import latest_committed, open_storage
from grpo.record.counts import counting_io
storage = open_storage({url!r})
with counting_io() as io:
    c = latest_committed(storage, stage_dir(storage, "t", {iteration!r}, {stage!r}))
    local_checkpoint(c)
print(io.hash_bytes)
"""
    env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize("where", ["file", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_second_read_of_an_unchanged_file_hashes_nothing_in_any_process(where, request, tmp_path):
    """A file verified once on this machine is not hashed again while its stamp holds, in another process
    too (the stamp cache under GRPO_CACHE); a same-size edit is hashed again, and refused."""
    env = {"GRPO_CACHE": str(tmp_path / "cache")}
    if where == "s3":
        s3 = request.getfixturevalue("s3")
        env.update(s3.env())
        url = request.getfixturevalue("s3_prefix")
    else:
        url = (tmp_path / "store").as_uri()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        storage = open_storage(url)
        base = init_run(storage, "t", load_config(None, TINY))
        grpo.record.digests._HASHED.clear()  # as a new process: only the stamp cache knows what was hashed
        with counting_io() as io:
            latest_committed(storage, stage_dir(storage, "t", None, "base"))
            local_checkpoint(base)
        assert io.hash_bytes == 0  # the commit hashed them as it wrote them
        assert hashed_in_a_new_process(url, "base", None, env) == 0
        weights = base.path("policy/model.safetensors")
        good = storage.read_bytes(weights)
        storage.fs.pipe_file(weights, good[:-1] + bytes([good[-1] ^ 1]))  # same size, one bit off
        with pytest.raises(subprocess.CalledProcessError) as e:
            hashed_in_a_new_process(url, "base", None, env)
        assert "sha256" in e.value.stderr and "changed after its commit" in e.value.stderr
        storage.fs.pipe_file(weights, good)
        assert hashed_in_a_new_process(url, "base", None, env) == base.manifest.file("policy/model.safetensors").size
        assert hashed_in_a_new_process(url, "base", None, env) == 0
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def flip_last_byte(path: Path) -> None:
    good = path.read_bytes()
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # same size, one bit off


def test_a_changed_committed_byte_fails_every_stage_that_reads_it_in_one_line(tmp_path, capsys, monkeypatch):
    """One bit flipped in a committed file (same size): each stage that reads the file fails in one line naming
    it, and a stage that does not read it runs (a snapshot reads manifests only; eval never the optimizer)."""
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    storage = open_storage((tmp_path / "store").as_uri())
    init_run(storage, "t", load_config(None, TINY))
    run_iteration(storage, "t", 0)
    url = storage.uri(storage.path())

    def stage(name: str, k: int, force: bool = True) -> tuple[int, str]:
        """The exit code and what the command wrote to stderr, less progress bars (lines that rewrite themselves)."""
        capsys.readouterr()
        code = main(["--storage", url, "stage", name, "--run", "t", "--iteration", str(k), *["--force"] * force])
        err = capsys.readouterr().err.splitlines()
        return code, "".join(line + "\n" for line in err if line and not line.startswith("\r"))

    learn0 = Path(newest(storage, 0, "learn").attempt_dir)
    flip_last_byte(Path(learned_path(newest(storage, 0, "learn"), "optimizer.pt")))
    assert stage("eval", 0) == (0, "")  # eval reads the policy, not the optimizer state
    for name in ["snapshot", "rollouts", "rewards", "advantages"]:
        assert stage(name, 1, force=False) == (0, ""), name
    stages.learn.WARM.take(None)  # a learner in a new process: it reads the optimizer state
    code, err = stage("learn", 1, force=False)
    assert code == 2 and err.count("\n") == 1 and "optimizer.pt" in err and "sha256" in err, err

    table = Path(newest(storage, 1, "rollouts").attempt_dir) / "rollouts.parquet"
    flip_last_byte(table)
    for name in ["rewards", "learn"]:
        code, err = stage(name, 1)
        assert code == 2 and err.count("\n") == 1 and "rollouts.parquet" in err, (name, err)

    weights = next(learn0.glob("policy/*.safetensors"))
    flip_last_byte(weights)
    for name, k in [("eval", 0), ("rollouts", 1)]:
        code, err = stage(name, k)
        assert code == 2 and err.count("\n") == 1, (name, err)
        assert weights.name in err and "changed after its commit" in err, (name, err)
    assert stage("snapshot", 1) == (0, "")  # manifests only: the new snapshot references the same files


def test_status_verify_hashes_again_what_this_machine_hashed_before(tmp_path, monkeypatch):
    """`grpo status --verify` (storage.rehashing) hashes every file, even one the stamp cache vouches for."""
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    storage = open_storage((tmp_path / "store").as_uri())
    w = StageWriter(storage, storage.path("s"), run_id="r", iteration=0, stage="s", config={}, inputs={})
    storage.fs.pipe_file(w.path("x.bin"), b"abc" * 1000)
    c = w.commit()
    hashed = []
    real = grpo.record.digests.sha256_file
    monkeypatch.setattr(grpo.record.digests, "sha256_file", lambda fs, p: hashed.append(p) or real(fs, p))
    load_manifest(storage, c.attempt_dir, verify=True)
    assert hashed == []  # hashed as it was written
    with rehashing():
        load_manifest(storage, c.attempt_dir, verify=True)
    assert hashed == [c.path("x.bin")]


@pytest.mark.s3
def test_a_lora_run_hashes_the_base_once_per_machine(s3_env, s3_prefix, tmp_path, monkeypatch):
    """LoRA on S3, each stage as if in a new process on the same machine (nothing hashed in memory, the learner
    not kept warm): the base's weights, hashed by the commit that uploaded them, are never hashed again."""
    from stages import stage_function

    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    storage = open_storage(s3_prefix)
    base = init_run(storage, "t", load_config(None, TINY + ["learn.lora={r: 2, alpha: 4}"]))
    weights = own_bytes(base, "policy/")
    assert base.manifest.io["hash_bytes"] >= weights
    for k in range(2):
        for name in STAGES:
            grpo.record.digests._HASHED.clear()
            stages.learn.WARM.take(None)
            c = stage_function(name)(storage, "t", k)
            assert c.manifest.io["hash_bytes"] < weights, (k, name, c.manifest.io)
            assert c.manifest.io["download_bytes"] < weights or (k, name) == (0, "rollouts"), (k, name)


def test_a_manifest_of_version_1_reads_with_no_io_record(tmp_path):
    """Manifests written before the io record (version 1) still read; their io is None, null in the io view."""
    storage = open_storage((tmp_path / "store").as_uri())
    with counting_io() as io:
        w = StageWriter(storage, storage.path("s"), run_id="r", iteration=0, stage="s", config={}, inputs={})
        storage.fs.pipe_file(w.path("x.bin"), b"abc")
        c = w.commit(io=io)
    assert c.manifest.manifest_version == 2 and c.manifest.io["write_bytes"] == 3
    path = f"{c.attempt_dir}/{MANIFEST_NAME}"
    raw = json.loads(storage.read_bytes(path))
    del raw["io"]
    raw["manifest_version"] = 1
    storage.fs.pipe_file(path, json.dumps(raw).encode())
    old, _ = load_manifest(storage, c.attempt_dir)
    assert old.io is None and old.manifest_version == 1 and old.files == c.manifest.files
    raw["manifest_version"] = 3
    storage.fs.pipe_file(path, json.dumps(raw).encode())
    with pytest.raises(grpo.record.storage.CorruptArtifactError, match="manifest_version 3"):
        load_manifest(storage, c.attempt_dir)


def test_a_file_written_out_of_order_is_hashed_at_the_commit(tmp_path):
    """A write after a seek back gives up the hash taken on the way: the commit hashes the file as it is."""
    storage = open_storage((tmp_path / "store").as_uri())
    w = StageWriter(storage, storage.path("s"), run_id="r", iteration=0, stage="s", config={}, inputs={})
    with storage.fs.open(w.path("x.bin"), "wb") as f:  # as many bytes sent as the file holds: 7
        f.write(b"aaaa")
        f.seek(6)
        f.write(b"c")
        f.seek(0)
        f.write(b"xx")
    c = w.commit()
    assert c.manifest.file("x.bin").sha256 == hashlib.sha256(b"xxaa\0\0c").hexdigest()
