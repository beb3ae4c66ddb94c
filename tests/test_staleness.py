"""rollout.staleness (issue 32): iteration k samples the policy learn k - 1 - S committed, recorded by the snapshot
and per rollouts row, refused from any other source; learn.behavior_correction weighs by pi_prox / pi_sampler; S = 0
without a correction updates as before, byte for byte; a stale run stopped between stages resumes to the bytes of an
uninterrupted one."""

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pandas as pd
import pytest
import torch
from test_learn import F32, TINY

from grpo import gc
from grpo.config import RetentionConfig, load_config
from grpo.record.checkpoint import content_hash
from grpo.record.layout import STAGES, stage_dir
from grpo.record.lineage import next_iteration
from grpo.record.storage import latest_committed, open_storage
from grpo.report import figure_png, iteration_rows
from grpo.sampling.engines import close_generators
from stages import StageError, learn, rollouts, snapshot, stage_function
from stages.init import init_run
from stages.iteration import run_iteration, run_warm

pytestmark = [pytest.mark.equivalence, pytest.mark.precision_pinned]  # the bf16 lane leaves it out (conftest.py)

RUN = TINY + [F32, "learn.epochs=1", "learn.lr=3e-3", "learn.lr_decay_steps=0", "rollout.max_tokens=8"]


@pytest.fixture
def one_thread():
    """One torch thread, as the code before (BEFORE) runs below (and as the suite's workers run); torch's count is
    the process's, so a learn in another thread takes it too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cold():
    """What a new process has: no warm learner, no sampling engine."""
    learn.WARM.take(None)
    close_generators()


def committed(storage, run_id, k, stage):
    return latest_committed(storage, stage_dir(storage, run_id, k, stage))


BEFORE = "9fc5dde"
"""The last commit before rollout.staleness and learn.behavior_correction existed: the code whose update S = 0
without a correction must commit, byte for byte."""
BEFORE_LEARN_1 = """
import sys, torch
torch.set_num_threads(1)
from grpo.config import load_config
from grpo.storage import open_storage
from stages.init import init_run
from stages.iteration import run_iteration
storage = open_storage(sys.argv[1])
init_run(storage, "g", load_config(None, sys.argv[2:]))
for k in range(2):
    out = run_iteration(storage, "g", k)
print({f.path: f.sha256 for f in out["learn"].manifest.files}["policy/model.safetensors"])
"""


def learn_1_before(tmp_path, overrides: list[str]) -> str:
    """The sha256 of learn 1's policy as the code of BEFORE commits it, on this CPU, one thread: that commit's
    tree out of git, run in a process of its own. Float32 matmuls take other kernels (and round otherwise) on AVX2
    than on AVX512, so these bytes are made here, beside the ones they are compared with, not kept per CPU."""
    root = Path(__file__).resolve().parents[1]
    tree = tmp_path / "before"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(root), "archive", BEFORE], capture_output=True)
    if archive.returncode != 0:  # a checkout without history: a release tarball, a shallow clone
        pytest.skip(f"commit {BEFORE} is not in this checkout's git history: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_")}
    env |= {"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "GRPO_CACHE": str(tmp_path / "before-cache")}
    done = subprocess.run(
        [sys.executable, "-c", BEFORE_LEARN_1, (tmp_path / "before-store").as_uri(), *overrides],
        cwd=tree, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()[-1]


def test_no_staleness_and_no_correction_commit_the_weights_of_the_code_before_them(tmp_path, one_thread):
    """The policy of learn 1 at the defaults (S = 0, behavior_correction none), float32, one thread: the bytes the
    code before rollout.staleness and learn.behavior_correction existed (BEFORE) commits for this very run, made in
    the same test on the same CPU."""
    storage = open_storage((tmp_path / "s").as_uri())
    init_run(storage, "g", load_config(None, TINY + [F32]))
    cold()
    for k in range(2):
        out = run_iteration(storage, "g", k)
    now = out["learn"].manifest.file("policy/model.safetensors").sha256
    assert now == learn_1_before(tmp_path, TINY + [F32])
    assert out["learn"].manifest.summary["behavior_weight_mean"] == 1.0  # recorded, not applied


def test_a_stale_run_samples_what_its_staleness_names_and_refuses_any_other_source(tmp_path, monkeypatch, one_thread):
    storage = open_storage((tmp_path / "s").as_uri())
    init_run(storage, "s1", load_config(None, RUN + ["rollout.staleness=1", "learn.behavior_correction=tis"]))
    with pytest.raises(StageError, match=r"different config \(rollout.staleness\)"):  # S is the run's identity
        init_run(storage, "s1", load_config(None, RUN + ["learn.behavior_correction=tis"]))
    cold()
    outs = [out for _, out in run_warm(storage, "s1", 0, 3)]
    learns = [o["learn"] for o in outs]
    assert len({content_hash(o) for o in learns}) == 3  # it trains: every learn commits new weights
    # snapshot 2 froze learn 0's policy; 0 and 1 the base
    assert [o["snapshot"].manifest.summary["policy_version"] for o in outs] == [-1, -1, 0]
    assert outs[2]["snapshot"].manifest.inputs["policy"].uri == learns[0].uri
    for k, o in enumerate(outs):  # and every row says which policy sampled it
        rows = pd.read_parquet(storage.uri(o["rollouts"].path("rollouts.parquet")))
        assert set(rows.policy_version) == {k - 2 if k >= 2 else -1} and len(rows) == 64
    hashes = pd.read_parquet(storage.uri(outs[2]["rollouts"].path("rollouts.parquet"))).policy_hash
    assert set(hashes) == {content_hash(learns[0])[:16]}
    # learn 1 starts from learn 0's policy, not from the base that sampled: pi_prox is the learner's own, and the
    # sampler's log-probs differ from it (no sampler stands in for pi_prox, a KL measured, weights truncated)
    summary = learns[1].manifest.summary
    assert summary["old_logprobs"]["source"] == "recomputed" and summary["sampler_kl"] > 1e-4
    assert learns[0].manifest.summary["sampler_kl"] < 1e-6  # iteration 0: the base samples, the base learns
    assert summary["behavior_weight_max"] <= 2.0 and 0 < summary["behavior_weight_mean"]
    rows = iteration_rows(storage, "s1")  # what the tracker receives and the report draws
    assert rows[1]["sampler_kl"] == summary["sampler_kl"] and figure_png(rows, "t").startswith(b"\x89PNG")

    # gc's retention keeps the policy the next iteration samples (learn 1's, for iteration 3), not only the newest
    monkeypatch.setattr(gc, "best_iteration", lambda *a: 0)  # the best eval: not the policy the rule keeps
    found = gc.plan(storage, "s1", min_age_s=0, retention=RetentionConfig(keep_last=1))
    assert "iteration 1: policy (the policy iteration 3 samples)" in found.kept
    assert not [g for g in found.garbage if g.why == "policy"]  # learn 0: the best; 2: the newest

    # a snapshot of iteration 2 forced from another source (learn 1's policy, what S = 0 would sample) is refused
    forced = lambda storage, run_id, k, s, warm_start=False: committed(storage, run_id, 1, "learn")  # noqa: E731
    monkeypatch.setattr(snapshot, "policy_source", forced)
    with pytest.raises(
        StageError, match=r"snapshot iteration 2: the policy frozen for it is learn 1's policy, but rollout"
    ):
        snapshot.snapshot(storage, "s1", 2, force=True)
    # committed anyway (other code): the stages that read it refuse it
    monkeypatch.setattr(snapshot, "check_policy", lambda *a: None)
    snapshot.snapshot(storage, "s1", 2, force=True)
    for stage in (rollouts.rollouts, learn.learn):
        with pytest.raises(
            StageError, match=r"iteration 2: the policy frozen for it is learn 1's .*staleness=1 samples learn 0"
        ):
            stage(storage, "s1", 2, force=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "staleness,correction",
    [(1, ["learn.behavior_correction=mis", "learn.behavior_level=geometric"]), (2, ["learn.behavior_correction=tis"])],
)
def test_a_stale_run_stopped_between_stages_resumes_to_the_bytes_of_an_uninterrupted_one(
    tmp_path, staleness, correction, one_thread
):
    """Iterations 0..3 in one call against: 0, 1, then iteration 2's snapshot, rollouts and rewards, a stop (a new
    process: no warm learner, no sampler), and a resumed call from where the run stands. The resumed learn 2 is
    built from the committed files (learn 1's policy, not the stale snapshot's) and every committed file of every
    stage is the same."""
    cfg = load_config(None, RUN + [f"rollout.staleness={staleness}"] + correction)
    stores = {name: open_storage((tmp_path / name).as_uri()) for name in ("whole", "stopped")}
    for storage in stores.values():
        init_run(storage, "r", cfg)
    cold()
    list(run_warm(stores["whole"], "r", 0, 4))

    storage = stores["stopped"]
    cold()
    list(run_warm(storage, "r", 0, 2))
    for stage in STAGES[:3]:
        stage_function(stage)(storage, "r", 2)
    cold()
    assert next_iteration(storage, "r") == 2
    resumed = list(run_warm(storage, "r", 2, 2))
    assert resumed[0][1]["learn"].manifest.summary["warm_learner"] is False  # built cold
    assert resumed[1][1]["snapshot"].manifest.summary["policy_version"] == 2 - staleness

    def files(s):
        return {(k, st): sorted((f.path, f.sha256) for f in committed(s, "r", k, st).manifest.files)
                for k in range(4) for st in STAGES}  # fmt: skip

    assert files(storage) == files(stores["whole"])


def test_a_stale_lora_learn_built_cold_commits_the_adapters_of_the_warm_one(tmp_path, one_thread):
    """learn.lora with S = 1: iteration 1 samples the base, its learn continues learn 0's adapters (warm in memory);
    forced again in a new process it builds them from learn 0's committed adapters on the base's weights."""
    storage = open_storage((tmp_path / "s").as_uri())
    lora = ["learn.lora={r: 2, alpha: 4}", "rollout.staleness=1", "learn.behavior_correction=tis"]
    init_run(storage, "l", load_config(None, RUN + lora))
    cold()
    warm = [out["learn"] for _, out in run_warm(storage, "l", 0, 2)][1]
    assert warm.manifest.summary["warm_learner"] is True and set(warm.manifest.inputs) >= {"base", "previous"}
    cold()
    again = learn.learn(storage, "l", 1, force=True)
    assert again.manifest.summary["warm_learner"] is False and again.attempt_dir != warm.attempt_dir

    def adapters(c):
        return {f.path: f.sha256 for f in c.manifest.files if f.path.startswith("adapter/")}

    assert adapters(again) == adapters(warm) and adapters(warm)
