"""Which environment adapter a run's config names, and the registry of adapter kinds.

A run has episodes when its config names where their environment comes from:
  rollout.tools        plain Python functions (`path/to/file.py:function` or `package.module:function`, as
                       reward.functions are named): kind `tools` (tools.py)
  rollout.environment  a TRL `environment_factory` class (`path/to/file.py:Class` or `package.module:Class`):
                       kind `environment` (trl_environment.py); rollout.tools then adds standalone tools beside
                       its methods, as TRL's `tools=` does beside `environment_factory`; or an OpenEnv server's
                       URL (`http://host:port`): kind `openenv` (openenv.py)
Which kind a config names is decided once, by grpo.variants.environment_kind (RolloutConfig.environment_kind): the
config's check and `source` here both ask it.
Neither: single-turn rollouts, as before episodes existed.

A kind's module has `build(source: Source) -> Callable[[], Environment]`: the factory a worker process calls once
per episode (built once per process and kept). `Source` holds plain values only, so it travels to a forked worker
and keys its cache, as the reward scorer's key does (grpo/scoring/score.py). A file a spec names is copied into the
run's base commit at `grpo init` (under its kind's prefix), so every stage, worker and machine runs the same code;
`files` holds the local paths of those copies.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable

from grpo.episodes.environment import Environment

KINDS = {
    "tools": "grpo.episodes.tools",
    "environment": "grpo.episodes.trl_environment",
    "openenv": "grpo.episodes.openenv",
}
"""Adapter kind (what the config names, decided by grpo.variants.environment_kind) -> the module whose `build(source)`
makes its factory. A new kind is a module and a row here (and, for a server named by its URL, a row of
grpo.variants.SERVERS)."""

PRELOADS = {
    "tools": ("grpo.episodes.tools", "transformers.utils.chat_template_utils"),
    "environment": ("grpo.episodes.trl_environment", "transformers.utils.chat_template_utils"),
    "openenv": ("grpo.episodes.openenv", "openenv.core"),
}
"""What a kind's factory imports that is not the user's code: imported in the stage before its workers fork, so
rollout.tool_timeout_s bounds the user's code (its import, a class's construction, a reset), not ours."""

PREFIXES = {"tools": "tools/", "environment": "environment/"}
"""Where a run's base commit keeps the copies of the files each setting names (rollout.tools, rollout.environment)."""


@dataclass(frozen=True)
class Source:
    """Plain values a worker builds a run's adapter factory from (picklable, hashable: a worker's cache key)."""

    kind: str
    """A key of KINDS."""
    environment: str | None = None
    """rollout.environment as the config names it (kinds environment, openenv)."""
    environment_file: str | None = None
    """The local path of its committed copy when it names a file."""
    tools: tuple[str, ...] = ()
    """rollout.tools as the config names them."""
    tool_files: tuple[str | None, ...] = ()
    """The local path of each one's committed copy (None: a module spec)."""
    timeout_s: float = 10.0
    """rollout.tool_timeout_s: the time limit of one tool call (calls.py)."""
    max_observation_bytes: int = 65536
    """rollout.max_observation_bytes: what a worker sends back of an answer's text, at most (workers.py)."""
    options: tuple[tuple[str, object], ...] = ()
    """Anything else a kind needs, as sorted (name, value) pairs."""


@functools.lru_cache(maxsize=4)
def factory(source: Source) -> Callable[[], Environment]:
    """The adapter factory of `source`, built once per process (a worker serves many episodes)."""
    if source.kind not in KINDS:
        raise ValueError(f"unknown environment kind {source.kind!r}; valid: {', '.join(KINDS)}")
    return importlib.import_module(KINDS[source.kind]).build(source)


def preload(kind: str | None) -> None:
    """Import PRELOADS[kind] here (before the workers fork); one that is not installed is the factory's to say."""
    for name in PRELOADS.get(kind, ()):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def source(rollout, files: dict[str, str]) -> Source | None:
    """The Source of a rollout config (None: single-turn); `files` maps each file spec to its committed copy's
    local path (stages.prompts.environment_source finds them in the base commit)."""
    kind = rollout.environment_kind()
    if kind is None:
        return None
    return Source(
        kind=kind,
        environment=rollout.environment,
        environment_file=files.get(rollout.environment) if rollout.environment else None,
        tools=tuple(rollout.tools),
        tool_files=tuple(files.get(spec) for spec in rollout.tools),
        timeout_s=rollout.tool_timeout_s,
        max_observation_bytes=rollout.max_observation_bytes,
    )


def names_files(rollout) -> bool:
    """Whether rollout.tools or rollout.environment name files (copied into the run's base commit at `grpo init`:
    the stages that run them read that commit)."""
    from grpo.tasks import functions

    return any(functions.is_file_spec(s) for s in rollout.tools + [rollout.environment or ""])
