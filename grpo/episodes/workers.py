"""Where environment adapters live: each episode's in one worker process, from its reset to its final state.

The workers are the reward workers' kind (grpo/runtime/pool.py): forked from the stage's process before the sampler
starts, without its credentials but those rollout.tool_pass_env names, each its own process group whose leftover
processes are killed (here when the worker holds no open episode any more, since an environment may keep a process
for its episode), under rollout.tool_max_memory_mb. Episode i of a reset lives in worker i mod rollout.tool_workers.
The loop asks for one operation on many episodes at once (reset every episode of a chunk, respond to each live
episode's turn, ...): every worker gets one job holding its episodes' items, in order, and the workers run in
parallel. Before each item the worker seeds Python's `random` (and numpy's, if imported) from the item's seed, so an
environment that draws from them answers alike on a rerun, however the episodes fall on workers.

What can go wrong, and what it costs:
- an adapter method raises (a server that died, a class that does not build, code that does not import): the
  outcome is `failed`; the loop fails the stage in one line naming the environment and the episode;
- a worker dies (os._exit, a signal, the OOM killer), or one item runs past its time limit ignoring its alarm (the
  worker is killed): every episode whose environment lived in it is `lost`, the one whose call it was told why; the
  worker is replaced, the stage goes on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass

from grpo.episodes.adapters import Source, factory
from grpo.episodes.calls import valid, valid_text
from grpo.episodes.environment import Environment, Reply
from grpo.runtime import secrets
from grpo.runtime.pool import IDLE, LOADING, RewardPool, keep_children, progress_record
from grpo.runtime.procs import cap_memory

GRACE_S = 2.0  # how long past its time limit an item may run before the parent kills its worker

_LIVE: dict[object, Environment] = {}  # in a worker: the adapters of its open episodes


@dataclass(frozen=True)
class Item:
    """One episode's part of an operation: its key, the seed of Python's generators for the call, the arguments."""

    key: tuple
    seed: int
    args: tuple = ()
    limit_s: float = 10.0
    """How long the parent lets it run before it kills the worker (the adapter's own alarms come first): the loop
    gives rollout.tool_timeout_s for a reset, a final, each call of a turn."""


@dataclass(frozen=True)
class Outcome:
    """What became of one item: `value`, or `failed` (the method raised: the environment is broken), or `lost` (its
    worker died or was killed: its environment is gone)."""

    value: object = None
    seconds: float = 0.0
    failed: str | None = None
    lost: str | None = None
    bystander: bool = False
    """Lost with a worker another episode's call killed: its own environment did nothing wrong (the loop re-creates
    it on a fresh worker by replay)."""


def _seed(seed: int) -> None:
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2**32)


def _reply(value, cap: int) -> Reply:
    """respond's value, checked: a Reply whose messages are chat messages, their text valid and cut to `cap` bytes."""
    ok = isinstance(value, Reply) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value.messages
    )
    if not ok:
        raise TypeError(f"respond() returned {value!r:.200}, not a Reply of chat messages ({{'role', 'content'}})")
    messages, cut = fitted(value.messages, cap)
    return Reply(messages, value.done, [valid_text(str(e)) for e in value.errors], cut)


def fitted(messages: list[dict], cap: int) -> tuple[list[dict], int]:
    """(`messages` with every string valid UTF-8 and their text cut to `cap` bytes in all, the bytes cut): what an
    answer carries into the stage (rollout.max_observation_bytes), however much the environment gave.

    >>> fitted([{"role": "tool", "content": "abcdef"}, {"role": "tool", "content": [{"text": "ghi"}]}], 4)
    ([{'role': 'tool', 'content': 'abcd'}, {'role': 'tool', 'content': [{'text': ''}]}], 5)
    """
    left, cut = [cap], [0]

    def fit(value):
        if isinstance(value, str):
            data = value.encode("utf-8", "replace")
            keep = min(len(data), left[0])
            left[0] -= keep
            cut[0] += len(data) - keep
            return data[:keep].decode("utf-8", "ignore")  # a character cut in its middle is dropped whole
        if isinstance(value, list):
            return [fit(v) for v in value]
        if isinstance(value, dict):
            return {k: fit(v) for k, v in value.items()}
        return value

    out = [{k: fit(v) if k == "content" else valid(v) for k, v in m.items()} for m in messages]
    return out, cut[0]


def _added(value, cap: int) -> tuple[list[dict], int]:
    """reset's value, checked: chat messages, their text valid and cut to `cap` bytes (fitted)."""
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        raise TypeError(f"reset() returned {value!r:.200}, not a list of chat messages ({{'role', 'content'}})")
    return fitted(value, cap)


def _call(make, op: str, item: Item, cap: int):
    """One item in the worker: the adapter method `op` of the episode `item.key`; what reset and respond answer is
    valid text of at most `cap` bytes (rollout.max_observation_bytes)."""
    _seed(item.seed)
    if op == "reset":
        env = _LIVE[item.key] = make()
        added, cut = _added(env.reset(*item.args), cap)
        return added, env.tools(), cut
    if op == "respond":
        return _reply(_LIVE[item.key].respond(*item.args), cap)
    if op == "replay":  # a carried episode's environment, re-created: reset, then each turn it answered again
        row, seed, turns = item.args
        env = _LIVE[item.key] = make()
        (added, _), replies = _added(env.reset(row, seed), cap), []
        for text, calls, turn_seed in turns:
            _seed(turn_seed)
            reply = _reply(env.respond(text, calls), cap)
            replies.append((reply.done, list(reply.messages), list(reply.errors)))
        return added, env.tools(), replies
    env = _LIVE.pop(item.key, None)  # final, close: the episode ends either way
    if env is None:
        return None
    try:
        state = valid(env.final()) if op == "final" else None
        json.dumps(state)  # stored as JSON: a state it cannot hold fails here, naming the environment
        return state
    finally:
        env.close()


def _job(source: Source, max_memory_mb: int | None, op: str, items: list[Item]) -> list[tuple]:
    """A worker's part of an operation: ("ok" | "failed", value or error line, seconds) per item, in order."""
    progress = progress_record()
    progress[2], progress[1], progress[0] = time.monotonic(), 0, LOADING
    cap_memory(max_memory_mb)
    keep_children(True)
    make = factory(source)  # built once per worker; an import error fails the job, said once
    out = []
    for j, item in enumerate(items):
        progress[2], progress[0] = time.monotonic(), j
        t0 = time.perf_counter()
        try:
            out.append(("ok", _call(make, op, item, source.max_observation_bytes), time.perf_counter() - t0))
        except Exception as e:  # noqa: BLE001 (the environment is broken: the parent fails the stage, naming it)
            out.append(("failed", f"{type(e).__name__}: {' '.join(str(e).split())}", time.perf_counter() - t0))
    progress[0] = IDLE
    keep_children(bool(_LIVE))
    return out


def probe(source: Source, max_memory_mb: int | None) -> list[dict]:
    """In a worker: the tools' schemas of `source`'s environment (from an instance built and closed)."""
    cap_memory(max_memory_mb)
    env = factory(source)()
    try:
        return env.tools()
    finally:
        env.close()


def check(source: Source, max_memory_mb: int | None) -> list[dict] | str:
    """In a worker, at `grpo init`: the tools' schemas as `probe` gives them, or the one line a mistake in the
    user's code makes (a name that is not there, a class without `reset`)."""
    from grpo.tasks.functions import UserCodeError

    try:
        return probe(source, max_memory_mb)
    except UserCodeError as e:
        return str(e)


class Workers:
    """The episodes of one stage in a pool's workers: where each lives, which are lost."""

    def __init__(self, pool: RewardPool, source: Source, max_memory_mb: int | None):
        self.pool, self.source, self.max_memory_mb = pool, source, max_memory_mb
        self.home: dict[tuple, int] = {}  # episode key -> the index of its worker
        self.lost: dict[tuple, str] = {}  # episode key -> how its environment was lost
        self.bystanders: set[tuple] = set()  # the lost whose worker another episode's call killed
        self.token = os.urandom(6).hex()  # keys of this stage's episodes, apart from any other's in a warm pool
        self.count = 0

    def keys(self, n: int) -> list[tuple]:
        """Keys for `n` new episodes, never given before."""
        self.count += n
        return [(self.token, i) for i in range(self.count - n, self.count)]

    def run(self, op: str, items: list[Item]) -> list[Outcome]:
        """Adapter method `op` (reset, replay, respond, final, close) for each item's episode, every worker's items
        as one job, the workers in parallel; an Outcome per item, in order. A reset (or a replay, which re-creates a
        carried episode's environment) places episode i in worker i mod the workers; an item of a lost episode is
        not sent (its outcome says how it was lost)."""
        n = len(self.pool.workers)
        if op in ("reset", "replay"):
            self.home.update({item.key: i % n for i, item in enumerate(items)})
        out: list[Outcome | None] = [None] * len(items)
        jobs: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            if item.key in self.lost:
                out[i] = Outcome(lost=self.lost[item.key], bystander=item.key in self.bystanders)
            else:
                jobs.setdefault(self.home[item.key], []).append(i)
        for w, idx in jobs.items():
            self.pool.submit(
                self.pool.workers[w], _job, (self.source, self.max_memory_mb, op, [items[i] for i in idx]), idx
            )
        while self.pool.busy():
            for w, idx, kind, payload in self.pool.wait(self._wait_s(items)):
                if kind == "done":
                    for i, (status, value, seconds) in zip(idx, payload):
                        value = self._redact_cut(op, value) if status == "ok" else value
                        out[i] = Outcome(value, seconds) if status == "ok" else Outcome(failed=value, seconds=seconds)
                elif kind == "failed":  # the job itself: the adapter factory does not build
                    for i in idx:
                        out[i] = Outcome(failed=payload)
                elif kind == "died":
                    index, where = self.pool.workers.index(w), int(w.progress[0])
                    self._lose(index, idx, items, out, where, f"its tool worker died ({self.pool.replace(w)})")
            for w in self.pool.busy():
                if time.monotonic() > self._due(w, items):
                    index, where = self.pool.workers.index(w), int(w.progress[0])
                    self.pool.replace(w)
                    limit = items[w.job[where]].limit_s if where >= 0 else self.source.timeout_s
                    doing = op if where >= 0 else "building the environment (its code imported, its tools described)"
                    self._lose(
                        index,
                        w.job,
                        items,
                        out,
                        where,
                        f"{doing} ran past {limit:g}s (its limit by rollout."
                        "tool_timeout_s); its tool worker was killed",
                    )
        return out

    def _redact_cut(self, op: str, value):
        """An answer cut short in its worker (Reply.cut, reset's count) with a credential's first characters where
        the cut fell inside it redacted too (the pool redacted whole values already)."""
        cut = value.cut if op == "respond" else value[2] if op == "reset" else 0
        if not cut or not self.pool.secrets:
            return value

        def tail(v):
            if isinstance(v, str):
                return secrets.redact_cut(v, self.pool.secrets)
            if isinstance(v, list):
                return [tail(x) for x in v]
            return {k: tail(x) for k, x in v.items()} if isinstance(v, dict) else v

        if op == "respond":
            return dataclasses.replace(value, messages=[{**m, "content": tail(m["content"])} for m in value.messages])
        return [{**m, "content": tail(m["content"])} for m in value[0]], *value[1:]

    def _lose(self, index: int, idx: list[int], items: list[Item], out: list, where: int, why: str) -> None:
        """Worker `index` is gone with every environment in it: the item it ran (`where` in its job `idx`) is told
        `why`, every other episode that lived there is lost with it."""
        culprit = items[idx[where]].key if 0 <= where < len(idx) else None
        for key, home in self.home.items():
            if home == index and key not in self.lost:
                self.lost[key] = why if key == culprit else f"lost with its worker ({why})"
                self.bystanders.update([key] if key != culprit else [])
        for i in idx:
            out[i] = Outcome(lost=self.lost[items[i].key], bystander=items[i].key in self.bystanders)

    def _due(self, w, items: list[Item]) -> float:
        """When busy worker `w` is overdue: its item's limit past the item's start (building the factory, which
        imports the user's code and constructs a probe instance: rollout.tool_timeout_s)."""
        where, _, since = w.progress[:]
        if where == LOADING:
            return since + self.source.timeout_s + GRACE_S
        return since + items[w.job[int(where)]].limit_s + GRACE_S if where >= 0 else float("inf")

    def _wait_s(self, items: list[Item]) -> float:
        """How long to wait for answers before a busy worker's item is overdue; at most 1 s."""
        due = [self._due(w, items) for w in self.pool.busy()]
        return min([1.0] + [max(0.01, t - time.monotonic() + 0.01) for t in due if t != float("inf")])
