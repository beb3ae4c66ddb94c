"""Exact resume of asynchronous iterations (issue 32.4): a stale run (rollout.staleness S = 1, 2) whose learn runs on a
stage worker of its own while the flow samples the next iteration is SIGKILLed at points of the overlap and run again
from where it stands each time: every committed file of every stage then has the sha256 of an uninterrupted run's.

The kill points are held, not timed (tests/kill_points.py). Learn k waits after its first optimizer step of two, and the
flow process, sampling iteration k + 1 meanwhile, waits (a) in rollouts k + 1, its first chunk's rows on disk and the
second chunk not sampled, or (b) in rewards k + 1's commit, its rows written and hashed, its manifest not written.
Flow and worker are killed at once at (a) with k = 2, then, in the run resumed from there, at (b) with k = 3. Then the
flow alone at (a) with k = 4, learn 4 going on: the flow run again sends its own learn 4 to the surviving worker, where
it waits behind the first and reuses what that one commits. Then the worker alone, in learn 5: the flow sees learn 5's
attempt stop beating (flows/placement.py Watch) and fails in one line, rather than wait for it forever."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
import torch
from test_staleness import RUN

from grpo.config import load_config
from grpo.record.layout import STAGES, stage_dir
from grpo.record.lineage import next_iteration
from grpo.record.storage import committed_attempts, latest_committed, list_attempts, open_storage
from grpo.runtime.procs import stop_group
from grpo.sampling.engines import close_generators
from stages import learn
from stages.init import init_run
from stages.iteration import run_warm
from tools.prefect_server import prefect_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
ITERATIONS = 7
KILLS = [(2, "rollouts"), (3, "rewards")]  # learn k is killed mid-update while this stage of k + 1 runs
CORRECTION = {
    1: ["learn.behavior_correction=mis", "learn.behavior_level=geometric"],
    2: ["learn.behavior_correction=tis"],
}
WORKER = "from flows.stage_worker import main; main(['learn'])"  # the learner's machine
FLOW = "import json; from flows.grpo import grpo; print(json.dumps(grpo(**json.loads(sys.argv[3]))))"


def committed_files(storage) -> dict:
    """{(iteration, stage): [(file, sha256)]} of the newest committed attempt of every stage."""
    return {
        (k, s): sorted(
            (f.path, f.sha256) for f in latest_committed(storage, stage_dir(storage, "r", k, s)).manifest.files
        )
        for k in range(ITERATIONS)
        for s in STAGES
    }


def uninterrupted(tmp_path: Path, overrides: list[str]) -> dict:
    """committed_files of the same run uninterrupted, in this process, one thread as the flow and its worker run."""
    storage = open_storage((tmp_path / "whole").as_uri())
    init_run(storage, "r", load_config(None, overrides))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    learn.WARM.take(None)  # a new process's start: no warm learner, no sampling engine
    close_generators()
    try:
        list(run_warm(storage, "r", 0, ITERATIONS))
    finally:
        torch.set_num_threads(threads)
    return committed_files(storage)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One Prefect server for the module: it outlives the killed processes, as a deployment's server does."""
    with prefect_server(tmp_path_factory.mktemp("prefect")) as s:
        yield s


def start(server, tmp_path: Path, name: str, code: str, points: list[str], *args: str) -> subprocess.Popen:
    """`code` in a python process of its own (a session: killed with what it starts), held at `points`."""
    held = "import sys; sys.path.insert(0, sys.argv[1]); import kill_points; kill_points.install(sys.argv[2], "
    held += f"{points!r}); " + code
    (tmp_path / "held").mkdir(exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-c", held, str(TESTS), str(tmp_path / "held"), *args],
        cwd=REPO,
        env=server.env | {"GRPO_THREADS": "1", "GRPO_HEARTBEAT_S": "0.5"},  # a lost stage's attempt seen in 5 s
        stdout=open(tmp_path / f"{name}.log", "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def crash(*procs: subprocess.Popen) -> None:
    """SIGKILL each process and everything it started, all at once (machines lost: no handler runs)."""
    alive = [proc for proc in procs if proc.poll() is None]
    family = [p.pid for proc in alive for p in psutil.Process(proc.pid).children(recursive=True)]
    for proc in alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    for pid in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for proc in procs:
        proc.wait(timeout=60)


def logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(tmp_path.glob("*.log")))


def held(procs: list[subprocess.Popen], tmp_path: Path, points: list[str]) -> None:
    """Wait until the processes hold at every one of `points` (kill_points)."""
    deadline = time.monotonic() + 300
    while not all((tmp_path / "held" / p).exists() for p in points):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, logs(tmp_path)
        time.sleep(0.05)


def flow_end(server, tmp_path: Path, params: dict) -> None:
    """The flow, with a worker for its learns, from the run's next iteration to its last; it must end well."""
    worker = start(server, tmp_path, "worker", WORKER, [])
    try:
        assert flow(server, tmp_path, params).wait(timeout=300) == 0, logs(tmp_path)
    finally:
        stop_group(worker)


def flow(server, tmp_path: Path, params: dict, points: list[str] = ()) -> subprocess.Popen:
    """The flow from the run's next iteration to its last, held at `points`."""
    iterations = ITERATIONS - next_iteration(open_storage(params["storage_url"]), "r")
    return start(server, tmp_path, "flow", FLOW, points, json.dumps(params | {"iterations": iterations}))


@pytest.mark.parametrize("staleness", [1, 2])
def test_a_stale_run_killed_in_the_overlap_resumes_to_the_bytes_of_an_uninterrupted_one(tmp_path, server, staleness):
    overrides = RUN + ["rollout.chunk_prompts=8", f"rollout.staleness={staleness}"] + CORRECTION[staleness]
    storage = open_storage((tmp_path / "store").as_uri())
    params = {"run_id": "r", "overrides": overrides, "storage_url": storage.url, "placement": {"learn": "warm"}}
    for k, stage in KILLS:  # both machines lost
        procs = [
            start(server, tmp_path, "worker", WORKER, [f"learn:{k}"]),
            flow(server, tmp_path, params, [f"{stage}:{k + 1}"]),
        ]
        try:
            held(procs, tmp_path, [f"learn:{k}", f"{stage}:{k + 1}"])
        finally:
            crash(*procs)
        # where the kill landed: learn k begun, not committed; stage k + 1 begun, its table partly written
        learned, sampled = stage_dir(storage, "r", k, "learn"), stage_dir(storage, "r", k + 1, stage)
        assert list_attempts(storage, learned) and not committed_attempts(storage, learned)
        assert committed_attempts(storage, stage_dir(storage, "r", k + 1, "snapshot"))
        assert not committed_attempts(storage, sampled)
        assert Path(sampled, list_attempts(storage, sampled)[-1], f"{stage}.parquet").stat().st_size > 0
        assert next_iteration(storage, "r") == k  # eval k - 1 ran beside learn k, and committed

    # the flow's machine lost alone: learn 4 goes on. The flow run again (from 4: learn 4 is not committed) starts its
    # learn 4 behind it on the worker and samples iteration 5 meanwhile; learn 4 commits, and the queued one takes it
    worker = start(server, tmp_path, "worker", WORKER, ["learn:4", "learn:5"])
    procs = [worker]
    try:
        procs.append(flow(server, tmp_path, params, ["rollouts:5"]))
        held(procs, tmp_path, ["learn:4", "rollouts:5"])
        crash(procs[1])
        again = flow(server, tmp_path, params, ["rewards:5"])
        procs.append(again)
        held([worker, again], tmp_path, ["rewards:5"])  # its learn 4 sent to the worker before iteration 5 sampled
        assert not committed_attempts(storage, stage_dir(storage, "r", 4, "learn"))
        for point in ("learn:4", "rewards:5"):
            (tmp_path / "held" / f"{point}.go").touch()
        # then the learner's machine lost alone, in learn 5: the flow, sampling iteration 6 meanwhile, sees its
        # attempt stop beating and fails in one line (a task run whose process died never ends in Prefect)
        held([worker, again], tmp_path, ["learn:5"])
        crash(worker)
        assert again.wait(timeout=300) != 0
        lost = [line for line in (tmp_path / "flow.log").read_text().splitlines() if "running it was lost" in line]
        assert lost and "learn iteration 5: " in lost[-1], logs(tmp_path)
    finally:
        crash(*procs)
    flow_end(server, tmp_path, params)

    attempts = {(2, "learn"): 2, (3, "rollouts"): 2, (3, "learn"): 2, (4, "rewards"): 2, (4, "learn"): 1}
    attempts |= {(5, "rollouts"): 2, (5, "rewards"): 1, (5, "learn"): 2}
    for (k, stage), n in attempts.items():  # each killed attempt stays, never taken as committed
        where = stage_dir(storage, "r", k, stage)
        assert (len(list_attempts(storage, where)), len(committed_attempts(storage, where))) == (n, 1), (k, stage)
    for k in range(ITERATIONS):  # learn k - 1 - S's policy (or the base) sampled iteration k
        sampled = latest_committed(storage, stage_dir(storage, "r", k, "rollouts"))
        rows = pd.read_parquet(sampled.path("rollouts.parquet"))
        assert set(rows.policy_version) == {max(k - 1 - staleness, -1)}
    assert committed_files(storage) == uninterrupted(tmp_path, overrides)
