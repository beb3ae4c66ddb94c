"""An episode carried from one iteration to the next (rollout.segment_tokens): what the carried table keeps of it.

Its tokens stay where a single-turn response's do, in the carried row's columns (response_ids, loss_mask,
sampler_logprobs, token_versions); its `episode` column holds the rest as JSON: the conversation, each turn (its span,
text, calls, what answered it), the turn it is in the middle of, how it ended and its final state (an episode whose
group still waits), what its reset was given and added, and its environment's seed. Timings are left out, so a
rerun writes the same bytes. Its environment is not stored: the next iteration's stage re-creates it by replay
(grpo.episodes.loop.Loop.reopen).
"""

from __future__ import annotations

import dataclasses
import json

from grpo.episodes.environment import ToolCall
from grpo.episodes.records import Episode, Turn
from grpo.errors import StageError

KEPT = ("messages", "prompt_messages", "budget", "end", "final", "env_seed", "row", "added", "open")
"""The Episode fields the JSON holds beside its turns (its tokens and prompt are the row's columns)."""


def check_row(e: Episode) -> None:
    """A dataset row JSON cannot hold as it is (a date, a decimal) is refused in one line: a carried episode's replay
    would reset its environment with another row than its first reset had."""
    kept = [k for k, v in e.row.items() if not _plain(v)]
    if kept:
        raise StageError(
            f"rollout.segment_tokens: the dataset row of prompt_id {e.prompt_id} has columns JSON does not hold as "
            f"they are ({', '.join(map(str, kept))}), and a carried episode's environment is reset again from its "
            "stored row; cast them to plain values (str, int, float, bool, lists of them) or unset "
            "rollout.segment_tokens"
        )


def _plain(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def dumps(e: Episode) -> str:
    """The carried table's `episode` of `e` (its row checked: check_row)."""
    check_row(e)
    turns = [{k: v for k, v in dataclasses.asdict(t).items() if k != "tool_s"} for t in e.turns]  # a timing
    return json.dumps({**{k: getattr(e, k) for k in KEPT}, "turns": turns}, sort_keys=True, default=str)


def loads(text: str, e: Episode) -> Episode:
    """The episode a carried row holds: `e`, made from the row's columns (its prompt and token lists), given the
    rest from the row's `episode`; its worker key () until its environment is re-created (Loop.reopen)."""
    state = json.loads(text)
    e.turns = [Turn(**{**t, "calls": [ToolCall(**c) for c in t["calls"]]}) for t in state.pop("turns")]
    e.key = ()
    for k in KEPT:
        setattr(e, k, state[k])
    return e
