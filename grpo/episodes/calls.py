"""Running a turn's tool calls in a worker: each under its time limit, its result the observation, its error counted.

The observation is what TRL's GRPOTrainer makes of a call, so a TRL user's tools answer the model as they do there:
a tool's return value becomes the tool message's content as `str(result)` (a list of content blocks stays a list),
and a failure `str({"error": ...})`: an exception's text, an unknown tool ("Tool x not found."), and here also a
call that did not parse and a call past rollout.tool_timeout_s. Each failure is one line in Reply.errors, naming the
tool. An async tool (`async def`) runs to its end in an event loop of its own.
"""

from __future__ import annotations

import asyncio
import inspect
import signal
from typing import Callable

from grpo.episodes.environment import Reply, ToolCall


class ToolTimeout(BaseException):
    """A call's alarm; not an Exception, so a tool's `except Exception` does not swallow it."""


def _alarm(signum, frame):
    raise ToolTimeout()


def call(fn: Callable, arguments: dict, timeout_s: float) -> tuple[object, str | None]:
    """(the tool message's content, None) of fn(**arguments), or (its error as TRL shows it, the error's line), within
    `timeout_s` seconds (SIGALRM: the worker's main thread).

    >>> call(lambda a, b: a * b, {"a": 6, "b": 7}, 1.0)
    ('42', None)
    >>> call(lambda a: 1 / a, {"a": 0}, 1.0)
    ("{'error': 'division by zero'}", 'ZeroDivisionError: division by zero')
    """
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            result = asyncio.run(fn(**arguments)) if inspect.iscoroutinefunction(fn) else fn(**arguments)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except ToolTimeout:
        return str({"error": f"timed out after {timeout_s:g}s"}), f"timed out after {timeout_s:g}s"
    except Exception as e:  # noqa: BLE001 (a tool's failure is the model's to see)
        return str({"error": str(e)}), f"{type(e).__name__}: {e}"
    finally:
        signal.signal(signal.SIGALRM, previous)
    return (result if isinstance(result, list) else str(result)), None


def answer(calls: list[ToolCall], functions: dict[str, Callable], timeout_s: float) -> Reply:
    """The reply of a tools adapter to one turn: a tool message per call, in order; no call ends the episode.

    >>> def add(a: int, b: int) -> int:
    ...     return a + b
    >>> reply = answer([ToolCall("add", {"a": 2, "b": 3}), ToolCall("sub", {})], {"add": add}, 1.0)
    >>> [m["content"] for m in reply.messages], reply.errors, reply.done
    (['5', "{'error': 'Tool sub not found.'}"], ['sub: no such tool'], False)
    >>> answer([], {"add": add}, 1.0).done
    True
    """
    if not calls:
        return Reply(done=True)
    messages, errors = [], []
    for c in calls:
        if c.error is not None:
            content, error = str({"error": c.error}), f"a call that did not parse: {c.error}"
        elif c.name not in functions:
            content, error = str({"error": f"Tool {c.name} not found."}), f"{c.name}: no such tool"
        else:
            content, error = call(functions[c.name], c.arguments, timeout_s)
            error = None if error is None else f"{c.name}: {error}"
        messages.append({"role": "tool", "name": c.name, "content": content})
        if error is not None:
            errors.append(error)
    return Reply(messages, False, errors)
