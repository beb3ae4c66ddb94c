"""Stage 3: score every rollout with the task's verifiable reward, or the user's functions.

`reward.functions` replace the task's reward: they are loaded from the run's base commit
(a file is copied there at `grpo init`) or imported by module name, and get each sample's
dataset row as keyword arguments (grpo.tasks.functions).

Rewards run in a process pool; each sample has a time limit. A response cut off
at max_tokens scores `reward.truncated_reward` when that is set (an unfinished
answer is not an answer; without it a policy that never emits eos is never
shown that stopping after the answer pays). An exception or a
timeout is recorded in the `error` column with reward 0 instead of crashing, and
the stage fails (committing nothing) when more than `max_error_fraction` errs.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import signal
from contextlib import contextmanager

from grpo.checkpoint import local_checkpoint
from grpo.config import RewardConfig, RunConfig
from grpo.storage import Committed, Storage
from grpo.tasks import functions
from schemas import ParquetWriter, iter_batches, table_file
from stages.common import StageError, check_chain, committed_input, load_run, run_stage

_JOBS_PER_WORKER = 4  # a batch is split into about this many pool jobs per worker
_MIN_CHUNK = 64  # samples; smaller jobs cost more in pickling and wake-ups than they score
_MAX_CHUNK = 256  # samples; bounds how long a job hung in C code (no alarm reaches it) is waited for


class _Timeout(Exception):
    pass


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


def score_one(scorer, response: str, ground_truth: str, prompt: str, row: dict, timeout_s: float):
    """(reward, components, error) of one sample; never raises. SIGALRM must be handled by `_alarm`."""
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        components = scorer(response, ground_truth, prompt, row)
        return components["total"], components, None
    except _Timeout:
        return 0.0, {}, f"timeout after {timeout_s}s"
    except Exception as e:  # noqa: BLE001 (a reward bug must not kill the stage)
        return 0.0, {}, f"{type(e).__name__}: {e}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _worker_init() -> None:
    """A forked worker drops the handlers it inherited (Prefect's SIGTERM handler would report the
    parent's task as crashed when the pool terminates its workers), then takes SIGTERM again."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _fork_pool(workers: int):
    """A fork pool whose workers never run the parent's SIGTERM handler.

    SIGTERM stays blocked from the fork until `_worker_init` has restored its default action: a
    pool terminated as it starts (a stage failing at once) would otherwise leave a worker that
    handled SIGTERM the parent's way and lives on, and `terminate()` waits for it forever.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return mp.get_context("fork").Pool(workers, _worker_init)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _score_chunk(key: tuple, timeout_s: float, items: list[tuple[str, str, str, dict]]):
    try:
        scorer = functions.cached(*key)
    except Exception as e:  # noqa: BLE001 (a reward module failing to load fails every sample, said once)
        return [(0.0, {}, f"{type(e).__name__}: {e}")] * len(items)
    signal.signal(signal.SIGALRM, _alarm)
    return [score_one(scorer, *item, timeout_s) for item in items]


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


def score_batch(pool, key: tuple, cfg: RewardConfig, items: list[tuple[str, str, str, dict]]) -> list:
    """Score samples (response, ground_truth, prompt, row) in the pool, in about `_JOBS_PER_WORKER`
    jobs per worker; returns (reward, components, error) per sample, in order."""
    chunk = min(_MAX_CHUNK, max(_MIN_CHUNK, -(-len(items) // (_JOBS_PER_WORKER * cfg.workers))))
    jobs = [
        pool.apply_async(_score_chunk, (key, cfg.timeout_s, items[i : i + chunk])) for i in range(0, len(items), chunk)
    ]
    results = []
    for job, start in zip(jobs, range(0, len(items), chunk)):
        n = min(chunk, len(items) - start)
        try:  # a hang the in-worker alarm cannot break (C code) still ends here
            results += job.get(timeout=cfg.timeout_s * n + 30)
        except mp.TimeoutError:
            raise StageError(f"reward worker hung beyond {cfg.timeout_s}s per sample and did not recover")
    return results


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


def rewards(storage: Storage, run_id: str, iteration: int, force: bool = False) -> Committed:
    cfg = load_run(storage, run_id)
    rollouts = committed_input(storage, run_id, iteration, "rollouts")
    inputs = {"rollouts": rollouts}
    if cfg.reward.functions:  # the committed copies of reward files, and their hashes in the identity
        inputs["base"] = committed_input(storage, run_id, None, "base")
    check_chain(storage, run_id, iteration, "rewards", inputs)

    def body(writer):
        n = n_err = 0
        total = 0.0
        path = rollouts.path(table_file("rollouts"))
        keys = ["run_id", "iteration", "prompt_id", "sample_index"]
        with (
            WARM_POOLS.pool(cfg.reward.workers) as pool,
            ParquetWriter(storage.fs, writer.path(table_file("rewards")), "rewards") as out,
        ):
            key = scorer_key(cfg, inputs.get("base"))
            for batch in iter_batches(storage.fs, path, "rollouts", batch_size=8192):
                scored = score_batch(pool, key, cfg.reward, batch_items(batch))
                if cfg.reward.truncated_reward is not None:
                    scored = [
                        truncated(item, fr, cfg.reward.truncated_reward)
                        for item, fr in zip(scored, batch.column("finish_reason").to_pylist())
                    ]
                cols = {k: batch.column(k).to_pylist() for k in keys}
                cols["reward"] = [r for r, _, _ in scored]
                cols["components"] = [list(c.items()) for _, c, _ in scored]
                cols["error"] = [e for _, _, e in scored]
                out.write(cols)
                n += len(scored)
                n_err += sum(e is not None for _, _, e in scored)
                total += sum(cols["reward"])
        if n == 0:
            raise StageError(f"{rollouts.uri}: rollouts.parquet has no rows")
        if n_err / n > cfg.reward.max_error_fraction:
            raise StageError(
                f"rewards: {n_err}/{n} samples failed (> reward.max_error_fraction="
                f"{cfg.reward.max_error_fraction}); see the error column of an uncommitted "
                f"attempt under {storage.uri(writer.attempt_dir)}"
            )
        return {"samples": n, "errors": n_err, "reward_mean": total / n}

    config = {"task": cfg.to_dict()["task"], "reward": cfg.to_dict()["reward"]}
    return run_stage(storage, run_id, iteration, "rewards", config=config, inputs=inputs, body=body, force=force)
