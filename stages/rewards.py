"""Stage 3: score every rollout with the task's verifiable reward, or the user's functions.

`reward.functions` replace the task's reward: they are loaded from the run's base commit
(a file is copied there at `grpo init`) or imported by module name, and get each sample's
dataset row as keyword arguments (grpo.tasks.functions).

Rewards run in worker processes the stage watches (RewardPool); each sample has a time limit. A
response cut off at max_tokens scores `reward.truncated_reward` when that is set (an unfinished
answer is not an answer; without it a policy that never emits eos is never shown that stopping
after the answer pays); with `reward.overlong_buffer` a response within that many tokens of max_tokens
loses a share of `reward.overlong_penalty` growing linearly with its length (DAPO), recorded as the
component `overlong`. An exception, a timeout, a MemoryError past `reward.max_memory_mb`, a
function that ignores its alarm or a worker that dies (os._exit, a signal, the OOM killer) is
recorded in the `error` column with reward 0, naming the function; a hung or dead worker is
replaced at once; and the stage fails (committing nothing) as soon as more than
`max_error_fraction` of its samples erred. What reward functions print goes to a file per worker:
the log shows its first few KB once per scoring. A mean reward that is not finite (rewards whose
sum overflows float64) is refused, naming the function.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import math
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import connection
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq

from grpo.checkpoint import local_checkpoint
from grpo.config import RewardConfig, RunConfig, identity_section
from grpo.progress import progress
from grpo.storage import Committed, Storage
from grpo.tasks import functions
from schemas import ParquetWriter, iter_batches, table_file
from stages.common import StageError, check_chain, committed_input, load_run
from stages.shards import ranges, run_sharded

log = logging.getLogger("grpo.stages")

_JOBS_PER_WORKER = 4  # a batch is split into about this many pool jobs per worker
_MIN_CHUNK = 64  # samples; smaller jobs cost more in pickling and wake-ups than they score
_MAX_CHUNK = 256  # samples; bounds what a dead worker's job costs to score again
_GRACE_S = 1.0  # how long past its alarm a sample may run before the parent kills its worker
_LOAD_TIMEOUT_S = 300.0  # for a worker to build the scorer (import the reward modules)
_PRINTED_KEEP = 4096  # bytes of what reward functions print that one scoring logs
_LOADING, _IDLE = -2.0, -1.0  # a worker's progress[0] when it is not scoring a sample (its index in the job)


class _Timeout(BaseException):
    """The sample's alarm; not an Exception, so a reward function's `except Exception` does not swallow it."""


def _alarm(signum, frame):
    raise _Timeout()


def scorer_key(cfg: RunConfig, base: Committed | None) -> tuple:
    """Plain values a pool worker builds the run's scorer from (functions.cached): the task, or the
    reward functions with the local paths of the files committed in `base`."""
    specs = tuple(cfg.reward.functions)
    files: list[str | None] = [None] * len(specs)
    if any(functions.is_file_spec(s) for s in specs):
        folder = local_checkpoint(base, prefix=functions.REWARD_PREFIX)
        files = [
            f"{folder}/{functions.committed_name(i, s)[len(functions.REWARD_PREFIX) :]}"
            if functions.is_file_spec(s)
            else None
            for i, s in enumerate(specs)
        ]
    weights = tuple(cfg.reward.weights) if cfg.reward.weights else None
    return cfg.task.name, tuple(sorted(cfg.task.params.items())), specs, weights, tuple(files)


def function_names(key: tuple) -> list[str]:
    """The names of the functions a scorer_key scores with, in order: the task's, or the user's."""
    return functions.function_names(key[2]) if key[2] else [key[0]]


def score_one(
    scorer, response: str, ground_truth: str, prompt: str, row: dict, timeout_s: float, calling=None
) -> tuple:
    """(reward, components, error) of one sample; never raises (a reward function's SystemExit aside)."""
    signal.signal(signal.SIGALRM, _alarm)  # each sample: a function may have replaced the handler
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            components = scorer(response, ground_truth, prompt, row, calling)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        return components["total"], components, None
    except _Timeout:
        return 0.0, {}, f"timeout after {timeout_s}s"
    except Exception as e:  # noqa: BLE001 (a reward bug must not kill the stage)
        return 0.0, {}, f"{type(e).__name__}: {e}"


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

_PROGRESS: Any = [_IDLE, 0.0, 0.0]  # this worker's record (where, function, since); a list outside a worker
_CONN: Any = None  # this worker's pipe to the parent; None outside a worker
_PARENT_FDS: set[int] = set()  # this process's ends of its workers' pipes and files: a new worker closes them


def _worker_init() -> None:
    """A forked worker drops the handlers it inherited (Prefect's SIGTERM handler would report the
    parent's task as crashed when a worker is stopped), then takes SIGTERM again."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _worker_main(conn, progress, out: int) -> None:
    """A worker: runs the (fn, args) jobs `conn` brings, answers ("done", result) or ("failed", error
    line); meanwhile a job may tell the parent of samples that erred (`_tell`).

    Its stdout and stderr go to the file `out`, which the parent reads and empties after each job. It
    closes the parent's ends of the other workers' pipes, so that when the parent dies every worker
    reads EOF and ends.
    """
    global _PROGRESS, _CONN
    _worker_init()
    _PROGRESS, _CONN = progress, conn
    _mapped_at_start()  # what reward.max_memory_mb is counted from
    os.dup2(out, 1)
    os.dup2(out, 2)
    for fd in _PARENT_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    sys.stdout = sys.stderr = open(1, "w", closefd=False, errors="backslashreplace")
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        fn, args = job
        try:
            reply = ("done", fn(*args))
        except Exception as e:  # noqa: BLE001 (said to the parent; SystemExit ends the worker, as asked)
            reply = ("failed", f"{type(e).__name__}: {e}")
        sys.stdout.flush()
        conn.send(reply)


def _tell(samples: list[int], error: str) -> None:
    """Tell the parent now that these samples of the job erred, so that it can stop the scoring before
    the job ends (a job of 256 samples that each time out takes 43 minutes at the defaults)."""
    if _CONN is not None:
        _CONN.send(("erred", (samples, error)))


def _mapped_bytes() -> int:
    """This process's address space now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


@functools.cache
def _mapped_at_start() -> int:
    return _mapped_bytes()


def _cap_memory(max_memory_mb: int | None) -> None:
    """RLIMIT_AS of this worker: what it mapped as it started, inherited from the stage's process
    (torch alone maps gigabytes it never touches), plus `max_memory_mb`; an allocation past it raises
    MemoryError in the function. Only the soft limit: a later job with no cap lifts it."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = resource.RLIM_INFINITY if max_memory_mb is None else _mapped_at_start() + max_memory_mb * 2**20
    if hard != resource.RLIM_INFINITY and (cap == resource.RLIM_INFINITY or cap > hard):
        cap = hard
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


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
    progress: Any  # shared doubles (where, function, since): where is a sample's index in the job, _LOADING or _IDLE
    out: int  # the file its stdout and stderr go to
    job: Any = None  # the caller's tag of what it was sent, until it answers or is replaced


class RewardPool:
    """Worker processes forked from this one, each watched by the parent (see the note above)."""

    def __init__(self, workers: int):
        self.workers: list[_Worker] = []
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
        parent, child = ctx.Pipe()
        progress = ctx.RawArray("d", [_IDLE, 0.0, 0.0])
        out = _output_file()
        _PARENT_FDS.update((parent.fileno(), out))
        for stream in (sys.stdout, sys.stderr):  # else the worker's copy of their buffers lands in its file
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        process = ctx.Process(target=_worker_main, args=(child, progress, out), daemon=True)
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
            log.warning("a reward worker ended between jobs (%s); starting another", self.replace(w))
        return [w for w in self.workers if w.job is None]

    def busy(self) -> list[_Worker]:
        return [w for w in self.workers if w.job is not None]

    def submit(self, w: _Worker, fn, args: tuple, tag: Any = True) -> None:
        w.job = tag
        w.progress[0] = _IDLE
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
                    events.append((w, job, kind, payload))
                    if kind != "erred":
                        w.job = None
                        self._collect(w)
            except (EOFError, OSError):  # it died, perhaps as it answered
                died = True
            if w.job is not None and (died or not w.process.is_alive()):
                events.append((w, job, "died", None))
        return events

    def apply(self, fn, args: tuple = ()):
        """fn(*args) in an idle worker (a warm pool's pid, a check); raises RuntimeError if it fails."""
        w = self.idle()[0]
        self.submit(w, fn, args)
        while True:
            for _, _, kind, payload in self.wait(None):
                if kind == "died":
                    raise RuntimeError(f"reward worker died: {self.replace(w)}")
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
        text = self.printed_head.decode(errors="backslashreplace")
        more = self.printed - len(self.printed_head)
        note = f"\n[... {more} more bytes not shown]" if more > 0 else ""
        log.warning("reward functions printed %d bytes:\n%s%s", self.printed, text, note)
        self.printed, self.printed_head = 0, b""

    def terminate(self) -> None:
        """Kill every worker and wait for it (nothing a reward function holds needs cleaning up)."""
        while self.workers:
            self._retire(self.workers.pop())

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


def _fork_pool(workers: int) -> RewardPool:
    return RewardPool(workers)


def _score_chunk(key: tuple, timeout_s: float, max_memory_mb: int | None, items: list[tuple[str, str, str, dict]]):
    """Score `items` in a worker, keeping its progress record current for the parent's watchdog."""
    progress = _PROGRESS
    progress[2], progress[1], progress[0] = time.monotonic(), 0, _LOADING
    _cap_memory(max_memory_mb)
    try:
        scorer = functions.cached(*key)
    except Exception as e:  # noqa: BLE001 (a reward module failing to load fails every sample, said once)
        progress[0] = _IDLE
        _tell(list(range(len(items))), f"{type(e).__name__}: {e}")
        return [(0.0, {}, f"{type(e).__name__}: {e}")] * len(items)

    def calling(i: int) -> None:
        progress[1] = i

    out = []
    for j, item in enumerate(items):
        progress[2], progress[1], progress[0] = time.monotonic(), 0, j
        out.append(score_one(scorer, *item, timeout_s, calling))
        if max_memory_mb is not None and (out[-1][2] or "").startswith("MemoryError"):  # the cap, most likely
            detail = out[-1][2].removeprefix("MemoryError").strip(": ")
            said = f"MemoryError under reward.max_memory_mb={max_memory_mb}" + (f": {detail}" if detail else "")
            out[-1] = (*out[-1][:2], said)
        if out[-1][2] is not None:
            _tell([j], out[-1][2])
    progress[0] = _IDLE
    return out


def batch_items(batch) -> list[tuple[str, str, str, dict]]:
    """(response, ground_truth, prompt, row) of each sample of a rollouts record batch."""
    rows = [json.loads(r) for r in batch.column("row").to_pylist()]
    return list(
        zip(
            batch.column("response").to_pylist(),
            batch.column("ground_truth").to_pylist(),
            batch.column("prompt").to_pylist(),
            rows,
        )
    )


def score_batch(
    pool: RewardPool, key: tuple, cfg: RewardConfig, items: list[tuple[str, str, str, dict]], max_errors=None
) -> list:
    """Score samples (response, ground_truth, prompt, row) in the pool, in about `_JOBS_PER_WORKER`
    jobs per worker; returns (reward, components, error) per sample, in order.

    A worker that dies, or runs a sample `_GRACE_S` past its alarm, costs that sample (an error naming
    the function and how) and is replaced at once; the rest of its job is scored again. More than
    `max_errors` errors (None: no bound) stop the scoring at once with a StageError naming the first.
    """
    chunk = min(_MAX_CHUNK, max(_MIN_CHUNK, -(-len(items) // (_JOBS_PER_WORKER * cfg.workers))))
    todo = deque(list(range(i, min(i + chunk, len(items)))) for i in range(0, len(items), chunk))
    results: list = [None] * len(items)
    erred: dict[int, str] = {}  # sample -> its error, as soon as a worker tells it (a rescored sample once)
    names = function_names(key)

    def lost(job: list[int], where: int, error: str) -> None:  # sample job[where] erred; the rest go back
        results[job[where]] = (0.0, {}, error)
        erred.setdefault(job[where], error)
        if rest := job[:where] + job[where + 1 :]:
            todo.appendleft(rest)

    try:
        while todo or pool.busy():
            for w in pool.idle()[: len(todo)]:
                job = todo.popleft()
                pool.submit(w, _score_chunk, (key, cfg.timeout_s, cfg.max_memory_mb, [items[i] for i in job]), job)
            for w, job, kind, payload in pool.wait(_wait_s(pool, cfg.timeout_s)):
                if kind == "erred":
                    erred.update({job[j]: payload[1] for j in payload[0] if job[j] not in erred})
                elif kind in ("done", "failed"):
                    scored = payload if kind == "done" else [(0.0, {}, f"reward worker: {payload}")] * len(job)
                    for i, r in zip(job, scored):
                        results[i] = r
                        if r[2] is None:
                            erred.pop(i, None)
                        else:
                            erred.setdefault(i, r[2])
                else:  # died
                    where, fn, _ = w.progress[:]
                    how = pool.replace(w)
                    if where < 0:  # loading the functions, or between samples: no sample to blame
                        doing = f"loading {', '.join(names)}" if where == _LOADING else "between samples"
                        raise StageError(f"a reward worker died {doing}: {how}")
                    lost(job, int(where), f"reward worker died in {names[int(fn)]}: {how}")
            now = time.monotonic()
            for w in pool.busy():
                where, fn, since = w.progress[:]
                if where >= 0 and now - since > cfg.timeout_s + _GRACE_S:
                    pool.replace(w)
                    lost(
                        w.job,
                        int(where),
                        f"{names[int(fn)]} ran past its {cfg.timeout_s}s alarm (it ignored or blocked SIGALRM, "
                        "or hung in C code); its worker was killed",
                    )
                elif where == _LOADING and now - since > _LOAD_TIMEOUT_S:
                    raise StageError(f"a reward worker took over {_LOAD_TIMEOUT_S:g}s loading {', '.join(names)}")
            if max_errors is not None and len(erred) > max_errors:
                raise StageError(
                    f"rewards: {len(erred)} samples failed, more than the {max_errors} that "
                    f"reward.max_error_fraction={cfg.max_error_fraction} allows; scoring stopped at once; "
                    f"the first: {next(iter(erred.values()))}"
                )
    finally:
        pool.log_printed()
    return results


def _wait_s(pool: RewardPool, timeout_s: float) -> float:
    """How long the parent may wait for answers before a busy worker's sample (or load) is overdue; at
    most 1 s, so a worker that only just started a sample is looked at again soon."""
    due = [
        since + (timeout_s + _GRACE_S if where >= 0 else _LOAD_TIMEOUT_S)
        for where, _, since in (w.progress[:] for w in pool.busy())
        if where >= 0 or where == _LOADING
    ]
    return min([1.0] + [max(0.01, t - time.monotonic() + 0.01) for t in due])


def score_samples(
    pool: RewardPool,
    key: tuple,
    cfg: RunConfig,
    items: list,
    finish_reasons: list[str],
    lengths: list[int],
    max_errors=None,
) -> list:
    """(reward, components, error) of each sample as the rewards stage commits it: score_batch, then
    reward.truncated_reward and reward.overlong_buffer's shaping. The rollouts stage's dynamic sampling
    decides with this same code (stages.rollouts.sample_rounds)."""
    scored = score_batch(pool, key, cfg.reward, items, max_errors=max_errors)
    if cfg.reward.truncated_reward is not None:
        scored = [truncated(item, fr, cfg.reward.truncated_reward) for item, fr in zip(scored, finish_reasons)]
    if cfg.reward.overlong_buffer is not None:  # after truncated_reward: a cut-off response loses it too
        shaping = (cfg.rollout.max_tokens, cfg.reward.overlong_buffer, cfg.reward.overlong_penalty)
        scored = [overlong(item, n, *shaping) for item, n in zip(scored, lengths)]
    return scored


def allowed_errors(fraction: float, n: int) -> int:
    """The most errors among `n` samples with errors / n <= fraction (the stage's own test).

    >>> allowed_errors(0.05, 64), allowed_errors(0.29, 100), allowed_errors(0.0, 10), allowed_errors(1.0, 7)
    (3, 29, 0, 7)
    """
    e = math.floor(fraction * n)
    while e < n and (e + 1) / n <= fraction:
        e += 1
    while e > 0 and e / n > fraction:
        e -= 1
    return e


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment, added to the reward of a response of `length` tokens: 0 up to
    max_tokens - buffer tokens, then falling linearly to -penalty at max_tokens (and no further).

    >>> [overlong_penalty(n, max_tokens=10, buffer=4, penalty=1.0) for n in (3, 6, 7, 9, 10)]
    [0.0, 0.0, -0.25, -0.75, -1.0]
    """
    over = min(length - (max_tokens - buffer), buffer)
    return -penalty * over / buffer if over > 0 else 0.0


def overlong(scored: tuple, length: int, max_tokens: int, buffer: int, penalty: float) -> tuple:
    """A scored sample with overlong_penalty added to its reward and recorded as the component `overlong`
    (0 for a response short enough); a sample that erred keeps its reward 0."""
    reward, components, error = scored
    if error is not None:
        return scored
    term = overlong_penalty(length, max_tokens, buffer, penalty)
    return reward + term, {**components, "overlong": term}, error


def truncated(scored: tuple, finish_reason: str, value: float) -> tuple:
    """A response cut off at max_tokens is no answer: its reward becomes `value`.

    The task's components stay for audits, with `truncated` = 1 beside them.
    """
    reward, components, error = scored
    if finish_reason != "length":
        return reward, components, error
    return (value if error is None else reward), {**components, "truncated": 1.0}, error


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
    def pool(self, workers: int):
        if not self.active:
            with _fork_pool(workers) as pool:
                yield pool
            return
        if workers not in self._pools:
            self._pools[workers] = _fork_pool(workers)
        try:
            yield self._pools[workers]
        except BaseException:  # a hung or broken worker must not serve the next stage
            self._pools.pop(workers).terminate()
            raise


WARM_POOLS = _WarmPools()


def rewards(storage: Storage, run_id: str, iteration: int, force: bool = False, shard: int | None = None) -> Committed:
    """Score every sample; with reward.shards > 1, shard `shard` alone or every shard then their rows
    merged (stages.shards). A sample's reward depends on that sample alone, so 1 and N shards score the
    same rows."""
    cfg = load_run(storage, run_id)
    rollouts = committed_input(storage, run_id, iteration, "rollouts")
    inputs = {"rollouts": rollouts}
    if cfg.reward.functions:  # the committed copies of reward files, and their hashes in the identity
        inputs["base"] = committed_input(storage, run_id, None, "base")
    check_chain(storage, run_id, iteration, "rewards", inputs)
    path = rollouts.path(table_file("rollouts"))

    def score(writer, shard_k: int = 0) -> dict:
        with storage.fs.open(path, "rb") as f:
            rows = ranges(pq.ParquetFile(f).metadata.num_rows, cfg.reward.shards)[shard_k]
        n = n_err = 0
        total, biggest = 0.0, (0.0, {})  # the sum of the rewards; the largest in magnitude and its components
        allowed = allowed_errors(cfg.reward.max_error_fraction, len(rows))
        keys = ["run_id", "iteration", "prompt_id", "sample_index"]
        with (
            WARM_POOLS.pool(cfg.reward.workers) as pool,
            ParquetWriter(storage.fs, writer.path(table_file("rewards")), "rewards") as out,
        ):
            key = scorer_key(cfg, inputs.get("base"))
            for batch in batches_in(path, rows):
                finish = batch.column("finish_reason").to_pylist()
                lengths = pc.list_value_length(batch.column("response_ids")).to_pylist()
                scored = score_samples(pool, key, cfg, batch_items(batch), finish, lengths, allowed - n_err)
                cols = {k: batch.column(k).to_pylist() for k in keys}
                cols["reward"] = [r for r, _, _ in scored]
                cols["components"] = [list(c.items()) for _, c, _ in scored]
                cols["error"] = [e for _, _, e in scored]
                out.write(cols)
                n += len(scored)
                progress(f"rewards {iteration}" + (f" shard {shard_k}" if cfg.reward.shards > 1 else ""), n, len(rows))
                n_err += sum(e is not None for _, _, e in scored)
                total += sum(cols["reward"])
                biggest = max([biggest] + [(r, c) for r, c, _ in scored], key=lambda rc: abs(rc[0]))
        if n == 0:
            raise StageError(f"{rollouts.uri}: rollouts.parquet has no rows")
        if n_err / n > cfg.reward.max_error_fraction:
            raise StageError(
                f"rewards: {n_err}/{n} samples failed (> reward.max_error_fraction="
                f"{cfg.reward.max_error_fraction}); see the error column of an uncommitted "
                f"attempt under {storage.uri(writer.attempt_dir)}"
            )
        if not math.isfinite(total / n):  # each reward is finite (functions.components_of); their sum is not
            source = functions.reward_source(cfg.task.name, cfg.reward.functions, biggest[1])
            raise StageError(
                f"rewards: the mean reward is {total / n} (the rewards' sum overflows float64): {source} "
                f"returned {biggest[0]:.3g}; scale its rewards down (nothing was committed)"
            )
        return {"samples": n, "errors": n_err, "reward_mean": total / n}

    def batches_in(path: str, rows: range):
        """The rollouts' record batches of rows `rows` (at most 8192 rows each)."""
        at = 0
        for batch in iter_batches(storage.fs, path, "rollouts", batch_size=8192):
            lo, hi = max(rows.start - at, 0), min(rows.stop - at, batch.num_rows)
            if lo < hi:
                yield batch.slice(lo, hi - lo)
            at += batch.num_rows
            if at >= rows.stop:
                return

    return run_sharded(
        storage,
        run_id,
        iteration,
        "rewards",
        shards=cfg.reward.shards,
        setting="reward.shards",
        config=stage_config(cfg),
        inputs=inputs,
        shard_body=lambda k, writer: score(writer, k),
        merge_summary=merged_summary,
        force=force,
        shard=shard,
    )


def stage_config(cfg: RunConfig) -> dict:
    """What the stage's identity covers: the task and the reward section, less reward.shards (1 and N shards
    score the same rows) and settings added later at their defaults (config.ADDED_SETTINGS)."""
    reward = {k: v for k, v in identity_section(cfg, "reward").items() if k != "shards"}
    return {"task": cfg.to_dict()["task"], "reward": reward}


def merged_summary(parts: list[dict]) -> dict:
    """The rewards summary of its shards'."""
    samples = sum(s["samples"] for s in parts)
    mean = sum(s["reward_mean"] * s["samples"] for s in parts) / samples
    return {"samples": samples, "errors": sum(s["errors"] for s in parts), "reward_mean": mean}
