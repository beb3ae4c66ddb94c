"""learn.sharding=fsdp2: 2 processes over gloo give the update of 1 process and of DDP, save their state
through torch Distributed Checkpoint, and a run resumes at another number of processes (2 -> 1 -> 2).

Tolerance: FSDP2 reduce-scatters gradients in another order than one process sums them, and Adam's
m / sqrt(v) blows float noise up on near-zero gradients, so the whole update must agree to a relative
error of 1e-3 (the DDP test's), not every weight bit for bit.
"""

import dataclasses
import hashlib
import os
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from test_learn import F32
from test_stages import learned_files, make_run, state_of

from grpo.record import resume as state
from grpo.record.layout import STATE_STAGE, stage_dir
from grpo.record.storage import committed_attempts, latest_committed, list_attempts, open_storage
from stages import StageError, stage_function
from stages import learn as learn_module
from stages.init import init_run
from stages.iteration import run_iteration

pytestmark = pytest.mark.equivalence  # run again in CI's bf16 lane (.ci/run)

TOL = 1e-3
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


def learn_of(storage, run_id, k):
    return latest_committed(storage, stage_dir(storage, run_id, k, "learn"))


def weights(committed, name="policy/model.safetensors"):
    return load_file(committed.path(name))


def relative_gap(update_a: dict, update_b: dict) -> float:
    a = torch.cat([update_a[k].flatten() for k in sorted(update_a)])
    b = torch.cat([update_b[k].flatten() for k in sorted(update_a)])
    assert a.norm() > 1e-4  # the update moved the weights
    return float((a - b).norm() / a.norm())


@pytest.mark.precision_pinned
@pytest.mark.slow
def test_fsdp2_gives_the_update_of_one_process_and_of_ddp_and_commits_sharded_state(storage):
    for run_id, extra in [
        ("one", []),
        ("ddp", ["learn.num_processes=2"]),
        ("fsdp", ["learn.num_processes=2", "learn.sharding=fsdp2"]),
    ]:
        make_run(storage, run_id, extra=extra + [F32])
        for s in ["snapshot", "rollouts", "rewards", "advantages", "learn"]:
            stage_function(s)(storage, run_id, 0)
    base = weights(latest_committed(storage, stage_dir(storage, "one", None, "base")))
    update = {r: {k: v - base[k] for k, v in weights(learn_of(storage, r, 0)).items()} for r in ("one", "ddp", "fsdp")}
    assert relative_gap(update["one"], update["fsdp"]) < TOL
    assert relative_gap(update["ddp"], update["fsdp"]) < TOL
    fsdp = learn_of(storage, "fsdp", 0)
    files = set(learned_files(fsdp))
    # each process wrote its own shards; no full optimizer.pt, no master copy
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= files and "optimizer.pt" not in files
    assert fsdp.manifest.summary["world_size"] == 2
    m1, m2 = (pd.read_parquet(learn_of(storage, r, 0).path("metrics.parquet")) for r in ("one", "fsdp"))
    for col in ["loss", "grad_norm", "ratio_max"]:
        assert m1[col].tolist() == pytest.approx(m2[col].tolist(), rel=1e-4, abs=1e-6), col


@pytest.mark.precision_pinned
@pytest.mark.slow
def test_a_sharded_run_resumes_at_another_number_of_processes(storage):
    """fsdp2 at 2 processes, then 1, then 2 (the optimizer state resharded by DCP each time) trains what
    one process does all along: same rollouts, same weights within TOL after three iterations."""
    decay = ["learn.lr_decay_steps=40", F32]  # lr follows AdamW's step count, which must come through DCP
    make_run(storage, "ref", extra=decay)
    cfg = make_run(storage, "w", extra=decay + ["learn.sharding=fsdp2", "learn.num_processes=2"])
    for k in range(3):
        run_iteration(storage, "ref", k)
        if k:  # the run's number of learner processes may change: DCP reshards its state
            learn = dataclasses.replace(cfg.learn, num_processes=2 - k % 2)
            init_run(storage, "w", dataclasses.replace(cfg, learn=learn))
        run_iteration(storage, "w", k)
        assert learn_of(storage, "w", k).manifest.summary["world_size"] == 2 - k % 2
        ref_rows, w_rows = (
            pd.read_parquet(latest_committed(storage, stage_dir(storage, r, k, "rollouts")).path("rollouts.parquet"))
            for r in ("ref", "w")
        )
        assert ref_rows.response_ids.map(list).tolist() == w_rows.response_ids.map(list).tolist()
    base = weights(latest_committed(storage, stage_dir(storage, "ref", None, "base")))
    ref, w = ({k: v - base[k] for k, v in weights(learn_of(storage, r, 2)).items()} for r in ("ref", "w"))
    assert relative_gap(ref, w) < TOL
    steps = pd.read_parquet(learn_of(storage, "w", 2).path("metrics.parquet"))
    ref_steps = pd.read_parquet(learn_of(storage, "ref", 2).path("metrics.parquet"))
    assert steps.lr.tolist() == pytest.approx(ref_steps.lr.tolist())


def kill_rank_1_in(hook: Path, function: str) -> None:
    """A sitecustomize in `hook` (on PYTHONPATH it loads in every python the learn stage starts) that SIGKILLs
    rank 1 when it calls grpo.learner.sharding.`function`; in the shards (save_state), once rank 0 has said the
    policy is out (its `ready` marker), as a rank lost there is."""
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import json, os, signal, sys, time\n"
        "from pathlib import Path\n"
        "def kill(*a, **k):\n"
        f"    if {function!r} == 'save_state':\n"
        "        ready = Path(json.loads(Path(sys.argv[1]).read_text())['ready'])\n"
        "        while not ready.exists():\n"
        "            time.sleep(0.01)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import grpo.learner.sharding\n"
        f"    grpo.learner.sharding.{function} = kill\n"
    )


@pytest.mark.precision_pinned
def test_a_policy_said_ready_is_ready_though_torchrun_ended_before_it_was_looked_at(tmp_path):
    """Rank 0 marks the policy ready, a rank is lost in its shards and torchrun ends, all between two looks of the
    stage: the learn goes on to commit its policy, and the end (finish) reports the lost rank."""
    import collections
    import subprocess
    import threading

    from grpo.learner.launch import LearnersExited, Torchrun, _forward

    ready, args_file = tmp_path / "ready", tmp_path / "args.json"
    args_file.write_text("{}")
    run = Torchrun.__new__(Torchrun)  # its process: one that marks ready and fails, over before the first look
    run.args, run.args_file = {"ready": str(ready)}, str(args_file)
    run.proc = subprocess.Popen(
        ["sh", "-c", f"touch {ready}; echo 'terminate called after throwing'; echo '  what():  Read error'; exit 1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run.tail, run.cause, run.killed = collections.deque(maxlen=20), [], {}
    run.reader = threading.Thread(target=_forward, args=(run.proc, run.tail, run.cause, run.killed), daemon=True)
    run.reader.start()
    run.proc.wait()
    run.until_ready()  # returns: the policy is out
    with pytest.raises(LearnersExited, match=r"exited with 1 \(what\(\):  Read error\)"):  # C++'s last words
        run.finish()


ENDS_WHILE_GLOO_FREES = """
import sys, time, torch, torch.distributed as dist
from grpo.learner.rank import run_then_exit

def main():
    dist.init_process_group("gloo")
    sys.setswitchinterval(100)  # this thread keeps the interpreter's lock while it runs Python
    if dist.get_rank() == 1:
        time.sleep(0.3)
    tensor = torch.ones(1 << 16)
    work = dist.broadcast(tensor, src=0, async_op=True)
    del tensor, work  # gloo's thread holds the last references: it frees them once the broadcast is done
    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:  # ... and waits for the lock meanwhile, until the rank ends
        pass

run_then_exit(main)
"""


@pytest.mark.precision_pinned
def test_a_rank_ends_cleanly_while_gloo_still_frees_its_last_collective(tmp_path):
    """A rank returns while gloo's thread waits for the interpreter's lock to free a finished collective's tensors
    (at every exit here; after a two-rank DCP save, about one exit in four by chance): with Python's finalization
    that thread calls std::terminate and the rank, its work done, dies of SIGABRT; `run_then_exit` ends it with 0."""
    import subprocess

    from grpo.runtime.procs import free_port

    script = tmp_path / "rank.py"
    script.write_text(ENDS_WHILE_GLOO_FREES)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [
        subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r)}, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    try:
        ended = [(p.wait(timeout=120), p.stderr.read()) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert [code for code, _ in ended] == [0, 0], ended


def test_a_rank_killed_before_the_policy_is_out_leaves_no_committed_attempt_and_a_rerun_commits(
    storage, tmp_path, monkeypatch
):
    """Rank 1 is SIGKILLed while the ranks gather the policy (before it is written): the stage fails, neither its
    attempt nor the state's commits, and the next try (no kill) commits a complete learn and state."""
    kill_rank_1_in(tmp_path / "hook", "full_state_dict")
    make_run(storage, "k", extra=["learn.num_processes=2", "learn.sharding=fsdp2"])
    for s in ["snapshot", "rollouts", "rewards", "advantages"]:
        stage_function(s)(storage, "k", 0)
    with monkeypatch.context() as m:
        m.setenv("PYTHONPATH", f"{tmp_path / 'hook'}:{ROOT}")
        with pytest.raises(StageError, match="torchrun exited"):
            stage_function("learn")(storage, "k", 0)
    for name in ("learn", STATE_STAGE):
        d = stage_dir(storage, "k", 0, name)
        assert len(list_attempts(storage, d)) == 1 and not committed_attempts(storage, d), name
    learn = stage_function("learn")(storage, "k", 0)
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "policy/model.safetensors"} <= set(learned_files(learn))


@pytest.mark.precision_pinned
def test_the_ranks_write_their_shards_after_the_policy_commits_and_a_rank_lost_then_is_replayed(
    storage, tmp_path, monkeypatch
):
    """fsdp2 on one machine: the learn commits its policy while its ranks write their shards straight into the
    state's attempt. Rank 1 SIGKILLed in its shards: the learn stands, the state never commits, and the next
    learn replays learn 0's update (under torchrun again), commits its state and goes on, to the bytes of a run
    that lost nothing."""
    kill_rank_1_in(tmp_path / "hook", "save_state")
    for run_id in ("lost", "whole"):
        make_run(storage, run_id, extra=["learn.num_processes=2", "learn.sharding=fsdp2", F32])
        for s in ["snapshot", "rollouts", "rewards", "advantages"]:
            stage_function(s)(storage, run_id, 0)
    with monkeypatch.context() as m:
        m.setenv("PYTHONPATH", f"{tmp_path / 'hook'}:{ROOT}")
        learned = stage_function("learn")(storage, "lost", 0)  # committed: the policy was out
    state.settled()  # the background commit failed (logged): rank 1 died writing its shards
    d = stage_dir(storage, "lost", 0, STATE_STAGE)
    assert len(list_attempts(storage, d)) == 1 and not committed_attempts(storage, d)
    assert "policy/model.safetensors" in {f.path for f in learned.manifest.files}
    stage_function("learn")(storage, "whole", 0)
    for run_id in ("lost", "whole"):
        learn_module.WARM.take(None)
        run_iteration(storage, run_id, 1)  # "lost": learn 1 replays learn 0 to make its state
    held = {r: state_of(learn_of(storage, r, 0)) for r in ("lost", "whole")}
    assert {f.path: f.sha256 for f in held["lost"].manifest.files} == {
        f.path: f.sha256 for f in held["whole"].manifest.files
    }
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "rng.pt"} == {
        f.path for f in held["whole"].manifest.files
    }
    assert weights(learn_of(storage, "lost", 1)).keys() == weights(learn_of(storage, "whole", 1)).keys()
    one = {
        r: {f.path: f.sha256 for f in learn_of(storage, r, 1).manifest.files if f.path.startswith("policy/")}
        for r in ("lost", "whole")
    }
    assert one["lost"] == one["whole"]


@pytest.mark.s3
@pytest.mark.slow
def test_sharded_lora_state_round_trips_through_s3(s3, monkeypatch, tmp_path):
    """fsdp2 + LoRA on S3: every rank's shards are uploaded with the adapters, and the next iteration's
    learn (a fresh torchrun) reads them back from there."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    storage = open_storage(f"s3://{s3.bucket}/sharding-{tmp_path.name}")
    make_run(storage, "s", extra=["learn.num_processes=2", "learn.sharding=fsdp2", "learn.lora={r: 2, alpha: 4}"])
    uploaded = []  # what the stage's own process uploads into a state attempt: never the ranks' shards
    real = state.put_files
    monkeypatch.setattr(state, "put_files", lambda fs, pairs: uploaded.extend(r for _, r in pairs) or real(fs, pairs))
    for k in range(2):
        run_iteration(storage, "s", k)
    learn = learn_of(storage, "s", 1)
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "adapter/adapter_model.safetensors"} <= set(learned_files(learn))
    held = state_of(learn)
    shards = [f for f in held.manifest.files if f.path.startswith("dcp/")]
    assert uploaded and not [r for r in uploaded if "/dcp/" in r]  # each rank uploaded its own
    for f in shards:  # listed by the hashes the ranks made on the way: the bytes in storage
        assert hashlib.sha256(storage.fs.cat_file(held.path(f.path))).hexdigest() == f.sha256, f.path
    assert held.manifest.io["upload_bytes"] >= sum(f.size for f in shards)
    steps = pd.read_parquet(storage.uri(learn.path("metrics.parquet")), storage_options=s3.storage_options()).step
    assert learn.manifest.summary["steps"] == len(steps) == 2
