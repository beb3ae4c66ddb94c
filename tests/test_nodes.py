"""learn.nodes: two 1-process "nodes" on this machine (node 0 the learn stage here, node 1 `grpo stage learn
--node-rank 1` in a process of its own) train the update of one node of 2 processes, bit for bit: the same
ranks run the same code and gloo sums the same two gradients, whether over loopback within one torchrun or
between two. Node 0 fails in one line naming node 1, and commits nothing, when node 1 never comes or dies.
"""

import contextlib
import dataclasses
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file
from test_stages import learned_files, make_run

from grpo.learner.nodes import beat_path
from grpo.record.layout import stage_dir
from grpo.record.liveness import HEARTBEAT_NAME
from grpo.record.storage import committed_attempts, list_attempts, open_storage
from stages import StageError, stage_function
from stages.init import init_run
from stages.iteration import run_iteration

pytestmark = pytest.mark.equivalence  # run again in CI's bf16 lane (.ci/run)

ROOT = Path(__file__).resolve().parents[1]
BEFORE_LEARN = ["snapshot", "rollouts", "rewards", "advantages"]


@pytest.fixture
def storage(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_NODE_ADDR", "127.0.0.1")  # node 0's address, for node 1 (and gloo) to reach
    return open_storage((tmp_path / "store").as_uri())


def ready(storage, run_id, extra):
    cfg = make_run(storage, run_id, extra=extra)
    for s in BEFORE_LEARN:
        stage_function(s)(storage, run_id, 0)
    return cfg


@contextlib.contextmanager
def node(storage, run_id, rank=1, iteration=0):
    """`grpo stage learn --node-rank rank` in a process of its own; it and everything it started are
    killed on the way out."""
    cmd = [sys.executable, "-m", "flows.cli", "--storage", storage.url, "stage", "learn", "--run", run_id]
    proc = subprocess.Popen(
        cmd + ["--iteration", str(iteration), "--node-rank", str(rank)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        kill_node(proc)


def kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL a node's process and its descendants (torchrun's workers run in sessions of their own)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        family = psutil.Process(proc.pid).children(recursive=True)
        for p in [psutil.Process(proc.pid), *family]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def weights(committed):
    return load_file(committed.path("policy/model.safetensors"))


@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
@pytest.mark.slow
def test_two_nodes_of_one_process_train_the_update_of_one_node_of_two(storage, sharding):
    two_processes = ["learn.num_processes=2", f"learn.sharding={sharding}"]
    ready(storage, "one", two_processes)
    ready(storage, "two", two_processes + ["learn.nodes=2", "learn.node_timeout_s=120"])
    one = stage_function("learn")(storage, "one", 0)
    with node(storage, "two") as node_1:
        two = stage_function("learn")(storage, "two", 0)
        out, _ = node_1.communicate(timeout=120)
    assert node_1.returncode == 0 and two.uri in out, out  # node 1 waited for node 0's commit
    a, b = weights(one), weights(two)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert two.manifest.config == one.manifest.config  # the nodes are not part of the stage's identity
    assert two.manifest.summary["nodes"] == 2 and two.manifest.summary["world_size"] == 2
    files = {f.path for f in two.manifest.files}
    assert {"nodes/rendezvous.json", "nodes/node-1.json"} <= files
    assert not any(HEARTBEAT_NAME in f for f in files)
    if sharding == "fsdp2":  # node 1's rank wrote its shard on its machine and uploaded it
        assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= files
        shards = {f.path: f.sha256 for f in two.manifest.files if f.path.startswith("dcp/__")}
        held = learned_files(one)  # one node: the state in its own commit after the learn's (grpo/record/resume.py)
        assert shards == {p: c.manifest.file(p).sha256 for p, c in held.items() if p.startswith("dcp/__")}


@pytest.mark.s3
@pytest.mark.slow
def test_two_nodes_on_s3_upload_their_shards_and_read_them_back(s3, monkeypatch, tmp_path):
    """On S3 (nothing on a shared disk): node 1 uploads its rank's dcp/ shard into node 0's attempt, and in
    the next iteration downloads the sharded state the first learn committed, as node 0 does."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("GRPO_NODE_ADDR", "127.0.0.1")
    storage = open_storage(f"s3://{s3.bucket}/nodes-{tmp_path.name}")
    extra = ["learn.num_processes=2", "learn.sharding=fsdp2", "learn.nodes=2", "learn.node_timeout_s=120"]
    make_run(storage, "s3", extra=extra)  # node 1 starts first: it waits for the iteration's inputs
    for k in range(2):
        with node(storage, "s3", iteration=k) as node_1:  # waits for node 0's rendezvous
            learn = run_iteration(storage, "s3", k)["learn"]
            out, _ = node_1.communicate(timeout=120)
        assert node_1.returncode == 0 and learn.uri in out, out
        assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "nodes/node-1.json"} <= {f.path for f in learn.manifest.files}
    assert learn.manifest.summary["steps"] == 2


def fails_committing_nothing(storage, run_id) -> str:
    with pytest.raises(StageError) as e:
        stage_function("learn")(storage, run_id, 0)
    d = stage_dir(storage, run_id, 0, "learn")
    assert len(list_attempts(storage, d)) == 1 and not committed_attempts(storage, d)
    message = str(e.value)
    assert "\n" not in message, message
    return message


@pytest.mark.precision_pinned
def test_node_0_fails_in_one_line_and_commits_nothing_when_node_1_never_comes(storage):
    ready(storage, "lone", ["learn.num_processes=2", "learn.nodes=2", "learn.node_timeout_s=4"])
    t0 = time.monotonic()
    message = fails_committing_nothing(storage, "lone")
    assert "node 1 of 2 never came within learn.node_timeout_s=4" in message
    assert f"grpo --storage {storage.url} stage learn --run lone --iteration 0 --node-rank 1" in message
    assert time.monotonic() - t0 < 30


@pytest.mark.precision_pinned
def test_node_0_fails_in_one_line_and_commits_nothing_when_node_1_dies(storage):
    ready(storage, "dies", ["learn.num_processes=2", "learn.nodes=2", "learn.node_timeout_s=8"])
    d = stage_dir(storage, "dies", 0, "learn")

    def kill_once_joined(proc):  # node 1 dies with its machine: no word from it
        while proc.poll() is None:
            if any(storage.exists(beat_path(f"{d}/{a}", 1)) for a in list_attempts(storage, d)):
                kill_node(proc)
                return
            time.sleep(0.2)

    with node(storage, "dies") as node_1:
        killer = threading.Thread(target=kill_once_joined, args=(node_1,), daemon=True)
        killer.start()
        message = fails_committing_nothing(storage, "dies")
        killer.join(timeout=30)
    assert message.startswith("learn: node 1 of 2") and ("went silent" in message or "without reporting" in message)


def test_node_0_names_node_1_and_its_error_when_node_1_fails(storage, tmp_path, monkeypatch):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(  # loaded by every python node 1 starts: its rank fails
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import grpo.learner.loop\n"
        "    def fail(*a, **k):\n"
        "        raise RuntimeError('out of memory on rank 1')\n"
        "    grpo.learner.loop.minibatch_step = fail\n"
    )
    ready(storage, "fails", ["learn.num_processes=2", "learn.nodes=2", "learn.node_timeout_s=60"])
    monkeypatch.setenv("PYTHONPATH", f"{hook}:{ROOT}")
    with node(storage, "fails") as node_1:
        message = fails_committing_nothing(storage, "fails")
        out, _ = node_1.communicate(timeout=60)
    assert message.startswith("learn: node 1 of 2") and "failed" in message, message
    assert "RuntimeError: out of memory on rank 1" in message and "RuntimeError: out of memory on rank 1" in out


@pytest.mark.precision_pinned
def test_where_the_learner_runs_may_change_for_an_existing_run(storage):
    cfg = make_run(storage, "moves", extra=["learn.num_processes=2"])
    for nodes in (2, 1):  # ddp: the number of processes stays, the machines they run on may change
        init_run(storage, "moves", dataclasses.replace(cfg, learn=dataclasses.replace(cfg.learn, nodes=nodes)))
    with pytest.raises(StageError, match="learn.nodes, learn.processes_per_node"):
        init_run(storage, "moves", dataclasses.replace(cfg, learn=dataclasses.replace(cfg.learn, num_processes=1)))


@pytest.mark.precision_pinned
def test_node_rank_must_be_a_joining_node(storage, capsys):
    from flows.cli import main

    make_run(storage, "r", extra=["learn.num_processes=2", "learn.nodes=2"])
    assert main(["--storage", storage.url, "stage", "learn", "--run", "r", "--iteration", "0", "--node-rank", "2"]) == 2
    assert "with learn.nodes=2 nodes 1..1 join node 0" in capsys.readouterr().err
    assert main(["--storage", storage.url, "stage", "eval", "--run", "r", "--iteration", "0", "--node-rank", "1"]) == 2
    assert "--node-rank: stage eval runs on one machine" in capsys.readouterr().err


@pytest.mark.precision_pinned
def test_a_placed_learn_on_two_nodes_is_one_flow_run_per_node_on_its_pool(storage, monkeypatch):
    """The flow sends node 0 (the stage) and node 1 to learn's pool at once, each its own flow run of
    grpo-stage/<pool> with its own idempotency key; no Prefect server needed to see what it asks for."""
    import prefect.deployments

    from flows.placement import Placement

    cfg = make_run(storage, "p", extra=["learn.num_processes=2", "learn.nodes=2"])
    asked = []

    def run_deployment(name, parameters, idempotency_key, timeout):
        asked.append((name, parameters, idempotency_key))
        return types.SimpleNamespace(id=len(asked))

    monkeypatch.setattr(prefect.deployments, "run_deployment", run_deployment)
    monkeypatch.setattr(Placement, "wait_flow_runs", lambda self, stage, runs, *_: [r.id for r in runs])
    at = Placement({"learn": "gpu"}, storage, "p", 0, cfg)
    assert at("learn", "file:///advantages") == [1, 2]
    assert [(name, p.get("node_rank"), p["upstream"]) for name, p, _ in asked] == [
        ("grpo-stage/gpu", None, "file:///advantages"),
        ("grpo-stage/gpu", 1, "file:///advantages"),
    ]
    assert asked[1][2] == asked[0][2] + "/node-1"
