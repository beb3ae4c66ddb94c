"""The run record under a copy, a fork, a verify and a kill (issue 44, D5-D7, D11 and the record's minor cases): a
run copied or moved is whole where it lands, and old manifests still read."""

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_stages import make_run

from flows.cli import main
from grpo.learner.warm import WARM
from grpo.record import resume as state
from grpo.record.layout import run_dir, stage_dir
from grpo.record.storage import latest_committed, load_manifest, open_storage
from stages import stage_function
from stages.iteration import run_warm

ROOT = Path(__file__).resolve().parents[1]


def cli(storage, capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["--storage", storage.url, *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def two_iterations(tmp_path, monkeypatch):
    """Storage `a` holding run r, two iterations in."""
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    storage = open_storage((tmp_path / "a").as_uri())
    make_run(storage, "r")
    for _ in run_warm(storage, "r", 0, 2):
        pass
    return storage


def as_version_2(storage, run_id: str) -> None:
    """Rewrite a run's manifests as the code before version 3 wrote them: every URI absolute. Each manifest's
    sha256 changes, and with it the pin of every manifest that reads it (rewritten in commit order)."""
    paths = [p for p in storage.fs.find(run_dir(storage, run_id)) if p.endswith("/_manifest.json")]
    now = {}  # a manifest's sha256 before -> after
    for path in sorted(paths, key=lambda p: json.loads(storage.read_bytes(p))["committed_at"]):
        manifest, sha = load_manifest(storage, path.rsplit("/", 1)[0], verify=False)  # absolute in memory
        pins = {k: dataclasses.replace(r, manifest_sha256=now.get(r.manifest_sha256, r.manifest_sha256))
                for k, r in manifest.inputs.items()}  # fmt: skip
        data = dataclasses.replace(manifest, inputs=pins, manifest_version=2).to_json()
        assert b'"uri": "file:///' in data or not pins
        storage.fs.pipe_file(path, data)
        now[sha] = hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("written", ["now", "version 2"])
def test_a_copied_run_is_whole_where_it_lands_and_the_original_may_go(two_iterations, tmp_path, capsys, written):
    """cp -a of the storage, the original moved away: the copy verifies, a stage forced in it makes its own later
    stages stale (not the original's), and it trains on. Before, every manifest named its inputs and referenced
    files by absolute URIs: the copy checked staleness against the original, and failed once it moved. A run
    written before (version 2: absolute URIs) still reads where it is."""
    if written == "version 2":
        as_version_2(two_iterations, "r")
        rc, out, err = cli(two_iterations, capsys, "status", "--run", "r", "--verify")
        assert rc == 0 and "corrupt x" not in out and "stale x" not in out, out + err
        WARM.take(None)
        assert cli(two_iterations, capsys, "run", "--run", "r")[0] == 0  # an old run trains on
        return
    shutil.copytree(tmp_path / "a", tmp_path / "b", symlinks=True)
    (tmp_path / "a").rename(tmp_path / "moved")
    copy = open_storage((tmp_path / "b").as_uri())
    rc, out, err = cli(copy, capsys, "status", "--run", "r", "--verify")
    assert rc == 0 and "corrupt x" not in out and "stale x" not in out, out + err
    rc, _, err = cli(copy, capsys, "stage", "rewards", "--run", "r", "--iteration", "1", "--force")
    assert rc == 0, err
    rc, out, _ = cli(copy, capsys, "status", "--run", "r")
    assert rc == 0 and "stale x" in out  # iteration 1's advantages, learn and eval read the replaced rewards
    WARM.take(None)  # a new process
    rc, _, err = cli(copy, capsys, "run", "--run", "r", "--start", "1")
    assert rc == 0, err
    assert not (tmp_path / "a").exists()  # nothing written where the original was


def test_a_fork_whose_resume_state_was_collected_is_refused_naming_a_fork_that_works(tmp_path, capsys, monkeypatch):
    """retention.keep_every=1 keeps every policy and the newest learn's optimizer state only: a fork at 2 continues
    from learn 1's state, gone. It was accepted, and its first learn then failed every time with "listed in the
    manifest but missing"; now refused before anything is written, naming the fork point that works."""
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    storage = open_storage((tmp_path / "s").as_uri())
    make_run(storage, "p", extra=["retention.keep_every=1"])
    for _ in run_warm(storage, "p", 0, 3):
        pass
    assert cli(storage, capsys, "gc", "--run", "p", "--retention", "--delete")[0] == 0
    rc, _, err = cli(storage, capsys, "fork", "--from", "p", "--at", "2", "--run", "f", "--set", "learn.lr=1e-3")
    assert rc == 2 and err.count("\n") == 1, err
    assert "learn 2 continues from run p's optimizer state after learn 1" in err and "optimizer.pt" in err
    assert "nothing written" in err and "`grpo fork --from p --at 3`" in err
    assert not storage.exists(run_dir(storage, "f"))
    rc, _, err = cli(storage, capsys, "fork", "--from", "p", "--at", "3", "--run", "f", "--set", "learn.lr=1e-3")
    assert rc == 0, err
    WARM.take(None)
    assert cli(storage, capsys, "run", "--run", "f", "--iterations", "1")[0] == 0  # the fork point it named works


def test_verify_rehashes_the_resume_state_and_the_command_it_names_remakes_it(two_iterations, capsys):
    """A byte of learn 1's optimizer state flipped (a disk's rot, a bad copy): `status --verify` said rc 0, and
    `grpo run` then advised `grpo stage state ... --force`, which the CLI rejected. Now --verify names it and the
    command, which replays learn 1's update into a new state attempt, and the run goes on to the bytes of a run
    whose state was never damaged."""
    storage = two_iterations
    make_run(storage, "twin")
    for _ in run_warm(storage, "twin", 0, 3):
        pass
    held = state.committed_state(storage, "r", latest_committed(storage, stage_dir(storage, "r", 1, "learn")))
    path = held.attempt_dir + "/optimizer.pt"
    data = bytearray(storage.read_bytes(path))
    data[len(data) // 2] ^= 0xFF
    storage.fs.pipe_file(path, bytes(data))
    rc, out, err = cli(storage, capsys, "status", "--run", "r", "--verify")
    assert rc == 2 and "iteration 1 state: corrupt" in out, out + err
    command = "grpo stage state --run r --iteration 1 --force"
    assert err.count("\n") == 1 and command in err, err
    WARM.take(None)  # a new process: learn 2 reads the state
    rc, _, err = cli(storage, capsys, "run", "--run", "r")
    assert rc == 2 and err.count("\n") == 1 and command in err and "optimizer.pt" in err, err
    rc, out, err = cli(storage, capsys, *command.split()[1:])
    assert rc == 0 and "state iteration 1: committed" in out, err
    assert cli(storage, capsys, "status", "--run", "r", "--verify")[0] == 0
    WARM.take(None)
    assert cli(storage, capsys, "run", "--run", "r")[0] == 0
    policy = [latest_committed(storage, stage_dir(storage, r, 2, "learn")).manifest.file("policy/model.safetensors")
              for r in ("r", "twin")]  # fmt: skip
    assert policy[0].sha256 == policy[1].sha256


def killed_after(references: int, storage, capsys, monkeypatch, *fork: str) -> None:
    """`grpo fork` with the arguments `fork`, its process killed (a KeyboardInterrupt, as SIGINT) as it takes its
    parent's attempts by reference, once it has taken `references` of them (before its run.json)."""
    import grpo.record.fork

    real, made = grpo.record.fork.reference, []

    def killed_midway(*args):
        if len(made) == references:
            raise KeyboardInterrupt  # the process killed mid-fork
        made.append(real(*args))
        return made[-1]

    monkeypatch.setattr(grpo.record.fork, "reference", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        cli(storage, capsys, *fork)
    monkeypatch.setattr(grpo.record.fork, "reference", real)


def test_a_fork_killed_before_its_run_json_is_seen_kept_for_and_finished_or_removed(tmp_path, capsys, monkeypatch):
    """A fork killed while it takes its parent's attempts by reference (before its run.json): the parent's gc
    keeps what it references and says how to go on, `grpo fork` again finishes it, `grpo delete` removes one. It
    was invisible to both: gc removed what it referenced, and delete said "no such run"."""
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    storage = open_storage((tmp_path / "s").as_uri())
    make_run(storage, "p")
    for _ in run_warm(storage, "p", 0, 2):
        pass
    fork = ["fork", "--from", "p", "--at", "2", "--set", "learn.lr=1e-3", "--run"]
    for run_id in ("f", "g"):
        killed_after(8, storage, capsys, monkeypatch, *fork, run_id)  # iteration 0 taken, 1 not yet
    assert not storage.exists(f"{run_dir(storage, 'f')}/run.json") and storage.exists(run_dir(storage, "f"))
    rc, _, err = cli(storage, capsys, "stage", "eval", "--run", "p", "--iteration", "0", "--force")
    assert rc == 0, err  # p's eval 0, which f and g reference, superseded
    rc, out, _ = cli(storage, capsys, "gc", "--run", "p", "--delete", "--older-than-s", "0")
    assert rc == 0 and "superseded" not in out.split("held back")[0].replace("superseded attempt", ""), out
    assert "run f: a fork of p at 2 killed while it was made: `grpo fork` with the same arguments finishes it" in out
    assert "`grpo delete --run g --yes` removes it" in out
    rc, _, err = cli(storage, capsys, *fork, "f")  # finished
    assert rc == 0, err
    assert cli(storage, capsys, "status", "--run", "f", "--verify")[0] == 0
    rc, out, err = cli(storage, capsys, "delete", "--run", "g", "--yes")  # removed
    assert rc == 0 and not storage.exists(run_dir(storage, "g")), err


def test_gc_with_retention_keeps_the_state_a_half_made_fork_resumes_from_and_the_advised_fork_finishes_it(
    tmp_path, capsys, monkeypatch
):
    """A fork at 1 killed before its run.json, before it took learn 0: gc --retention of the parent collects the
    optimizer state of every learn but the newest, and took learn 0's, which the fork's first learn reads, then
    advised `grpo fork` again, which refused it ("collected"). Now gc keeps it while the fork is half made: the advised
    command finishes the fork, and it trains."""
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    storage = open_storage((tmp_path / "s").as_uri())
    make_run(storage, "p")
    for _ in run_warm(storage, "p", 0, 2):
        pass
    fork = ["fork", "--from", "p", "--at", "1", "--set", "learn.lr=1e-3", "--run", "f"]
    killed_after(3, storage, capsys, monkeypatch, *fork)  # the base and iteration 0's first stages taken, not its learn
    assert not storage.exists(f"{run_dir(storage, 'f')}/run.json")
    rc, out, err = cli(storage, capsys, "gc", "--run", "p", "--retention", "--delete", "--older-than-s", "0")
    assert rc == 0 and "run f: a fork of p at 1 killed while it was made: `grpo fork`" in out, out + err
    assert "iteration 0:" in out and "referenced by run f (a fork)" in out, out
    rc, _, err = cli(storage, capsys, *fork)  # what gc advised
    assert rc == 0, err
    WARM.take(None)
    rc, _, err = cli(storage, capsys, "run", "--run", "f", "--iterations", "1")  # learn 1 resumes from p's learn 0
    assert rc == 0, err
    assert latest_committed(storage, stage_dir(storage, "f", 1, "learn")) is not None


def test_a_resume_does_not_wait_for_a_state_writer_this_host_sees_gone(tmp_path, monkeypatch):
    """SIGKILL in learn 0's state commit, the policy committed: the next learn looked at the state's attempt, saw a
    heartbeat of 30 s ago at most, and waited 64-90 s for it to stop counting, though the writer's pid on this very
    host is gone. Now it sees the writer gone at once, replays the state, and goes on."""
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GRPO_HEARTBEAT_S", raising=False)  # the default: a beat every 30 s
    storage = open_storage((tmp_path / "s").as_uri())
    make_run(storage, "k")
    for s in ("snapshot", "rollouts", "rewards", "advantages"):
        stage_function(s)(storage, "k", 0)
    code = (
        "import os, signal, sys\n"
        "from grpo.record import resume\n"
        "from grpo.record.storage import open_storage\n"
        "from stages import stage_function\n"
        "resume._commit = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # in the state commit's thread\n"
        "stage_function('learn')(open_storage(sys.argv[1]), 'k', 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, storage.url], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    learned = latest_committed(storage, stage_dir(storage, "k", 0, "learn"))
    assert not state.being_written(storage, "k", learned)  # was True for 90 s: a heartbeat this fresh
    WARM.take(None)
    for s in ("snapshot", "rollouts", "rewards", "advantages", "learn"):
        stage_function(s)(storage, "k", 1)  # learn 1 replays learn 0's state
    assert state.committed_state(storage, "k", learned) is not None


def test_a_killed_process_s_staging_folder_in_the_cache_is_removed_by_the_next(tmp_path, monkeypatch):
    """A learn killed while writing its policy left <GRPO_CACHE>/checkpoints/.tmp-* (12 bytes a parameter), which
    nothing cleaned; the next staging folder made on this host removes those of processes that are gone."""
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    code = (
        "import os, signal\n"
        "from grpo.record.checkpoint import staging_folder\n"
        "open(os.path.join(staging_folder(), 'model.safetensors'), 'wb').write(b'w' * 1000)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == -signal.SIGKILL
    cache = tmp_path / "cache" / "checkpoints"
    (left,) = cache.glob(".tmp-*")
    from grpo.record.checkpoint import staging_folder

    mine = staging_folder()  # this live process's own stays
    assert not left.exists() and [p.name for p in cache.glob(".tmp-*")] == [os.path.basename(mine)]
