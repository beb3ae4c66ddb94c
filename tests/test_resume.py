"""A run killed with SIGKILL in the middle of a stage resumes to exactly what an uninterrupted run
commits: every committed file of every stage byte-identical (sha256 in the manifests). Also with the
optional algorithms switched on (issue 20): a run using each of them resumes to the same bytes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo.config import load_config
from grpo.query import query
from grpo.record.layout import STAGES, stage_dir
from grpo.record.storage import committed_attempts, latest_committed, list_attempts, open_storage
from stages.init import init_run

pytestmark = pytest.mark.equivalence  # run again in CI's bf16 lane (.ci/run)

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


# constant for 3 prompts in 4, else the response's length: most groups have no signal (dynamic sampling)
FLAT = """
def mostly_flat(response, ground_truth, prompt, **row):
    return 0.5 if int(prompt.split()[1]) % 4 else float(len(response))
"""
VARIANTS = {
    # the optional algorithms that can run together: GSPO with dual-clip, DAPO's dynamic sampling (8 groups
    # with signal wanted, few have it, so iteration 0 draws a second round and iteration 1 starts after it),
    # a reference refreshed each iteration (iteration 1's KL is to iteration 1's snapshot, read back cold on
    # resume) and an eval every 2 iterations (iteration 0's is a committed skip; the run's last is evaluated)
    "gspo-dynamic-refresh": [
        "learn.loss_type=gspo",
        "learn.clip_eps=3e-4",
        "learn.clip_eps_high=4e-4",
        "learn.dual_clip_c=3",
        "reward.functions=[{dir}/flat.py:mostly_flat]",
        "reward.truncated_reward=null",
        "rollout.min_signal_groups=8",
        "rollout.max_sampling_rounds=2",
        "learn.kl_coef=0.05",
        "learn.ref_update_every=1",
        "eval.every=2",
    ],
    # the defaults but for the loss and DAPO's overlong shaping: it stands for a default run too (nothing that
    # resumes depends on the loss; a default run killed mid-rollouts and retried: test_flow_e2e)
    "cispo-overlong": ["learn.loss_type=cispo", "learn.clip_eps_high=0.28", "reward.overlong_buffer=2"],
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.slow
def test_a_run_killed_mid_learn_resumes_to_byte_identical_outputs(tmp_path, variant):
    stores = {name: open_storage((tmp_path / name).as_uri()) for name in ("whole", "killed")}
    for storage in stores.values():
        (tmp_path / "flat.py").write_text(FLAT)
        init_run(storage, "r", load_config(None, CONFIG + [v.format(dir=tmp_path) for v in VARIANTS[variant]]))

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
    summary = {s: latest_committed(storage, stage_dir(storage, "r", 0, s)).manifest.summary for s in STAGES}
    if variant == "gspo-dynamic-refresh":  # the settings took effect
        assert summary["rollouts"]["rounds"] == 2 and summary["eval"].get("skipped") is True
    if variant == "cispo-overlong":  # responses past 3 of the 5 tokens lost reward
        shaped = query(storage, "r", "SELECT min(components['overlong']) AS m FROM rewards")
        assert shaped.m[0] < 0
