"""The supervised process pool reward functions run in: each worker has its own pipe, process sentinel and a
shared progress record (sample, function, since when), so the parent sees a death the moment it happens and
names it, kills a sample past its alarm and replaces only that worker; what workers print goes to a file per
worker. Each worker is its own process group and (Linux) a subreaper: what a job starts and leaves running is
killed as the job ends and counted (`left_running`), as is what a killed worker's job started. Workers start
without the stage's credentials, whose values are redacted from what they send back and
print (grpo/runtime/secrets.py). `WARM_POOLS` keeps pools between a warm run's stages. What a job does:
grpo/scoring/score.py.
"""

from __future__ import annotations

import fcntl
import logging
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import connection
from typing import Any, Sequence

from grpo.runtime import secrets
from grpo.runtime.procs import become_subreaper, ends_with, kill_descendants, mapped_at_start

log = logging.getLogger("grpo.scoring")

_PRINTED_KEEP = 4096  # bytes of what reward functions print that one scoring logs
LOADING, IDLE = -2.0, -1.0  # a worker's progress[0] when it is not scoring a sample (its index in the job)


# ---------------------------------------------------------------- the worker pool
#
# Why a pool of our own. multiprocessing.Pool replaces a worker that dies but loses its job without a
# word: the parent waits for the job's whole timeout, then knows only that it hung. concurrent.futures'
# ProcessPoolExecutor notices the death (BrokenProcessPool), but then the whole executor is broken: every
# pending job fails with it, it cannot say which sample and function were running or how the worker
# ended, and it cannot stop one job hung in C code (a running future cannot be cancelled). Here each
# worker has its own pipe, its process sentinel and a shared progress record (sample, function, since
# when), and the parent waits on all of them at once (multiprocessing.connection.wait): a death is seen
# the moment it happens and named, a sample past its alarm is killed, and only that worker is replaced.

_PROGRESS: Any = [IDLE, 0.0, 0.0]  # this worker's record (where, function, since); a list outside a worker
_CONN: Any = None  # this worker's pipe to the parent; None outside a worker
_PARENT_FDS: set[int] = set()  # this process's ends of its workers' pipes and files: a new worker closes them
_KEEP_CHILDREN = False  # in a worker: what jobs started stays running past the job (an episode's environment)


def _worker_init() -> None:
    """A forked worker drops the handlers it inherited (Prefect's SIGTERM handler would report the
    parent's task as crashed when a worker is stopped), then takes SIGTERM again."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _worker_main(conn, progress, out: int, pass_env: tuple[str, ...], parent: int) -> None:
    """A worker: runs the (fn, args) jobs `conn` brings, answers ("done", result) or ("failed", error
    line); meanwhile a job may tell the parent of samples that erred (`_tell`).

    It starts without the stage's credentials (grpo/runtime/secrets.py; `pass_env` names those it keeps), and ends
    once `parent`, the process that forked it, is gone.
    Its stdout and stderr go to the file `out`, which the parent reads and empties after each job. It
    closes the parent's ends of the other workers' pipes, so that when the parent dies every worker
    reads EOF and ends.
    """
    global _PROGRESS, _CONN
    _worker_init()
    secrets.remove_credentials(pass_env)
    os.setpgid(0, 0)  # its own process group, and (Linux) every process its jobs start stays below it
    become_subreaper()
    ends_with(parent)  # a stage SIGKILLed: its job would run on, a function starting a process a sample
    _PROGRESS, _CONN = progress, conn
    mapped_at_start()  # what reward.max_memory_mb is counted from
    os.dup2(out, 1)
    os.dup2(out, 2)
    for fd in _PARENT_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    sys.stdout = sys.stderr = open(1, "w", closefd=False, errors="backslashreplace")
    try:
        while (job := _next_job(conn)) is not None:
            fn, args = job
            try:
                reply = ("done", fn(*args))
            except Exception as e:  # noqa: BLE001 (said to the parent; SystemExit ends the worker, as asked)
                reply = ("failed", f"{type(e).__name__}: {e}")
            sys.stdout.flush()
            if not _KEEP_CHILDREN and (left := _end_leftovers()):
                conn.send(("left", left))
            conn.send(reply)
    finally:  # asked to stop, the parent gone (EOF, a broken pipe), a SystemExit: nothing left behind
        _end_leftovers()


def _next_job(conn):
    """The next (fn, args) from the parent; None when asked to stop or the parent is gone."""
    try:
        return conn.recv()
    except EOFError:
        return None


def _end_leftovers() -> int:
    """Kill what this worker's job started and left running (a subreaper, it finds them however they
    detached), reap them; returns how many there were."""
    left = kill_descendants(os.getpid(), group=True)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:  # the killed (and what had exited unwaited for) leave no zombie
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                if not left:
                    break
                time.sleep(0.01)
        except ChildProcessError:
            break
    return left


def keep_children(keep: bool) -> None:
    """In a worker: keep what its jobs start running after each job while `keep` (environments that live across the
    jobs of their episode: grpo/episodes/workers.py); the first job to end with it False kills them all."""
    global _KEEP_CHILDREN
    _KEEP_CHILDREN = keep


def progress_record() -> Any:
    """This worker's shared progress record [where, function, since]: `where` the job's sample being scored
    (or LOADING, IDLE), `function` the index of the reward function running, `since` when it began."""
    return _PROGRESS


def tell(samples: list[int], error: str) -> None:
    """Tell the parent now that these samples of the job erred, so that it can stop the scoring before
    the job ends (a job of 256 samples that each time out takes 43 minutes at the defaults)."""
    if _CONN is not None:
        _CONN.send(("erred", (samples, error)))


def exit_text(code: int) -> str:
    """How a worker process ended, from its exit code (negative: the signal that killed it).

    >>> exit_text(3), exit_text(-9), exit_text(-11)
    ('exit code 3', 'killed by SIGKILL (out of memory?)', 'killed by SIGSEGV')
    """
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"killed by {name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")


@dataclass(eq=False)
class _Worker:
    process: Any  # multiprocessing Process (fork)
    conn: Any  # the parent's end of its pipe
    progress: Any  # shared doubles (where, function, since): where is a sample's index in the job, LOADING or IDLE
    out: int  # the file its stdout and stderr go to
    job: Any = None  # the caller's tag of what it was sent, until it answers or is replaced


class RewardPool:
    """Worker processes forked from this one, each watched by the parent (see the note above); they start
    without this process's credentials but those named in `pass_env` (reward.pass_env), and what they
    answer or print reaches the caller and the log with the values of all of them redacted."""

    def __init__(self, workers: int, pass_env: tuple[str, ...] = (), role: str = "reward"):
        self.workers: list[_Worker] = []
        self.pass_env, self.role = tuple(pass_env), role  # role: what its messages call a worker ("tool")
        self.secrets: dict[str, str] = {}  # value -> name of each credential, kept from the workers or passed
        self.left_running = 0  # processes its jobs left running (killed), since the pool started
        self.printed, self.printed_head = 0, b""  # what workers printed since the last log, its first bytes
        try:
            for _ in range(workers):
                self.workers.append(self._spawn())
        except BaseException:
            self.terminate()
            raise

    def _spawn(self) -> _Worker:
        """A new worker; SIGTERM stays blocked from the fork until `_worker_init` restored its default
        action (a worker stopped as it starts would otherwise handle it the parent's way and live on)."""
        ctx = mp.get_context("fork")
        self.secrets = {**self.secrets, **secrets.secret_values(os.environ, self.pass_env)}
        parent, child = ctx.Pipe()
        progress = ctx.RawArray("d", [IDLE, 0.0, 0.0])
        out = _output_file()
        _PARENT_FDS.update((parent.fileno(), out))
        for stream in (sys.stdout, sys.stderr):  # else the worker's copy of their buffers lands in its file
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        args = (child, progress, out, self.pass_env, os.getpid())
        process = ctx.Process(target=_worker_main, args=args, daemon=True)
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
            child.close()
        return _Worker(process, parent, progress, out)

    def idle(self) -> list[_Worker]:
        """Workers without a job; one that died idle (a thread of a reward function, a signal) is replaced."""
        for w in [w for w in self.workers if w.job is None and not w.process.is_alive()]:
            log.warning("a %s worker ended between jobs (%s); starting another", self.role, self.replace(w))
        return [w for w in self.workers if w.job is None]

    def busy(self) -> list[_Worker]:
        return [w for w in self.workers if w.job is not None]

    def submit(self, w: _Worker, fn, args: tuple, tag: Any = True) -> None:
        w.job = tag
        w.progress[0] = IDLE
        w.conn.send((fn, args))

    def wait(self, timeout: float | None) -> list[tuple[_Worker, Any, str, Any]]:
        """Waits up to `timeout` s for busy workers to say something or die: (worker, its job's tag,
        kind, payload) for each message, kind "done" or "failed" (the worker is idle again), "erred"
        (samples that erred, the job goes on) or "died" (the caller replaces the worker)."""
        busy = self.busy()
        ready = set(connection.wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout))
        events = []
        for w in busy:
            if w.conn not in ready and w.process.sentinel not in ready:
                continue
            job, died = w.job, False
            try:
                while w.job is not None and w.conn.poll():
                    kind, payload = w.conn.recv()
                    if kind == "left":  # what the job left running, killed as it ended
                        self.left_running += payload
                        continue
                    events.append((w, job, kind, secrets.redact(payload, self.secrets)))
                    if kind != "erred":
                        w.job = None
                        self._collect(w)
            except (EOFError, OSError):  # it died, perhaps as it answered
                died = True
            if w.job is not None and (died or not w.process.is_alive()):
                events.append((w, job, "died", None))
        return events

    def apply(self, fn, args: tuple = (), timeout: float | None = None):
        """fn(*args) in an idle worker (a warm pool's pid, a check); raises RuntimeError if it fails, kills the
        worker or runs past `timeout` s (the worker is then replaced)."""
        w = self.idle()[0]
        self.submit(w, fn, args)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self.replace(w)
                raise RuntimeError(f"{self.role} worker gave no answer within {timeout:g} s")
            for _, _, kind, payload in self.wait(left):
                if kind == "died":
                    raise RuntimeError(f"{self.role} worker died: {self.replace(w)}")
                if kind == "failed":
                    raise RuntimeError(payload)
                if kind == "done":
                    return payload

    def replace(self, w: _Worker) -> str:
        """Kill `w` if it lives, start another in its place; returns how `w` ended."""
        i = self.workers.index(w)
        how = self._retire(w)
        self.workers[i] = self._spawn()
        return how

    def _retire(self, w: _Worker) -> str:
        # what its job started first: once the worker is gone they would be init's (or their group's alone)
        self.left_running += kill_descendants(w.process.pid, group=True)
        w.process.kill()  # SIGKILL: a hung worker ignores the rest; a dead one is not signalled again
        w.process.join()
        self._collect(w)
        _PARENT_FDS.difference_update((w.conn.fileno(), w.out))
        w.conn.close()
        os.close(w.out)
        return exit_text(w.process.exitcode)

    def _collect(self, w: _Worker) -> None:
        """Take what `w` printed: count it, keep the first _PRINTED_KEEP bytes, empty its file."""
        size = os.fstat(w.out).st_size
        if not size:
            return
        keep = _PRINTED_KEEP - len(self.printed_head)
        if keep > 0:
            self.printed_head += os.pread(w.out, min(keep, size), 0)
        self.printed += size
        os.ftruncate(w.out, 0)

    def log_printed(self) -> None:
        """Log what the workers printed since the last call, once, cut to _PRINTED_KEEP bytes."""
        if not self.printed:
            return
        text = secrets.redact_cut(self.printed_head.decode(errors="backslashreplace"), self.secrets)
        more = self.printed - len(self.printed_head)
        note = f"\n[... {more} more bytes not shown]" if more > 0 else ""
        log.warning("reward functions printed %d bytes:\n%s%s", self.printed, text, note)
        self.printed, self.printed_head = 0, b""

    def terminate(self) -> None:
        """Kill every worker, and what its jobs started, and wait for it (nothing a reward function holds needs
        cleaning up)."""
        before = self.left_running
        while self.workers:
            self._retire(self.workers.pop())
        if self.left_running > before:
            log.warning("reward functions left %d processes running at close; killed", self.left_running - before)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.terminate()


def _output_file() -> int:
    """An unlinked temporary file opened for appending: a worker's stdout and stderr."""
    fd, path = tempfile.mkstemp(prefix="grpo-reward-out-")
    os.unlink(path)
    # appending: after the parent empties the file, the worker's next write lands at 0, not past a hole
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
    return fd


def _fork_pool(workers: int, pass_env: tuple[str, ...] = (), role: str = "reward") -> RewardPool:
    return RewardPool(workers, pass_env, role)


class _WarmPools:
    """Worker pools kept between rewards stages while `keep()` is active (flow grpo's warm iterations).

    Forking a pool costs more the bigger the parent (page tables, copy-on-write as the workers run);
    a warm run forks once. Outside `keep()` every stage forks its own pool and closes it, so a
    reward function changed in this process (a notebook, a test's patch) is what the next stage runs.
    """

    def __init__(self):
        self.active, self._pools = False, {}

    @contextmanager
    def keep(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False
            while self._pools:
                self._pools.popitem()[1].terminate()

    @contextmanager
    def pool(self, workers: int, pass_env: Sequence[str] = (), role: str = "reward"):
        """A pool of `workers` processes keeping the credentials `pass_env` names (reward.pass_env); `role` names
        them in its messages ("tool": rollout.tool_workers)."""
        key = (workers, tuple(pass_env), role)
        if not self.active:
            with _fork_pool(*key) as pool:
                yield pool
            return
        if key not in self._pools:
            self._pools[key] = _fork_pool(*key)
        try:
            yield self._pools[key]
        except BaseException:  # a hung or broken worker must not serve the next stage
            self._pools.pop(key).terminate()
            raise


WARM_POOLS = _WarmPools()
