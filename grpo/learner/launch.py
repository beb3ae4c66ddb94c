"""Starting learner processes: torchrun on this machine, one process per device (gloo on CPU, NCCL on
GPUs), each running `grpo.learner.rank`, the same update code as one process runs in-process.

stages/learn.py writes the arguments (config, batch, checkpoint folders, output folder) to a file, calls
`run_distributed`, and commits what rank 0 and the others wrote once every process has exited cleanly.
On Linux torchrun dies with the process that started it and every rank with torchrun (PR_SET_PDEATHSIG), so
a stage killed by SIGKILL leaves no learner behind holding a GPU; a rank killed by a signal is named in the
error, not only the network error its peers saw.
With learn.nodes > 1 this machine is one node of several (`Rendezvous`); grpo/learner/nodes.py has them meet.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from grpo.config import RunConfig
from grpo.errors import StageError
from grpo.progress import TO_STDOUT, relay
from grpo.runtime.procs import free_port, stop_group, tied_to_this_process

log = logging.getLogger("grpo.learner")

WORKER_ENV_DEFAULTS = {
    "OMP_NUM_THREADS": "1",
    # glibc: blocks over 128 KiB from mmap, returned on free. Its default raises the threshold to the largest
    # block freed so far, so FSDP2's per-layer gather buffers stay resident and a CPU rank peaked above a
    # DDP rank (benchmarks/RESULTS.md, "Learner memory and bytes": 1416 vs 858 MiB a rank with it)
    "MALLOC_MMAP_THRESHOLD_": "131072",
}
"""The learner processes' environment where this one does not set these."""


LAUNCHER_PID = "GRPO_LEARNER_LAUNCHER_PID"
"""The environment variable that tells a rank which process (torchrun) it must not outlive."""


class LearnersExited(StageError):
    """torchrun ended with an error (a rank failed, or a peer on another node went away)."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the nodes of one learner meet: torchrun's static rendezvous, whose store node 0 hosts at
    addr:port; node r's local rank i is global rank r x processes_per_node + i."""

    addr: str
    port: int
    nodes: int
    node_rank: int
    timeout_s: float

    def torchrun_args(self) -> list[str]:
        return [
            f"--nnodes={self.nodes}",
            f"--node_rank={self.node_rank}",
            f"--master_addr={self.addr}",
            f"--master_port={self.port}",
            f"--rdzv_conf=timeout={int(self.timeout_s) + 60}",  # past node_timeout_s: the nodes' watch speaks first
        ]


def learner_args(
    cfg: RunConfig,
    run_id: str,
    iteration: int,
    batch,
    folders: dict,
    out_dir: str,
    tmp: str,
    state_out: str | None = None,
) -> dict:
    """What `worker_main` reads: the config, the batch (saved into `tmp`), the checkpoint folders a Learner
    is built from (learn.checkpoint_folders), where to write the policy and the resume state (out_dir where
    state_out is None), and where rank 0 leaves its summary."""
    torch.save(batch, f"{tmp}/batch.pt")
    return {
        "config": cfg.to_dict(),
        "run_id": run_id,
        "iteration": iteration,
        "batch": f"{tmp}/batch.pt",
        **folders,
        "out_dir": out_dir,
        "state_out": state_out,
        "summary": f"{tmp}/summary.json",
    }


def run_distributed(
    args: dict, nproc: int, rendezvous: Rendezvous | None = None, check: Callable[[], str | None] | None = None
) -> dict | None:
    """Run `train` under torchrun, on this machine alone or as one node of `rendezvous`; forward its output
    lines to the log. `check()` is asked every second while it runs: a problem it names (another node
    failed) stops the processes and fails with that line. Returns rank 0's summary (None on another node)."""
    learners = Torchrun(args, nproc, rendezvous)
    learners.finish(check)
    return learners.summary()


class Torchrun:
    """torchrun and its ranks running `grpo.learner.rank` on `args`, started here; `until_ready` waits for the
    policy only (the ranks go on writing their optimizer shards, args["ready"]), `finish` for the end."""

    def __init__(self, args: dict, nproc: int, rendezvous: Rendezvous | None = None):
        self.args = args
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(args, f)
        self.args_file = f.name
        where = (
            rendezvous.torchrun_args() if rendezvous else ["--master_addr=127.0.0.1", f"--master_port={free_port()}"]
        )
        cmd = [sys.executable, "-m", "grpo.learner.launch", f"--nproc_per_node={nproc}", *where]  # torchrun
        self.proc = subprocess.Popen(
            [*cmd, "-m", "grpo.learner.rank", f.name],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**WORKER_ENV_DEFAULTS, **os.environ, TO_STDOUT: "1"},
            start_new_session=True,  # stop_group ends torchrun and its workers together
            preexec_fn=tied_to_this_process(signal.SIGTERM),  # this process killed: torchrun stops its ranks
        )
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self.cause: list[str] = []  # the last exception line a worker printed
        self.killed: dict[int, str] = {}  # rank -> torchrun's line on the signal that ended it
        self.reader = threading.Thread(
            target=_forward, args=(self.proc, self.tail, self.cause, self.killed), daemon=True
        )
        self.reader.start()

    def until_ready(self, check: Callable[[], str | None] | None = None) -> None:
        """Wait until rank 0 says the policy, tables and summary are written (args["ready"] exists) or torchrun
        ends; a failure before that raises as `finish` does, and stops the processes."""
        ready = Path(self.args["ready"])
        self.finish(check, until=ready.exists)

    def finish(self, check: Callable[[], str | None] | None = None, until: Callable[[], bool] | None = None) -> None:
        """Wait for torchrun to end (or, with `until`, for that to hold while it runs); a rank's failure, or a
        problem `check()` names, stops the processes and raises LearnersExited (StageError) with its line."""
        try:
            while self.proc.poll() is None:
                if until is not None and until():
                    return
                try:
                    self.proc.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    problem = check() if check else None
                    if problem:
                        raise StageError(problem)
        except BaseException:
            self.stop()
            raise
        if until is not None and until():  # it held before the end (a rank lost after it): finish() says the rest
            return
        self.stop()
        if self.proc.returncode != 0:
            raise LearnersExited(self._failure())

    def stop(self) -> None:
        """End torchrun and its ranks where they still run, and forget the arguments' file."""
        if self.proc.poll() is None:
            stop_group(self.proc, grace_s=10)
        self.reader.join(timeout=10)
        Path(self.args_file).unlink(missing_ok=True)

    def summary(self) -> dict | None:
        """Rank 0's summary (None on a node other than 0)."""
        summary = Path(self.args["summary"])
        return json.loads(summary.read_text()) if summary.exists() else None

    def _failure(self) -> str:
        why = f" ({self.cause[-1][:300]})" if self.cause else ""
        # torchrun SIGTERMs the survivors of a failed rank: a SIGTERM is news only where no rank said why
        first = {r: line for r, line in self.killed.items() if "SIGTERM" not in line} or (
            {} if self.cause else self.killed
        )
        if first:  # the others' errors (a peer's closed connection) follow from it
            ranks = "; ".join(f"rank {r} was killed: {line}" for r, line in sorted(first.items()))
            why = f": {ranks}" + (f"; then {self.cause[-1][:200]}" if self.cause else "")
        return f"learn under torchrun exited with {self.proc.returncode}{why}:\n{''.join(self.tail)}"


# a traceback's last line, e.g. "torch.OutOfMemoryError: CUDA out of memory. ..."; not torchrun's own summary; or
# what C++ prints before it aborts (SIGABRT): "terminate called after throwing ...", "  what():  <its message>"
EXCEPTION_LINE = re.compile(
    r"^(?:\[rank\d+\]:\s*)?(?:(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt)\b(?::.*)?|terminate called .*|what\(\):.*)$"
)


# torchrun's failure report of a rank (torch.distributed.elastic.multiprocessing.errors):
#   rank      : 1 (local_rank: 1)
#   exitcode  : -9 (pid: 4242) (SIGKILL)
#   traceback : Signal 9 (SIGKILL) received by PID 4242
FAILED_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\b")
SIGNAL_EXIT = re.compile(r"^\s*exitcode\s*:\s*-(\d+)\b")
SIGNAL_TRACEBACK = re.compile(r"^\s*traceback\s*:\s*(Signal \d+ .*received by PID \d+)")


def _forward(proc: subprocess.Popen, tail: collections.deque, cause: list[str], killed: dict[int, str]) -> None:
    rank, signalled = None, None
    for line in proc.stdout:
        if relay(line):  # rank 0's progress
            continue
        log.info("learn[torchrun] %s", line.rstrip())
        tail.append(line)
        if EXCEPTION_LINE.match(line.strip()) and "ChildFailedError" not in line:
            cause.append(line.strip())
        if m := FAILED_RANK.match(line):
            rank, signalled = int(m[1]), None
        elif (m := SIGNAL_EXIT.match(line)) and rank is not None:
            signalled = _signal_name(int(m[1]))
            killed.setdefault(rank, f"{signalled} (exitcode -{m[1]})")
        elif (m := SIGNAL_TRACEBACK.match(line)) and rank is not None and signalled:
            killed[rank] = m[1]  # "Signal 9 (SIGKILL) received by PID 4242"


def _signal_name(number: int) -> str:
    """SIGKILL for 9; "signal 99" for a number no signal has."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def torchrun_main() -> None:
    """torchrun, with its pid in its ranks' environment (LAUNCHER_PID) so that each dies with it
    (grpo.learner.rank); `python -m grpo.learner.launch` takes torchrun's arguments."""
    os.environ[LAUNCHER_PID] = str(os.getpid())
    from torch.distributed.run import main

    main()


if __name__ == "__main__":
    torchrun_main()
