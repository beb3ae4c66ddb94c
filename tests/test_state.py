"""The learner's resume state off the critical path (issue 31): learn k commits its policy, and its optimizer state
follows in a commit of its own (grpo/record/resume.py) that the next learn built from files reads; a state whose commit
never came (the process killed between the two commits, learn.state_every) is replayed, to the same bytes."""

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_learn import F32, TINY

from grpo.config import load_config
from grpo.record import resume as state
from grpo.record.layout import STATE_PREFIXES, STATE_STAGE, stage_dir
from grpo.record.storage import committed_attempts, latest_committed, list_attempts, open_storage
from stages import StageError, learn, stage_function
from stages.init import init_run
from stages.iteration import run_iteration

pytestmark = [pytest.mark.equivalence, pytest.mark.precision_pinned]  # the bf16 lane leaves it out (conftest.py)

RUN = TINY + [F32, "learn.epochs=1", "rollout.max_tokens=8"]
ROOT = Path(__file__).resolve().parents[1]


def committed(storage, run_id, k, stage):
    return latest_committed(storage, stage_dir(storage, run_id, k, stage))


def hashes(storage, run_id, k) -> dict:
    """{(stage, file): sha256} of iteration k's learn and of the state committed after it."""
    state.wait()
    learned = committed(storage, run_id, k, "learn")
    held = state.committed_state(storage, run_id, learned)
    out = {("learn", f.path): f.sha256 for f in learned.manifest.files if not f.path.endswith(".parquet")}
    return out | {(STATE_STAGE, f.path): f.sha256 for f in held.manifest.files}


def cold_iterations(storage, run_id, ks) -> None:
    for k in ks:
        learn.WARM.take(None)  # what a new process has: nothing in memory
        run_iteration(storage, run_id, k)


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


def test_the_learn_commits_its_policy_and_the_state_follows_in_its_own_commit(storage):
    """No optimizer state in the learn's commit; a state commit whose input is that learn holds it, and the next
    learn built from files reads it there (warm and cold runs commit the same bytes)."""
    for run_id in ("cold", "warm"):
        init_run(storage, run_id, load_config(None, RUN))
    cold_iterations(storage, "cold", [0, 1])
    for k in range(2):
        run_iteration(storage, "warm", k)
    learned = committed(storage, "cold", 0, "learn")
    assert not [f.path for f in learned.manifest.files if f.path.startswith(STATE_PREFIXES)]
    state.wait()
    held = state.committed_state(storage, "cold", learned)
    assert {f.path for f in held.manifest.files} == {"optimizer.pt", "rng.pt"}
    assert held.manifest.inputs["learn"] == learned.ref() and held.manifest.stage == STATE_STAGE
    assert held.manifest.committed_at >= learned.manifest.committed_at  # after the policy, never before
    assert hashes(storage, "cold", 1) == hashes(storage, "warm", 1)


def test_a_learn_killed_between_its_policy_and_its_state_commit_resumes_to_the_same_bytes(storage, tmp_path):
    """SIGKILL after learn 0 committed its policy, while its state commit runs: the next learn (built from files)
    waits for that writer's heartbeat to stop, replays learn 0's update from its committed inputs, checks the
    policy it makes is the committed one, commits the state, and goes on: the bytes of an uninterrupted run."""
    for run_id in ("killed", "whole"):
        init_run(storage, run_id, load_config(None, RUN))
    cold_iterations(storage, "whole", [0, 1])
    for s in ("snapshot", "rollouts", "rewards", "advantages"):
        stage_function(s)(storage, "killed", 0)
    code = f"""
import os, signal
import grpo.record.resume
from grpo.record.storage import open_storage
from stages import stage_function
grpo.record.resume._commit = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # in the state commit's thread
stage_function("learn")(open_storage({storage.url!r}), "killed", 0)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRPO_HEARTBEAT_S": "0.3"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert committed_attempts(storage, stage_dir(storage, "killed", 0, "learn"))  # the policy committed
    held_dir = stage_dir(storage, "killed", 0, STATE_STAGE)
    assert list_attempts(storage, held_dir) and not committed_attempts(storage, held_dir)  # the state did not
    cold_iterations(storage, "killed", [0, 1])  # resumes: learn 0 reused, learn 1 replays its state first
    assert len(committed_attempts(storage, stage_dir(storage, "killed", 0, "learn"))) == 1
    assert hashes(storage, "killed", 0) == hashes(storage, "whole", 0)
    assert hashes(storage, "killed", 1) == hashes(storage, "whole", 1)


def test_state_every_k_commits_every_kth_state_and_a_cold_learn_replays_the_rest(storage):
    """learn.state_every=2: a warm run commits the states of iterations 1 and 3 only; a learner built from files at
    iteration 3 replays learn 2 from state 1 (one update) and commits what learn.state_every=1 does."""
    init_run(storage, "every", load_config(None, RUN))
    init_run(storage, "skip", load_config(None, RUN + ["learn.state_every=2"]))
    cold_iterations(storage, "every", range(4))
    learn.WARM.take(None)
    for k in range(3):
        run_iteration(storage, "skip", k)  # warm from iteration 1 on
    state.wait()
    made = [k for k in range(3) if committed_attempts(storage, stage_dir(storage, "skip", k, STATE_STAGE))]
    assert made == [1]
    cold_iterations(storage, "skip", [3])  # a new process: learn 3 needs state 2, never committed
    assert hashes(storage, "skip", 2) == hashes(storage, "every", 2)  # replayed and committed
    assert hashes(storage, "skip", 3) == hashes(storage, "every", 3)


def test_a_replay_that_does_not_repeat_the_committed_update_fails_naming_the_file(storage, monkeypatch):
    """A replayed update that differs from the committed one (here: its advantages negated) is refused in one line
    naming the policy file, and nothing of the next learn is committed."""
    init_run(storage, "t", load_config(None, RUN))
    for k in range(2):
        run_iteration(storage, "t", k)
    state.wait()
    for attempt in committed_attempts(storage, stage_dir(storage, "t", 0, STATE_STAGE)):
        storage.fs.rm(attempt, recursive=True)  # as if its commit never came
    real = learn.read_batch

    def negated(*args):
        batch = real(*args)
        return dataclasses.replace(batch, advantages=-batch.advantages)

    monkeypatch.setattr(learn, "read_batch", negated)
    learn.WARM.take(None)
    with pytest.raises(StageError, match=r"learn iteration 0: replaying .* wrote policy/model.safetensors unlike"):
        stage_function("learn")(storage, "t", 1, force=True)
    assert len(committed_attempts(storage, stage_dir(storage, "t", 1, "learn"))) == 1


@pytest.mark.s3
def test_on_s3_the_learners_machine_reads_back_nothing_it_wrote_and_another_machine_downloads_it(
    s3_env, s3_prefix, tmp_path, monkeypatch
):
    """A cold learn on the machine that committed learn k's policy and state reads neither back from storage (the
    commits left them in its cache, their hashes known); on another machine the same learn downloads both."""
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "here"))
    storage = open_storage(s3_prefix)
    init_run(storage, "t", load_config(None, RUN))
    cold_iterations(storage, "t", [0, 1])
    state.wait()
    learned = committed(storage, "t", 1, "learn")
    own = lambda c: sum(f.size for f in c.manifest.files if f.uri is None)  # noqa: E731
    assert learned.manifest.io["download_bytes"] == 0 and learned.manifest.io["hash_bytes"] == own(learned)
    assert committed(storage, "t", 1, "rollouts").manifest.io["download_bytes"] == 0  # learn 0's policy: cached
    before = committed(storage, "t", 0, "learn")
    held = state.committed_state(storage, "t", before)
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "there"))
    learn.WARM.take(None)
    again = stage_function("learn")(storage, "t", 1, force=True)
    policy = sum(f.size for f in before.manifest.files if f.path.startswith("policy/") and f.uri is None)
    assert again.manifest.io["download_bytes"] >= policy + own(held)  # the start policy and the state
    assert {f.path: f.sha256 for f in again.manifest.files if f.path.startswith("policy/")} == {
        f.path: f.sha256 for f in learned.manifest.files if f.path.startswith("policy/")
    }


@pytest.mark.s3
def test_a_process_whose_main_thread_ends_before_its_state_commit_still_commits_it(s3_env, s3_prefix, tmp_path):
    """`grpo run`'s last learn, a placed learn's flow-run process: the main thread ends while the state commit is
    still to come (here held back 2 s); the process commits it before it exits, its uploads not refused by the
    interpreter's shutdown ("cannot schedule new futures after interpreter shutdown")."""
    script = (
        "import time\n"
        "from grpo.record import resume as state\n"
        "real = state._commit\n"
        "state._commit = lambda *a, **k: time.sleep(2) or real(*a, **k)\n"
        "from grpo.config import load_config\n"
        "from grpo.record.storage import open_storage\n"
        "from stages.init import init_run\n"
        "from stages.iteration import run_iteration\n"
        f"storage = open_storage({s3_prefix!r})\n"
        f"init_run(storage, 't', load_config(None, {RUN!r}))\n"
        "run_iteration(storage, 't', 0)\n"
    )
    env = {**os.environ, "GRPO_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=ROOT, timeout=300, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "background commit failed" not in done.stderr, done.stderr[-2000:]
    storage = open_storage(s3_prefix)
    assert state.committed_state(storage, "t", committed(storage, "t", 0, "learn")) is not None
