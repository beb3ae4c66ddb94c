"""The one interface the episode loop knows: an environment adapter, and the values that pass through it.

An episode: the policy samples an assistant turn; the adapter answers it (a tool's result, an environment's
observation) with chat messages, which the loop renders with the model's chat template and appends as tokens;
the policy samples the next turn; until the adapter says the episode is done, rollout.max_turns turns were
sampled, or the episode's token budget is spent. Each contract users already write environments in is one
adapter of this interface in a file of its own (tools.py: plain functions as TRL's `tools=`; trl_environment.py:
a TRL `environment_factory` class; openenv.py: a gym-style reset/step server through OpenEnv's client); the loop
(loop.py) knows nothing else of them.

Life of an adapter. The worker that hosts an episode (workers.py) builds one adapter for it (the kind's factory,
adapters.py), then calls, in its one process and thread:
  tools()                 once: the JSON schemas of its tools, rendered into the prompt
  reset(row, seed)        once: messages to add to the prompt before the first turn (usually [])
  respond(text, calls)    once per sampled turn, in order: what the environment answers
  final()                 once, after the last turn: the episode's final state, stored with it for the rewards
  close()                 once, last (also after a failure)
Everything given and returned crosses a process boundary: plain values (str, int, float, bool, None, lists and
dicts of them) and the dataclasses below.

Determinism. `seed` is the same for the G episodes of one prompt (a group starts from one state, so their rewards
compare), and a reset must give the G episodes one start: the loop refuses a group whose reset messages differ.
Before every call the worker seeds Python's `random` (and numpy's global generator, if numpy is imported) from
the run's seed, the episode and the turn, so an adapter that draws from them answers the same on a rerun or a
resumed run; an adapter with its own generator seeds it from `seed`.

Errors. What goes wrong inside an episode is the model's to see, never a lost stage: a tool that raises or runs
past its time limit, a call to a tool that does not exist, arguments that do not fit, a call the model wrote that
does not parse (ToolCall.error). The adapter answers it with a message saying what happened and lists it in
Reply.errors: counted, stored in the turns table, the episode goes on. An exception that escapes an adapter
method means the environment itself is broken (a server that died, a class that does not build): the rollouts
stage fails in one line naming the environment and the episode, and commits nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from grpo.errors import StageError


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model wrote in an assistant turn, parsed (parsing.py)."""

    name: str
    """The tool's name as the model wrote it ("" when the call did not parse)."""
    arguments: dict = field(default_factory=dict)
    """Its JSON arguments, as parsed."""
    error: str | None = None
    """Why the call could not be parsed (the model's text was no valid call); None for a call that parsed. An
    adapter answers such a call with this error as the observation and counts it."""


@dataclass(frozen=True)
class Reply:
    """What an environment answers to one assistant turn."""

    messages: list[dict] = field(default_factory=list)
    """Chat messages appended after the turn, as the chat template renders them: `{"role": "tool", "name": ...,
    "content": ...}` per tool result (TRL's form), `{"role": "user", "content": ...}` for an observation. Empty:
    nothing to answer, the episode ends."""
    done: bool = False
    """The episode ends after this turn (the messages are not appended then: no turn would read them)."""
    errors: list[str] = field(default_factory=list)
    """What failed this turn (a tool that raised or timed out, an unknown tool, a call that did not parse), one
    line each: counted per iteration, the first stored in the turns table's `error`."""
    cut: int = 0
    """Bytes of the messages' text left out past rollout.max_observation_bytes (set by the worker, not the adapter:
    what reaches the stage is at most that many bytes, whatever the environment answered)."""


@runtime_checkable
class Environment(Protocol):
    """An environment adapter: one instance per episode, in one worker process (see the module's docstring)."""

    def tools(self) -> list[dict]:
        """The JSON schemas of the tools the model may call (transformers' `get_json_schema` form, what
        `apply_chat_template(tools=...)` takes); [] for none. The same for every episode of a run."""
        ...

    def reset(self, row: dict, seed: int) -> list[dict]:
        """Start the episode for the dataset row `row` (its prompt, ground truth and other columns); `seed` is the
        group's (the same for the G episodes of one prompt). Returns chat messages to add to the prompt before the
        first turn, usually []; a user message among them right after the prompt's last user message is joined
        to it (its text appended, as TRL appends what `reset` returns)."""
        ...

    def respond(self, text: str, calls: list[ToolCall]) -> Reply:
        """Answer one assistant turn: `text` is the turn as the model wrote it (its end-of-turn token dropped),
        `calls` the tool calls parsed from it, in order. A tools adapter ends the episode (done, no messages) on
        a turn without a call; an environment may end it on any turn."""
        ...

    def final(self) -> dict | None:
        """The episode's final state as a JSON object, stored with the episode (the `episodes` table) and given
        to reward functions that take an `environment` argument, at scoring and at `grpo rescore` (which never
        runs the environment again); None when there is nothing to store."""
        ...

    def close(self) -> None:
        """Release what the episode holds (a server session, files); called once, last, also after a failure."""
        ...


class EnvironmentFailure(StageError):
    """An environment that is broken, not an episode that went wrong: the rollouts stage fails in one line."""
