"""Where the warm start's conversations come from (sft.source), each pinned in the sft stage's identity and manifest:

- `dataset`: a file or a hub dataset in TRL's conversational SFT shapes (grpo.data.load_conversations); pinned by its
  fingerprint (grpo.record.pins);
- `history`: rollouts of a run's committed iterations that a DuckDB query over `grpo query`'s views selects (the
  correct ones, the shortest correct one per prompt, ...); pinned by the query and, as the stage's inputs, every
  committed rollouts attempt it read;
- `teacher`: another model's responses to the run's training prompts, sampled as the rollouts stage samples (the run's
  prompt rendering, rollout.temperature, the hf or vLLM sampler); pinned by the teacher's folder hash.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grpo import data
from grpo.config import ConfigError, RunConfig
from grpo.errors import DatasetError
from grpo.record import pins
from grpo.record.storage import Committed, Storage
from stages.common import StageError


@dataclass(frozen=True)
class Conversation:
    """One conversation to train on: its chat messages, the tools its template renders, where it came from."""

    messages: list[dict]
    tools: list[dict] = field(default_factory=list)
    origin: dict = field(default_factory=dict)
    where: str = "a conversation"  # how an error names it


def conversations(
    storage: Storage, cfg: RunConfig, run_id: str, base: Committed
) -> tuple[list[Conversation], dict, dict[str, Committed]]:
    """(the conversations, what identifies what was read, committed attempts read: the stage's further inputs)."""
    s = cfg.sft
    if s.source == "dataset":
        return from_dataset(s.dataset, s.split)
    if s.source == "history":
        return from_history(storage, cfg, run_id)
    return from_teacher(storage, cfg, run_id, base)


def from_dataset(uri: str, split: str) -> tuple[list[Conversation], dict, dict]:
    rows = data.load_conversations(uri, split)
    hub = data.is_hub_id(uri)
    try:
        fingerprint = f"hub:{uri}@{split}" if hub else pins.fingerprint(uri)
    except DatasetError as e:
        raise ConfigError(f"sft.dataset: {e}") from e
    out = [Conversation(m, t, {"row": i}, f"sft.dataset {uri} row {i}") for i, (m, t) in enumerate(rows)]
    return out, {"dataset": uri, "split": split if hub else None, "fingerprint": fingerprint}, {}


def from_history(storage: Storage, cfg: RunConfig, run_id: str) -> tuple[list[Conversation], dict, dict]:
    """The rollouts of sft.history_run that sft.history_sql selects (its rows' iteration, prompt_id, sample_index),
    each the conversation its episode had (or the prompt and the sampled response)."""
    raise StageError("sft.source=history: not yet")


def from_teacher(
    storage: Storage, cfg: RunConfig, run_id: str, base: Committed
) -> tuple[list[Conversation], dict, dict]:
    raise StageError("sft.source=teacher: not yet")
