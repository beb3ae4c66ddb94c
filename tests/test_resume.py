"""A run killed with SIGKILL in the middle of a stage resumes to exactly what an uninterrupted run
commits: every committed file of every stage byte-identical (sha256 in the manifests)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from grpo.config import load_config
from grpo.layout import STAGES, stage_dir
from grpo.storage import committed_attempts, latest_committed, list_attempts, open_storage
from stages.init import init_run

ROOT = Path(__file__).resolve().parents[1]
CONFIG = [
    "rollout.prompts_per_iteration=16",
    "rollout.group_size=4",
    "learn.minibatch_size=16",
    "learn.microbatch_size=8",
    "learn.epochs=6",  # a learn of a few seconds: the kill lands inside it
    "eval.n_prompts=16",
    "reward.workers=1",
]


def grpo_run(storage_dir: Path, iterations: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "--storage",
            str(storage_dir),
            "run",
            "--run",
            "r",
            "--iterations",
            str(iterations),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def committed_files(storage, iterations: int) -> dict:
    return {
        (k, s): sorted(
            (f.path, f.sha256) for f in latest_committed(storage, stage_dir(storage, "r", k, s)).manifest.files
        )
        for k in range(iterations)
        for s in STAGES
    }


def test_a_run_killed_mid_learn_resumes_to_byte_identical_outputs(tmp_path):
    stores = {name: open_storage((tmp_path / name).as_uri()) for name in ("whole", "killed")}
    for storage in stores.values():
        init_run(storage, "r", load_config(None, CONFIG))

    whole = grpo_run(tmp_path / "whole", 2)
    assert whole.wait(timeout=600) == 0, whole.stderr.read()

    storage = stores["killed"]
    learn1 = stage_dir(storage, "r", 1, "learn")
    killed = grpo_run(tmp_path / "killed", 2)
    deadline = time.monotonic() + 600
    while not list_attempts(storage, learn1):  # iteration 1's learn has begun
        assert killed.poll() is None and time.monotonic() < deadline, "the run ended before its learn of iteration 1"
        time.sleep(0.02)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(timeout=60)
    assert not committed_attempts(storage, learn1), "learn of iteration 1 committed before the kill"
    assert committed_attempts(storage, stage_dir(storage, "r", 1, "advantages"))  # the kill was mid-iteration

    resumed = grpo_run(tmp_path / "killed", 1)  # from the next unfinished iteration: 1
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()
    assert len(list_attempts(storage, learn1)) == 2 and len(committed_attempts(storage, learn1)) == 1
    assert committed_files(storage, 2) == committed_files(stores["whole"], 2)
