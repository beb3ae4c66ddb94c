"""Adapter: plain Python functions as tools, the contract of TRL's `GRPOTrainer(tools=...)` (rollout.tools).

Each function's name, type hints and Google-style docstring are its schema (transformers' `get_json_schema`, what
`apply_chat_template(tools=...)` renders); the model calls it by name with JSON arguments; what it returns is the tool
message (calls.py). The episode ends on a turn without a call. No state: reset adds nothing, final stores nothing.
"""

from __future__ import annotations

from typing import Callable

from grpo.episodes.adapters import Source
from grpo.episodes.calls import answer
from grpo.episodes.environment import Reply, ToolCall
from grpo.tasks import functions


def schema(fn: Callable, where: str) -> dict:
    """fn's JSON schema as transformers makes it from its hints and docstring; a function it cannot describe fails
    naming `where` (its setting and spec) and what to add."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 (transformers' TypeHintParsingException, DocstringParsingException)
        raise functions.UserCodeError(
            f"{where}: no tool schema from {getattr(fn, '__name__', fn)!r} ({type(e).__name__}: {e}); give every "
            "argument a type hint and a line under `Args:` in a Google-style docstring"
        ) from e


def load_tools(specs: tuple[str, ...], files: tuple[str | None, ...]) -> list[Callable]:
    """The functions rollout.tools names (file specs from their committed copies)."""
    return [functions.load_object(s, f, "rollout.tools") for s, f in zip(specs, files or (None,) * len(specs))]


class Tools:
    """One episode's tools: the functions, their schemas, the time limit of a call."""

    def __init__(self, fns: list[Callable], schemas: list[dict], timeout_s: float):
        self.functions = {fn.__name__: fn for fn in fns}
        self.schemas, self.timeout_s = schemas, timeout_s

    def tools(self) -> list[dict]:
        return self.schemas

    def reset(self, row: dict, seed: int) -> list[dict]:
        return []

    def respond(self, text: str, calls: list[ToolCall]) -> Reply:
        return answer(calls, self.functions, self.timeout_s)

    def final(self) -> dict | None:
        return None

    def close(self) -> None:
        pass


def build(source: Source) -> Callable[[], Tools]:
    """The factory of kind `tools`: the functions loaded and described once, an adapter per episode."""
    fns = load_tools(source.tools, source.tool_files)
    schemas = [schema(fn, f"rollout.tools {spec!r}") for fn, spec in zip(fns, source.tools)]
    return lambda: Tools(fns, schemas, source.timeout_s)
