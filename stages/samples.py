"""What a rollouts stage does with its episodes (grpo/episodes; a single-turn response is an episode without an
environment): the loop over its sampler and environments, and the rows they become: the rollouts table's (a row per
episode) and, with an environment, the turns table's (a row per sampled assistant turn) and the episodes table's (how
each ended, its conversation, its environment's final state), in the rollouts' attempt; and what those rows counted,
for the stage's summary.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo.config import RolloutConfig, RunConfig
from grpo.episodes.loop import Limits, Loop, Start
from grpo.episodes.records import Episode, end_of, episode_columns, turn_columns
from grpo.record.commit import StageWriter
from grpo.record.storage import Storage
from grpo.sampling.base import Generator, SamplingSpec, decode_responses
from grpo.sampling.rollout_func import RolloutFunction
from grpo.tasks.base import episode_arguments
from schemas import ParquetWriter, table_file
from stages.prompts import Environments, Prompts, episode_starts


def episode_loop(gen: Generator, p: Prompts, env: Environments, cfg: RunConfig, stamp: dict | None = None) -> Loop:
    """The episode loop of a stage (grpo/episodes) over its sampler and environments (none: single-turn), bounded by
    the rollout settings, stamping each token with the policy of `stamp` (stages.rollouts.policy_stamp). With an
    environment the sampler's prefix cache is emptied first, so what a turn reuses depends on the stage's own requests
    (a resumed stage commits the same bytes)."""
    r, policy = cfg.rollout, (-1, "") if stamp is None else (stamp["policy_version"], stamp["policy_hash"])
    if env.workers is not None:
        gen.reset_prefix_cache()
    limits = Limits(r.max_turns, r.max_tokens, p.context, r.tool_timeout_s)
    return Loop(gen, p.tokenizer, p.eos_ids, env.workers, limits, policy)


def sampling_spec(r: RolloutConfig, seed: int) -> SamplingSpec:
    """The rollout settings as the sampler takes them, seeded."""
    return SamplingSpec(
        n=r.group_size, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens, stop=tuple(r.stop), seed=seed
    )


def sample_all(gen: Generator, p: Prompts, spec: SamplingSpec, env: Environments, cfg: RunConfig, seed: int,
               progress=None) -> list[list[Episode]]:  # fmt: skip
    """Every prompt of `p` sampled at once, spec.n episodes of each, grouped by prompt (the held-out eval's; `seed`
    its environments')."""
    return episode_loop(gen, p, env, cfg).run(episode_starts(p, slice(None), cfg), spec, seed, progress)


def sample_chunk(loop: Loop, fn: RolloutFunction | None, starts: list[Start], spec: SamplingSpec, seed: int,
                 p: Prompts, progress=None) -> list[list[Episode]]:  # fmt: skip
    """The spec.n episodes of each start, grouped: the loop's (`seed`: its environments'), or, with rollout.rollout_func
    (`fn`: TRL's rollout_func, single-turn alone), the function's in place of the loop's one sampler call, each episode
    as it made it (its own prompt ids, loss mask and log-probs) and stamped with the loop's policy."""
    if fn is None:
        return loop.run(starts, spec, seed, progress)
    groups = loop.open(starts, spec.n, seed)
    made = fn(loop.gen, p.tokenizer, [s.text for s in starts], spec, p.context)
    for e, s in zip([e for group in groups for e in group], [s for group in made for s in group], strict=True):
        e.prompt_ids, e.response_ids, e.loss_mask = list(s.prompt_ids), list(s.response_ids), list(s.loss_mask)
        e.logprobs, e.versions = list(s.logprobs), [loop.policy[0]] * len(s.response_ids)
        e.policy_hash, e.end = loop.policy[1], end_of(s.finish_reason)
    if progress is not None:
        progress(len(starts))
    return groups


def rollouts_columns(run_id: str, iteration: int, groups: list[list[Episode]], p: Prompts, stamp: dict | None = None):
    """The rollouts table's columns of `groups`, each prompt's episodes together: a row per episode as the learner
    reads it. With `stamp` every token is by the stage's policy (token_versions null); without, each token's version
    is listed and the row's policy is the one that appended its newest token (rollout.segment_tokens)."""
    rows = [e for group in groups for e in group]
    n, ids = len(rows), [e.response_ids for e in rows]
    out = {
        "run_id": [run_id] * n,
        "iteration": [iteration] * n,
        "prompt_id": [e.prompt_id for e in rows],
        "sample_index": [e.sample_index for e in rows],
        "prompt": [e.prompt_text for e in rows],
        "prompt_ids": [e.prompt_ids for e in rows],
        "response_ids": ids,
        "response": decode_responses(p.tokenizer, ids, p.eos_ids),
        "sampler_logprobs": [e.logprobs for e in rows],
        "loss_mask": [e.loss_mask for e in rows],
        "finish_reason": [e.finish_reason for e in rows],
        "ground_truth": [e.ground_truth for e in rows],
        "row": [e.row_json for e in rows],
    }
    if stamp is not None:
        return out | {"token_versions": [None] * n} | {k: [v] * n for k, v in stamp.items()}
    return out | {
        "token_versions": [e.versions for e in rows],
        "policy_version": [max(e.versions, default=-1) for e in rows],
        "policy_hash": [e.policy_hash for e in rows],
    }


@dataclass
class Counts:
    """What the rows a rollouts stage wrote count: episodes, response tokens, stopped ones; with an environment, their
    turns, tool calls and errors, and the seconds environments took answering (timings stay out of the tables)."""

    samples: int = 0
    tokens: int = 0
    stops: int = 0
    turns: int = 0
    calls: int = 0
    errors: int = 0
    tool_s: float = 0.0
    slowest: float = 0.0

    def add(self, episodes: list[Episode], answered: list[Episode] | None = None) -> None:
        """Count the episodes written; the seconds of the turns of `answered` (those answered in this stage, by
        default the episodes written)."""
        self.samples += len(episodes)
        self.tokens += sum(len(e.response_ids) for e in episodes)
        self.stops += sum(e.finish_reason == "stop" for e in episodes)
        self.turns += sum(len(e.turns) for e in episodes)
        self.calls += sum(len(t.calls) for e in episodes for t in e.turns)
        self.errors += sum(len(t.errors) for e in episodes for t in e.turns)
        seconds = [t.tool_s for e in (episodes if answered is None else answered) for t in e.turns]
        self.tool_s, self.slowest = self.tool_s + sum(seconds), max([self.slowest] + seconds)

    def summary(self, environment: bool, loop: Loop) -> dict:
        """The rollouts summary's figures of them; with an environment also turns per episode, the iteration's tool
        calls and errors, the seconds environments took (in their workers, all together) and the longest answer, the
        observations `loop` cut (rollout.max_observation_bytes, or longer than an episode's budget holds) and the
        episodes it lost with a worker another's call killed and re-created on a fresh one."""
        n = max(self.samples, 1)
        out = {"samples": self.samples, "response_tokens": self.tokens, "stop_fraction": self.stops / n}
        if not environment:
            return out
        return out | {
            "turns_per_episode": self.turns / n,
            "tool_calls": self.calls,
            "tool_errors": self.errors,
            "tool_s": self.tool_s,
            "tool_s_max": self.slowest,
            "observations_cut": loop.cut,
            "episodes_rerun": loop.rerun,
        }


class Rows:
    """The tables a rollouts stage writes its episodes to, in its attempt: rollouts, and with an environment turns and
    episodes (each write one row group of each); what they counted."""

    def __init__(self, storage: Storage, writer: StageWriter, env: Environments):
        self.environment = env.workers is not None
        names = ("rollouts", "turns", "episodes") if self.environment else ("rollouts",)
        self.tables = {t: ParquetWriter(storage.fs, writer.path(table_file(t)), t) for t in names}
        self.counts = Counts()

    def write(self, run_id: str, iteration: int, groups: list[list[Episode]], p: Prompts, stamp: dict) -> dict:
        """One chunk's episodes, every token by the stage's policy (`stamp`), to each table; returns its rollouts
        columns."""
        columns = self.rollouts(run_id, iteration, groups, p, stamp)
        self.episodes(run_id, iteration, [e for group in groups for e in group], stamp)
        return columns

    def rollouts(self, run_id: str, iteration: int, groups: list[list[Episode]], p: Prompts, stamp=None) -> dict:
        """Rows of the rollouts table (rollouts_columns); returns their columns."""
        columns = rollouts_columns(run_id, iteration, groups, p, stamp)
        self.tables["rollouts"].write(columns)
        return columns

    def episodes(self, run_id: str, iteration: int, done: list[Episode], stamp=None, answered=None) -> None:
        """The turns and episodes tables' rows of `done` (nothing without an environment), counted; each turn's
        policy_version the stage's (`stamp`), or the one that sampled its last token."""
        self.counts.add(done, answered)
        if not self.environment:
            return
        turns = turn_columns(done, stamp or {"policy_version": None})
        if stamp is None:
            turns["policy_version"] = [e.versions[t.end - 1] if t.end else -1 for e in done for t in e.turns]
        for table, columns in (("turns", turns), ("episodes", episode_columns(done))):
            n = len(columns["prompt_id"])
            self.tables[table].write({"run_id": [run_id] * n, "iteration": [iteration] * n} | columns)

    def summary(self, loop: Loop) -> dict:
        """The rollouts summary's figures of the rows written by `loop` (Counts.summary)."""
        return self.counts.summary(self.environment, loop)

    def close(self) -> None:
        for table in self.tables.values():
            table.close()

    def __enter__(self) -> Rows:
        return self

    def __exit__(self, *_) -> None:
        self.close()


def reward_arguments(episodes: list[Episode]) -> list[dict]:
    """What reward functions get of each episode beside its dataset row: its environment's final state and its
    messages (grpo.tasks.base.episode_arguments); nothing without an environment."""
    return [episode_arguments(e.final, e.messages[e.prompt_messages :]) if e.has_environment else {} for e in episodes]
