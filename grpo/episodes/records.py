"""What an episode leaves: its tokens with their loss mask, sampler log-probs and policy versions, its turns, its end
and final state, and the columns of the three tables they go to (schemas/tables.py): a rollouts row per episode, a
turns row per assistant turn, an episodes row per episode.

Every response in flight is an Episode: a single-turn response is an episode without an environment (no worker key,
no turns: one sampled run of tokens, ended by a stop or its budget), so the stages carry one type from the sampler's
output to the rows, across iterations too (rollout.segment_tokens).

The rollouts row is the learner's: `response_ids` is every token after the prompt in the order it was appended
(sampled turns and the observations between them), `loss_mask` 1 on the sampled tokens and 0 on the appended ones,
`sampler_logprobs` the sampler's log-prob of each sampled token (0.0 where the mask is 0). A turn's sampled ids are
response_ids[start:end]; what was appended after it runs to the next turn's start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from grpo.episodes.environment import ToolCall

ENDS = ("done", "max_turns", "budget", "lost")
"""How an episode ends: the environment said so (a tools adapter: a turn without a call), rollout.max_turns turns,
its token budget (a turn cut off, or an observation that does not fit), or its environment lost with its worker."""


@dataclass
class Turn:
    """One sampled assistant turn and what answered it."""

    start: int
    end: int
    """Its sampled ids are response_ids[start:end]."""
    text: str
    """As the model wrote it, its end-of-turn token dropped (for people and the environment; never re-tokenized)."""
    finish: str
    """stop (an end-of-turn token or a stop string) or length (cut off by the episode's budget)."""
    calls: list[ToolCall] = field(default_factory=list)
    observation: str | None = None
    """The text of the messages that answered it (their contents, one a line); None: nothing answered."""
    reply: list[dict] = field(default_factory=list)
    """The messages that answered it, as the environment gave them (a carried episode's replay must give them again)."""
    appended: int = 0
    """Tokens appended after it (the observation as the template renders it); 0 when it was not appended."""
    tool_s: float = 0.0
    """Seconds the environment took to answer it, in its worker."""
    errors: list[str] = field(default_factory=list)


def end_of(finish: str) -> str:
    """How a response without an environment ended, from the sampler's finish reason (Episode.finish_reason's
    inverse): its token budget (length) or a stop.

    >>> end_of("length"), end_of("stop")
    ('budget', 'done')
    """
    return "budget" if finish == "length" else "done"


@dataclass
class Episode:
    """One episode: a sample of a group, from its prompt to its end (across iterations, with rollout.segment_tokens)."""

    prompt_id: int
    sample_index: int
    key: tuple | None
    """Its place in the workers (grpo.episodes.workers); None: an episode without an environment (single-turn)."""
    prompt_text: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    """The conversation: the prompt's messages (with what reset added), then each turn and what was appended."""
    prompt_messages: int = 0
    """How many of `messages` are the prompt's."""
    budget: int = 0
    """Its tokens after the prompt, at most: rollout.max_tokens, or what the model's context leaves."""
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    end: str | None = None
    final: dict | None = None
    env_seed: int = 0
    """The seed its environment's calls draw from: that of the stage that reset it (Salt.ENVIRONMENT)."""
    row: dict = field(default_factory=dict)
    """What its reset was given (the dataset row, every column under its own name)."""
    added: list[dict] = field(default_factory=list)
    """What its reset added to the prompt."""
    open: int | None = None
    """Where the turn it is in the middle of starts (rollout.segment_tokens cut it); None: between turns."""
    ground_truth: str = ""
    row_json: str = "{}"
    """The dataset row's other columns, as the rollouts table stores them (grpo.data.row_json)."""
    started: int = 0
    """The iteration whose prompts its group was among."""
    versions: list[int] = field(default_factory=list)
    """The policy version of each token: the one that sampled it (an appended one: the one whose stage appended it)."""
    policy_hash: str = ""
    """Of the policy that appended its newest token."""
    before: int = 0
    """Its tokens when this stage began (a carried episode's: those of earlier iterations)."""

    def append(self, ids: list[int], sampled: bool, logprobs: list[float] | None, policy: tuple[int, str]) -> None:
        """Append tokens: sampled (mask 1, their sampler log-probs) or observed (mask 0, log-prob 0.0), each stamped
        with `policy` (version, content hash): the policy of the stage appending them."""
        self.response_ids += ids
        self.loss_mask += [int(sampled)] * len(ids)
        self.logprobs += logprobs if sampled else [0.0] * len(ids)
        self.versions += [policy[0]] * len(ids)
        self.policy_hash = policy[1] if ids else self.policy_hash

    @property
    def has_environment(self) -> bool:
        """False: a single-turn response (no worker, no turns, nothing carried beside its tokens)."""
        return self.key is not None

    @property
    def finish_reason(self) -> str:
        """The rollouts table's: length when the token budget ended it, else stop."""
        return "length" if self.end == "budget" else "stop"

    @property
    def finish(self) -> str | None:
        """finish_reason once it has ended; None while it goes on."""
        return None if self.end is None else self.finish_reason


def turn_columns(episodes: list[Episode], stamp: dict) -> dict[str, list]:
    """The turns table's columns (less run_id and iteration): a row per turn of each episode, in order."""
    rows = [(e, k, t) for e in episodes for k, t in enumerate(e.turns)]
    return {
        "prompt_id": [e.prompt_id for e, _, _ in rows],
        "sample_index": [e.sample_index for e, _, _ in rows],
        "turn": [k for _, k, _ in rows],
        "token_start": [t.start for _, _, t in rows],
        "token_end": [t.end for _, _, t in rows],
        "text": [t.text for _, _, t in rows],
        "finish_reason": [t.finish for _, _, t in rows],
        "tool_names": [[c.name for c in t.calls] for _, _, t in rows],
        "tool_arguments": [[json.dumps(c.arguments, sort_keys=True) for c in t.calls] for _, _, t in rows],
        "observation": [t.observation for _, _, t in rows],
        "observation_tokens": [t.appended for _, _, t in rows],
        "tool_errors": [len(t.errors) for _, _, t in rows],
        "error": [t.errors[0] if t.errors else None for _, _, t in rows],
        "policy_version": [stamp["policy_version"]] * len(rows),
    }


def episode_columns(episodes: list[Episode]) -> dict[str, list]:
    """The episodes table's columns (less run_id and iteration): a row per episode."""
    return {
        "prompt_id": [e.prompt_id for e in episodes],
        "sample_index": [e.sample_index for e in episodes],
        "turns": [len(e.turns) for e in episodes],
        "tool_calls": [sum(len(t.calls) for t in e.turns) for e in episodes],
        "tool_errors": [sum(len(t.errors) for t in e.turns) for e in episodes],
        "ended_by": [e.end for e in episodes],
        "messages": [json.dumps(e.messages[e.prompt_messages :], sort_keys=True, default=str) for e in episodes],
        "environment": [None if e.final is None else json.dumps(e.final, sort_keys=True) for e in episodes],
    }
