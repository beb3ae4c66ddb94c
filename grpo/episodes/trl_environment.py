"""Adapter: a class as TRL's `GRPOTrainer(environment_factory=...)` takes it, run unchanged (rollout.environment).

TRL's contract (trl 1.16, GRPOTrainer): the class (or any factory) is called with no arguments, one instance per
episode; `reset(**row)`
gets the dataset row (every column: the prompt and answer columns under their own names) and returns None or a
string appended to the prompt's last user message; every public method other than `reset` and `get_reward` is a tool
(its hints and docstring its schema, as for plain tools), answered as TRL answers tool calls (calls.py); `get_reward()`,
when the class has it, is a reward of its own, weight 1, beside the reward functions. A turn without a call ends the
episode. What differs, and why: TRL hands reward functions the live instances (`environments=`); here the rewards
stage runs after the episodes, in other processes, maybe on another day (`grpo rescore`), so the episode's final state
is stored instead (`final`: the instance's public attributes that JSON can hold, and get_reward's value), and a reward
function that takes an `environment` argument gets it as an object with those attributes and that get_reward()
(grpo.tasks.base.FinalState).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Callable

from grpo.episodes.adapters import Source
from grpo.episodes.calls import answer
from grpo.episodes.environment import Reply, ToolCall
from grpo.episodes.tools import load_tools, schema
from grpo.tasks import functions

_NOT_TOOLS = ("reset", "get_reward")


def method_names(cls: type) -> list[str]:
    """The public methods of `cls` that are tools, as TRL lists them (on the class: properties are not evaluated).

    >>> class Env:
    ...     def reset(self, **row): ...
    ...     def get_reward(self): ...
    ...     def move(self, to: str): ...
    ...     def _helper(self): ...
    >>> method_names(Env)
    ['move']
    """
    return [n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction) if n not in _NOT_TOOLS and n[0] != "_"]


def _run(fn: Callable, *args, **kwargs):
    return asyncio.run(fn(*args, **kwargs)) if inspect.iscoroutinefunction(fn) else fn(*args, **kwargs)


class TRLEnvironment:
    """One episode's instance of the user's class, and the standalone tools beside its methods."""

    def __init__(self, make: Callable, standalone: list[Callable], schemas: list[dict], timeout_s: float):
        self.env = make()
        methods = [getattr(self.env, n) for n in method_names(type(self.env))]
        self.functions = {fn.__name__: fn for fn in standalone + methods}
        self.schemas, self.timeout_s = schemas, timeout_s

    def tools(self) -> list[dict]:
        return self.schemas

    def reset(self, row: dict, seed: int) -> list[dict]:
        observation = _run(self.env.reset, **row)
        return [] if observation is None else [{"role": "user", "content": observation}]

    def respond(self, text: str, calls: list[ToolCall]) -> Reply:
        return answer(calls, self.functions, self.timeout_s)

    def final(self) -> dict:
        """The instance's public attributes that JSON can hold, and `get_reward`: what get_reward() returned, where
        the class has one (reward functions see them as grpo.tasks.base.FinalState)."""
        out = {name: value for name, value in vars(self.env).items() if name[0] != "_" and _jsonable(value)}
        if callable(getattr(self.env, "get_reward", None)):
            out["get_reward"] = float(_run(self.env.get_reward))
        return out

    def close(self) -> None:
        pass  # TRL never closes an environment (a public `close` would be one of its tools)


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def build(source: Source) -> Callable[[], TRLEnvironment]:
    """The factory of kind `environment`: the class and standalone tools loaded and described once (from a probe
    instance, as TRL probes one), an instance per episode."""
    where = f"rollout.environment {source.environment!r}"
    make = functions.load_object(source.environment, source.environment_file, "rollout.environment")
    standalone = load_tools(source.tools, source.tool_files)
    probe = make()  # a class, or any callable that returns an instance (TRL's factory)
    if not callable(getattr(probe, "reset", None)):
        raise functions.UserCodeError(f"{where}: its instances have no `reset` method (TRL's environment_factory)")
    schemas = [schema(fn, f"rollout.tools {s!r}") for fn, s in zip(standalone, source.tools)]
    schemas += [schema(getattr(probe, n), f"{where} method {n!r}") for n in method_names(type(probe))]
    return lambda: TRLEnvironment(make, standalone, schemas, source.timeout_s)
