"""Scoring samples with the run's reward (the task's, or the user's functions) in the pool: each sample under its
time limit, errors recorded with the function's name, the scoring stopped once more than the allowed share
of samples erred; then the reward shaping of grpo/scoring/shaping.py. The rewards stage, dynamic sampling
(rollouts) and eval all score through `score_samples` / `score_batch`.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import time
from collections import deque

from grpo.config import RewardConfig, RunConfig
from grpo.errors import StageError
from grpo.record.checkpoint import local_checkpoint
from grpo.record.storage import Committed
from grpo.runtime.pool import IDLE, LOADING, RewardPool, progress_record, tell
from grpo.runtime.procs import cap_memory
from grpo.scoring.shaping import overlong, truncated
from grpo.tasks import functions
from grpo.tasks.base import episode_arguments

log = logging.getLogger("grpo.scoring")

_JOBS_PER_WORKER = 4  # a batch is split into about this many pool jobs per worker


_MIN_CHUNK = 64  # samples; smaller jobs cost more in pickling and wake-ups than they score


_MAX_CHUNK = 256  # samples; bounds what a dead worker's job costs to score again


_GRACE_S = 1.0  # how long past its alarm a sample may run before the parent kills its worker


_LOAD_TIMEOUT_S = 300.0  # for a worker to build the scorer (import the reward modules)


class _Timeout(BaseException):
    """The sample's alarm; not an Exception, so a reward function's `except Exception` does not swallow it."""


def _alarm(signum, frame):
    raise _Timeout()


def scorer_key(cfg: RunConfig, base: Committed | None) -> tuple:
    """Plain values a pool worker builds the run's scorer from (functions.cached): the task, or the
    reward functions with the local paths of the files committed in `base`."""
    specs = tuple(cfg.reward.functions)
    files: list[str | None] = [None] * len(specs)
    if any(functions.has_copy(s) for s in specs):
        folder = local_checkpoint(base, prefix=functions.REWARD_PREFIX)
        files = [
            f"{folder}/{functions.committed_name(i, s)[len(functions.REWARD_PREFIX) :]}"
            if functions.has_copy(s)
            else None
            for i, s in enumerate(specs)
        ]
    weights = tuple(cfg.reward.function_weights) if cfg.reward.function_weights else None
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


def _score_chunk(key: tuple, timeout_s: float, max_memory_mb: int | None, items: list[tuple[str, str, str, dict]]):
    """Score `items` in a worker, keeping its progress record current for the parent's watchdog."""
    progress = progress_record()
    progress[2], progress[1], progress[0] = time.monotonic(), 0, LOADING
    cap_memory(max_memory_mb)
    try:
        scorer = functions.cached(*key)
    except Exception as e:  # noqa: BLE001 (a reward module failing to load fails every sample, said once)
        progress[0] = IDLE
        tell(list(range(len(items))), f"{type(e).__name__}: {e}")
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
            tell([j], out[-1][2])
    progress[0] = IDLE
    return out


def batch_items(batch, episodes: dict | None = None) -> list[tuple[str, str, str, dict]]:
    """(response, ground_truth, prompt, row) of each sample of a rollouts record batch; with `episodes` (the
    episodes table's rows by (prompt_id, sample_index): arguments_by_episode) each row also holds its episode's
    environment and messages (grpo.tasks.base.EPISODE_ARGUMENTS)."""
    rows = [json.loads(r) for r in batch.column("row").to_pylist()]
    if episodes is not None:
        keys = zip(batch.column("prompt_id").to_pylist(), batch.column("sample_index").to_pylist())
        rows = [row | episodes[key] for row, key in zip(rows, keys)]
    return list(
        zip(
            batch.column("response").to_pylist(),
            batch.column("ground_truth").to_pylist(),
            batch.column("prompt").to_pylist(),
            rows,
        )
    )


def arguments_by_episode(table) -> dict[tuple[int, int], dict]:
    """{(prompt_id, sample_index): {"environment": its final state (FinalState, or None), "messages": its
    conversation}} of an episodes table (schemas.tables.EPISODES): what reward functions are given of each episode,
    stored when it was sampled (`grpo rescore` runs no environment again)."""
    cols = {k: table.column(k).to_pylist() for k in ("prompt_id", "sample_index", "environment", "messages")}
    return {
        (p, s): episode_arguments(None if env is None else json.loads(env), json.loads(m))
        for p, s, env, m in zip(*cols.values())
    }


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
    left_before = pool.left_running

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
                        doing = f"loading {', '.join(names)}" if where == LOADING else "between samples"
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
                elif where == LOADING and now - since > _LOAD_TIMEOUT_S:
                    raise StageError(f"a reward worker took over {_LOAD_TIMEOUT_S:g}s loading {', '.join(names)}")
            if max_errors is not None and len(erred) > max_errors:
                raise StageError(
                    f"rewards: {len(erred)} samples failed, more than the {max_errors} that "
                    f"reward.max_error_fraction={cfg.max_error_fraction} allows; scoring stopped at once; "
                    f"the first: {next(iter(erred.values()))}"
                )
    finally:
        pool.log_printed()
        if left := pool.left_running - left_before:  # not an error: the rewards stand, the processes are gone
            log.warning(
                "reward function %s left %d processes running; they were killed as their jobs ended",
                ", ".join(names),
                left,
            )
    return results


def _wait_s(pool: RewardPool, timeout_s: float) -> float:
    """How long the parent may wait for answers before a busy worker's sample (or load) is overdue; at
    most 1 s, so a worker that only just started a sample is looked at again soon."""
    due = [
        since + (timeout_s + _GRACE_S if where >= 0 else _LOAD_TIMEOUT_S)
        for where, _, since in (w.progress[:] for w in pool.busy())
        if where >= 0 or where == LOADING
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
    return shaped(cfg, score_batch(pool, key, cfg.reward, items, max_errors=max_errors), finish_reasons, lengths)


def shaped(cfg: RunConfig, scored: list, finish_reasons: list[str], lengths: list[int]) -> list:
    """(reward, components, error) of each sample after reward.truncated_reward and reward.overlong_buffer."""
    if cfg.reward.truncated_reward is not None:
        scored = [truncated(item, fr, cfg.reward.truncated_reward) for item, fr in zip(scored, finish_reasons)]
    if cfg.reward.overlong_buffer is not None:  # after truncated_reward: a cut-off response loses it too
        shaping = (cfg.rollout.max_tokens, cfg.reward.overlong_buffer, cfg.reward.overlong_penalty)
        scored = [overlong(item, n, *shaping) for item, n in zip(scored, lengths)]
    return scored


def with_judge(cfg: RunConfig, scored: list, judged: list[dict]) -> list:
    """(reward, components, error) of each sample with the judge's score joined (reward.judge): the reward is
    w * (the task's reward, or the functions' weighted total) + w_judge * the judge's score
    (RewardConfig.judge_weights),
    the judge's score the component `judge` beside the others (the task's or the one function's total under its name).
    A judge call that failed every try is the sample's error (counted against reward.max_error_fraction) and scores
    reward.judge.parse_error_reward, as an answer that does not parse does (that is no error of the sample's: the
    judge table counts it). A sample whose reward function erred keeps its error and reward 0.

    >>> from grpo.config import JudgeConfig
    >>> cfg = RunConfig(reward=RewardConfig(judge=JudgeConfig(model="m"), weights=[0.0, 2.0]))
    >>> with_judge(cfg, [(1.0, {"total": 1.0}, None)], [{"score": 0.25, "failed": False, "error": None}])
    [(0.5, {'sort': 1.0, 'judge': 0.25, 'total': 0.5}, None)]
    """
    w_base, w_judge = cfg.reward.judge_weights
    specs = cfg.reward.functions
    name = functions.function_names(specs)[0] if len(specs) == 1 else None if specs else cfg.task.name
    out = []
    for (reward, comps, error), j in zip(scored, judged):
        if error is not None:
            out.append((reward, comps, error))
            continue
        total = w_base * reward + w_judge * j["score"]
        named = {name: reward} if name is not None and name not in comps else {}
        rest = {k: v for k, v in comps.items() if k != "total"}
        failed = f"judge: {j['error']}" if j["failed"] else None
        out.append((total, {**rest, **named, "judge": j["score"], "total": total}, failed))
    return out


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
