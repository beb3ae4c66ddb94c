"""The learner on several machines (learn.nodes > 1): its nodes meet through storage, the one thing they share.

    node 0 = the learn stage (its rank 0 commits)       node r = `grpo stage learn --node-rank r` (or the flow)
    opens its attempt, writes nodes/rendezvous.json ->  finds the live attempt of the same identity; while it
                                                        runs, nodes/node-r/.heartbeat beats there
    torchrun --nnodes N --node_rank 0 (hosts the store) torchrun --nnodes N --node_rank r to node 0's address
                                                        uploads what its ranks wrote into the attempt (fsdp2:
                                                        their dcp/ shards; with ddp rank 0 writes everything)
    commits once every nodes/node-r.json says done  <-  writes nodes/node-r.json: done, or failed and why

Node r's process i is global rank r x processes_per_node + i, the rank it has on one machine, so N nodes
train what one node of learn.num_processes does (tests/test_nodes.py). Node 0 fails in one line naming a
node that failed, never came within learn.node_timeout_s, or went silent as long (its heartbeat stopped),
and commits nothing; a node stops its processes once node 0's attempt is closed or silent.

Node 0's address is $GRPO_NODE_ADDR (where the other nodes reach it; default: this host's outbound
address), its port $GRPO_NODE_PORT (default: a free one). NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME and the
like reach torchrun through the environment (on Prefect: the work pool's job variables `env`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable

from grpo.config import LearnConfig
from grpo.errors import StageError
from grpo.learner import launch
from grpo.record.commit import StageWriter
from grpo.record.counts import is_local
from grpo.record.layout import stage_dir
from grpo.record.liveness import HEARTBEAT_NAME, Heartbeat, heartbeat_interval_s
from grpo.record.storage import Committed, Storage, find_committed, is_committed, list_attempts, load_manifest
from grpo.runtime.procs import free_port

log = logging.getLogger("grpo.learner")

RENDEZVOUS = "nodes/rendezvous.json"
POLL_S = 1.0


def report_path(attempt_dir: str, node_rank: int) -> str:
    """Node r's last word in the attempt: {"state": "done" | "failed", ...}."""
    return f"{attempt_dir}/nodes/node-{node_rank}.json"


def beat_path(attempt_dir: str, node_rank: int) -> str:
    """Node r's heartbeat while it runs (removed before its report: never committed)."""
    return f"{attempt_dir}/nodes/node-{node_rank}/{HEARTBEAT_NAME}"


def node_address() -> str:
    """Where the other nodes reach this one: $GRPO_NODE_ADDR, else the address of the interface this host
    reaches the network through (its hostname's address when it has no route)."""
    if os.environ.get("GRPO_NODE_ADDR"):
        return os.environ["GRPO_NODE_ADDR"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # UDP: nothing is sent, the kernel only picks the interface
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _read_json(storage: Storage, path: str) -> dict | None:
    """The JSON at `path`; None when it is not there (or a read failed: the next poll reads again)."""
    try:
        return json.loads(storage.read_bytes(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.debug("learn nodes: reading %s: %s", path, e)
        return None


def _write_json(storage: Storage, path: str, data: dict) -> None:
    if is_local(storage.fs):
        storage.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    storage.write_bytes_atomic(path, json.dumps(data, sort_keys=True).encode())


class Watched:
    """A file another machine rewrites while it lives, and when this one last saw it change (by this
    machine's clock: the two clocks may differ)."""

    def __init__(self, storage: Storage, path: str):
        self.storage, self.path = storage, path
        self.data: dict | None = None
        self.changed_at = time.monotonic()

    def read(self) -> dict | None:
        data = _read_json(self.storage, self.path)
        if data != self.data:
            self.data, self.changed_at = data, time.monotonic()
        return data

    def quiet_s(self) -> float:
        return time.monotonic() - self.changed_at


# ---------------------------------------------------------------- node 0


class Followers:
    """Node 0's view of nodes 1..N-1: their heartbeats and reports in its attempt."""

    def __init__(self, storage: Storage, attempt_dir: str, lc: LearnConfig, start: str):
        self.storage, self.attempt_dir, self.lc, self.start = storage, attempt_dir, lc, start
        self.beats = {r: Watched(storage, beat_path(attempt_dir, r)) for r in range(1, lc.nodes)}

    def report(self, r: int) -> dict:
        return _read_json(self.storage, report_path(self.attempt_dir, r)) or {}

    def failed(self, r: int, report: dict) -> str:
        return f"learn: node {r} of {self.lc.nodes} ({report.get('host')}) failed: {report.get('error')}"

    def problem(self) -> str | None:
        """The line naming the first node that failed, never came or went silent; None while all is well."""
        t = self.lc.node_timeout_s
        for r, beat in self.beats.items():
            report = self.report(r)
            if report.get("state") == "failed":
                return self.failed(r, report)
            if report.get("state") == "done":
                continue
            alive = beat.read()
            if beat.quiet_s() <= t:
                continue
            if alive is None:
                return (
                    f"learn: node {r} of {self.lc.nodes} never came within learn.node_timeout_s={t:g}; start it on "
                    f"its machine with `{self.start} {r}` (or place learn on a work pool)"
                )
            return f"learn: node {r} of {self.lc.nodes} ({alive.get('host')}) went silent: no heartbeat for {t:g} s"
        return None

    def stopped(self, grace_s: float) -> str | None:
        """After this node's processes failed: the line naming a node that failed or stopped without a word
        (each gets `grace_s` to report); None when every other node finished (this node failed alone)."""
        deadline = time.monotonic() + grace_s
        while True:
            reports = {r: self.report(r) for r in self.beats}
            for r, report in reports.items():
                if report.get("state") == "failed":
                    return self.failed(r, report)
            pending = [r for r, report in reports.items() if report.get("state") != "done"]
            if not pending:
                return None
            if time.monotonic() > deadline:
                r = pending[0]
                beat = self.beats[r].read()
                if beat is None:
                    return f"learn: node {r} of {self.lc.nodes} never came"
                return f"learn: node {r} of {self.lc.nodes} ({beat.get('host')}) stopped without reporting"
            time.sleep(POLL_S)

    def all_done(self) -> bool:
        return all(self.report(r).get("state") == "done" for r in self.beats)


def lead(writer: StageWriter, args: dict, lc: LearnConfig, run_id: str, iteration: int) -> dict:
    """Node 0: publish the rendezvous in the attempt, run this node's processes, and return rank 0's summary
    once every other node reported done; a StageError names a node that did not."""
    storage = writer.storage
    addr, port = node_address(), int(os.environ.get("GRPO_NODE_PORT") or free_port())
    rendezvous = {"identity": writer.identity, "addr": addr, "port": port, "nodes": lc.nodes}
    _write_json(storage, writer.path(RENDEZVOUS), {**rendezvous, "processes_per_node": lc.node_processes})
    start = f"grpo --storage {storage.url} stage learn --run {run_id} --iteration {iteration} --node-rank"
    log.info(
        "learn iteration %d: node 0 of %d at %s:%d; the others join with `%s r`", iteration, lc.nodes, addr, port, start
    )
    followers = Followers(storage, writer.attempt_dir, lc, start)
    where = launch.Rendezvous(addr, port, lc.nodes, 0, lc.node_timeout_s)
    try:
        summary = launch.run_distributed(args, lc.node_processes, where, check=followers.problem)
    except launch.LearnersExited as e:
        blame = followers.stopped(grace_s=3 * _beat_interval(lc))
        if blame:  # their processes end with this node's, whichever failed first: both said
            raise StageError(f"{blame}; node 0's processes exited with it (their output is in this log)") from e
        raise
    while not followers.all_done():  # their uploads
        problem = followers.problem()
        if problem:
            raise StageError(problem)
        time.sleep(POLL_S)
    return {**summary, "nodes": lc.nodes}


def _beat_interval(lc: LearnConfig) -> float:
    """How often a node beats: often enough that node_timeout_s sees a few beats."""
    return min(heartbeat_interval_s(), lc.node_timeout_s / 4)


# ---------------------------------------------------------------- nodes 1..N-1


class Leader:
    """Node r's view of node 0: its attempt's heartbeat (closed: it failed; gone: removed) and commit."""

    def __init__(self, storage: Storage, attempt_dir: str, lc: LearnConfig):
        self.storage, self.attempt_dir, self.lc = storage, attempt_dir, lc
        self.beat = Watched(storage, f"{attempt_dir}/{HEARTBEAT_NAME}")

    def problem(self) -> str | None:
        """The line saying node 0 is gone; None while it lives (or committed)."""
        uri = self.storage.uri(self.attempt_dir)
        beat = self.beat.read()
        if beat is None:  # committed (its heartbeat goes), or removed: gone for a few polls
            if is_committed(self.storage, self.attempt_dir) or self.beat.quiet_s() < 5 * POLL_S:
                return None
            return f"learn: node 0's attempt {uri} was removed"
        if "closed_at" in beat:
            return f"learn: node 0 ({beat.get('host')}) closed its attempt {uri} without a commit: its log says why"
        if self.beat.quiet_s() > self.lc.node_timeout_s + 2 * float(beat.get("interval_s", 30)):
            return f"learn: node 0 ({beat.get('host')}) went silent: the heartbeat of {uri} stopped"
        return None


def find_rendezvous(storage: Storage, run_id: str, iteration: int, node_rank: int, identity: str, lc: LearnConfig):
    """(attempt folder, rendezvous) of node 0's live attempt with this identity, waiting for it up to
    learn.node_timeout_s."""
    sdir = stage_dir(storage, run_id, iteration, "learn")
    deadline = time.monotonic() + lc.node_timeout_s
    while True:
        for name in reversed(list_attempts(storage, sdir)):
            attempt = f"{sdir}/{name}"
            found = _read_json(storage, f"{attempt}/{RENDEZVOUS}")
            if not found or found.get("identity") != identity or is_committed(storage, attempt):
                continue
            beat = _read_json(storage, f"{attempt}/{HEARTBEAT_NAME}")
            if beat is None or "closed_at" in beat:  # node 0 failed, or its attempt went
                continue
            if storage.exists(report_path(attempt, node_rank)) or storage.exists(beat_path(attempt, node_rank)):
                raise StageError(f"learn: node {node_rank} already joined {storage.uri(attempt)}; start each node once")
            if (found["nodes"], found["processes_per_node"]) != (lc.nodes, lc.node_processes):
                raise StageError(
                    f"learn: node 0 runs {found['nodes']} nodes x {found['processes_per_node']} processes, this node's "
                    f"run.json says {lc.nodes} x {lc.node_processes}; start every node with the same config"
                )
            return attempt, found
        if time.monotonic() > deadline:
            raise StageError(
                f"learn: node {node_rank} found no live attempt of node 0 (`grpo stage learn --run {run_id} "
                f"--iteration {iteration}`, or the flow) with the same inputs within "
                f"learn.node_timeout_s={lc.node_timeout_s:g}"
            )
        time.sleep(POLL_S)


def upload(storage: Storage, local_dir: str, attempt_dir: str) -> list[str]:
    """Copy what this node's ranks wrote into node 0's attempt; their names, which no other rank writes."""
    names = []
    for p in sorted(Path(local_dir).rglob("*")):
        if p.is_file():
            name = p.relative_to(local_dir).as_posix()
            if is_local(storage.fs):
                storage.fs.makedirs(f"{attempt_dir}/{name}".rsplit("/", 1)[0], exist_ok=True)
            storage.fs.put_file(str(p), f"{attempt_dir}/{name}")
            names.append(name)
    return names


def check_rank(lc: LearnConfig, node_rank: int) -> None:
    if not 0 < node_rank < lc.nodes:
        raise StageError(
            f"learn: --node-rank {node_rank}: with learn.nodes={lc.nodes} nodes 1..{lc.nodes - 1} join node 0 "
            "(the learn stage itself, run without --node-rank)"
        )


def join(
    storage: Storage,
    run_id: str,
    iteration: int,
    node_rank: int,
    lc: LearnConfig,
    identity: str,
    prepare: Callable[[str, str], dict],
    force: bool = False,
) -> Committed:
    """Node r >= 1: find node 0's live attempt of this identity, run this node's processes to its address,
    upload what they wrote, report, and return the attempt once node 0 committed it. `prepare(tmp,
    out_dir)` reads the inputs as node 0 does and returns launch.learner_args'."""
    sdir = stage_dir(storage, run_id, iteration, "learn")
    if not force and (done := find_committed(storage, sdir, identity, verify=False)):
        log.info("learn iteration %d: node %d: already committed %s", iteration, node_rank, done.uri)
        return done
    attempt, found = find_rendezvous(storage, run_id, iteration, node_rank, identity, lc)
    log.info(
        "learn iteration %d: node %d joins %s at %s:%d", iteration, node_rank, attempt, found["addr"], found["port"]
    )
    me = {"host": socket.gethostname(), "pid": os.getpid(), "node_rank": node_rank}
    beat_dir = beat_path(attempt, node_rank).rsplit("/", 1)[0]
    if is_local(storage.fs):
        storage.fs.makedirs(beat_dir, exist_ok=True)
    beat = Heartbeat(storage, beat_dir, me, _beat_interval(lc))
    leader = Leader(storage, attempt, lc)
    where = launch.Rendezvous(found["addr"], found["port"], lc.nodes, node_rank, lc.node_timeout_s)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out_dir = f"{tmp}/out"
            os.makedirs(out_dir)
            launch.run_distributed(prepare(tmp, out_dir), lc.node_processes, where, check=leader.problem)
            files = upload(storage, out_dir, attempt)
    except BaseException as e:
        beat.stop(then="remove")
        error = (str(e).splitlines() or [type(e).__name__])[0][:400].rstrip(":")  # the first line: what failed
        try:
            _write_json(storage, report_path(attempt, node_rank), {**me, "state": "failed", "error": error})
        except Exception as why:  # node 0 then finds this node silent
            log.warning("learn: node %d could not report its failure: %s", node_rank, why)
        raise
    beat.stop(then="remove")
    _write_json(storage, report_path(attempt, node_rank), {**me, "state": "done", "files": files})
    while not is_committed(storage, attempt):  # node 0 commits once every node is done
        problem = leader.problem()
        if problem:
            raise StageError(problem)
        time.sleep(POLL_S)
    manifest, sha = load_manifest(storage, attempt, verify=False)
    return Committed(storage, attempt, manifest, sha)
