"""Running a turn's tool calls in a worker: each under its time limit, its result the observation, its error counted.

The observation is what TRL's GRPOTrainer makes of a call, so a TRL user's tools answer the model as they do there:
a tool's return value becomes the tool message's content as `str(result)` (a list of content blocks stays a list),
made inside the call's guard with invalid text replaced (a result that cannot become text is an error naming the
tool), and a failure `str({"error": ...})`: an exception's text, an unknown tool ("Tool x not found."), and here also a
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
    `timeout_s` seconds (SIGALRM: the worker's main thread). The result becomes text inside the same guard, invalid
    text (a lone surrogate) replaced: a result that cannot become text is the model's error to see, naming the tool.

    >>> call(lambda a, b: a * b, {"a": 6, "b": 7}, 1.0)
    ('42', None)
    >>> call(lambda a: 1 / a, {"a": 0}, 1.0)
    ("{'error': 'division by zero'}", 'ZeroDivisionError: division by zero')
    >>> call(lambda: "a" + chr(0xD800) + "b", {}, 1.0)
    ('a?b', None)
    >>> def huge() -> int:
    ...     return 10**5000
    >>> call(huge, {}, 1.0)[1]  # doctest: +ELLIPSIS
    'ValueError: the result of huge is no text: ValueError: Exceeds the limit (4300 digits)...'
    """
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            result = asyncio.run(fn(**arguments)) if inspect.iscoroutinefunction(fn) else fn(**arguments)
            content = as_text(result, getattr(fn, "__name__", "the tool"))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except ToolTimeout:
        return str({"error": f"timed out after {timeout_s:g}s"}), f"timed out after {timeout_s:g}s"
    except Exception as e:  # noqa: BLE001 (a tool's failure is the model's to see)
        said = _said(e)
        return str({"error": said}), f"{type(e).__name__}: {said}"
    finally:
        signal.signal(signal.SIGALRM, previous)
    return content, None


def as_text(result: object, name: str) -> str | list:
    """A tool's result as the tool message's content: `str(result)` (a list of content blocks stays a list), invalid
    text replaced; a result whose conversion raises fails naming the tool."""
    try:
        return [valid(block) for block in result] if isinstance(result, list) else valid_text(str(result))
    except Exception as e:  # noqa: BLE001 (a __str__ that raises, an int past Python's digit limit, ...)
        raise ValueError(f"the result of {name} is no text: {type(e).__name__}: {e}") from None


def _said(e: Exception) -> str:
    """An exception's text, valid; what its type is where even that raises."""
    try:
        return valid_text(str(e))
    except Exception:  # noqa: BLE001 (an exception whose __str__ raises)
        return f"a {type(e).__name__} whose text cannot be read"


def valid_text(text: str) -> str:
    """`text` as UTF-8 can hold it: a lone surrogate (which no tokenizer or Parquet file takes) replaced by "?".

    >>> valid_text("ok"), valid_text("bad" + chr(0xDC80))
    ('ok', 'bad?')
    """
    return text.encode("utf-8", "replace").decode("utf-8")


def valid(value: object) -> object:
    """`value` with every string in it (through lists and dicts) valid_text; anything else as it is."""
    if isinstance(value, str):
        return valid_text(value)
    if isinstance(value, list):
        return [valid(v) for v in value]
    if isinstance(value, dict):
        return {valid(k): valid(v) for k, v in value.items()}
    return value


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
