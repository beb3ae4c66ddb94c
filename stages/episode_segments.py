"""Partial rollouts of episodes (rollout.segment_tokens with rollout.tools or rollout.environment), a part of the
rollouts stage: the rounds of stages/segments.py, each response an episode (grpo/episodes).

    open: the G episodes of each new prompt reset, as without segments (the stage's environment seed); the environment
        of each episode carried in re-created by replay: reset with its seed, each answered turn asked again with its
        seed, every answer checked against the one recorded (Loop.reopen)
    a round: every unfinished episode goes on until it ends or has sampled B tokens in the round (Loop.advance): a turn
        cut at B stays open and the next round or iteration continues it from exactly its ids; a turn that ends is
        answered and its observation appended, as without segments (appended tokens are sampled by no policy: they
        count to max_tokens, not to B, and carry the version of the iteration that appended them)
    close: the final state of each episode that ended here, every other environment closed
    write: the turns and episodes tables of the released episodes, as without segments (a turn's policy_version: the
        one that sampled its last token); what is carried on keeps the rest in its `episode` (grpo.episodes.carry)

Which rows, as for single-turn segments: the sampler's numbers come from (the iteration, the round, the episode, the
turn), an environment's from the seed of the stage that reset it, the episode and the turn, so a rerun, a resumed run
and a fork commit the same bytes; an environment that answers otherwise on replay fails the stage in one line.
"""

from __future__ import annotations

import dataclasses
import time

from grpo.config import RunConfig
from grpo.episodes import carry
from grpo.episodes.records import episode_columns, turn_columns
from grpo.episodes.workers import Item
from grpo.record.layout import Salt, iteration_seed
from grpo.record.storage import Storage
from grpo.sampling.base import Generator, SamplingSpec
from schemas import ParquetWriter, table_file
from stages.prompts import Prompts, episode_starts
from stages.samples import episode_loop
from stages.segments import Held, Response


class Episodes:
    """A segmented stage's episodes: the loop over its sampler and workers, and the episodes whose environments it
    holds (those carried in and those started here)."""

    def __init__(self, gen: Generator, p: Prompts, env, cfg: RunConfig, iteration: int):
        self.loop, self.cfg, self.iteration = episode_loop(gen, p, env.workers, cfg), cfg, iteration
        self.here: list[Response] = []
        self.replay_s, self.replayed = 0.0, 0

    def open(self, p: Prompts, carried: list[Response], new: list[Response]) -> None:
        """Re-create the environments of the unfinished episodes `carried` in; reset those of `new` (the responses
        started here, in stages.segments.started_here's order), each response then its episode's."""
        going = [x for x in carried if x.finish is None]
        t0 = time.perf_counter()
        self.loop.reopen([x.ep for x in going])
        self.replay_s, self.replayed = time.perf_counter() - t0, len(going)
        n, g = self.cfg.rollout.prompts_per_iteration, self.cfg.rollout.group_size
        placed = dataclasses.replace(p, index=[self.iteration * n + i for i in p.index])  # their prompt_ids
        seed = iteration_seed(self.cfg.seed, self.iteration, Salt.ENVIRONMENT)
        started = [e for group in self.loop.open(episode_starts(placed, slice(None), self.cfg), g, seed) for e in group]
        for x, e in zip(new, started, strict=True):
            carry.check_row(e)  # before anything is sampled
            x.ep, x.prompt, x.prompt_ids, x.budget = e, e.prompt_text, e.prompt_ids, e.budget
            x.response_ids, x.loss_mask, x.logprobs = e.response_ids, e.loss_mask, e.logprobs  # one list each
        self.here = going + new

    def advance(self, live: list[Response], spec: SamplingSpec, b: int, rows: int, stamp: dict) -> int:
        """Each episode of `live` on by at most `b` sampled tokens, `rows` episodes a sampler call; returns the tokens
        sampled."""
        sampled = 0
        for at in range(0, len(live), rows):
            part = live[at : at + rows]
            sampled += self.loop.advance([x.ep for x in part], spec, b)
            for x in part:
                new = len(x.response_ids) - len(x.versions)
                x.versions += [stamp["policy_version"]] * new
                x.policy_hash = stamp["policy_hash"] if new else x.policy_hash
                x.finish = None if x.ep.end is None else x.ep.finish_reason
        return sampled

    def close(self) -> None:
        """The final state of each episode that ended in this stage; every other environment here closed."""
        self.loop.finish([x.ep for x in self.here if x.ep.end is not None])
        self.loop.workers.run("close", [Item(x.ep.key, 0) for x in self.here if x.ep.end is None])

    def write(self, storage: Storage, writer, run_id: str, held: Held) -> None:
        """The turns and episodes tables of the released episodes."""
        released = [x for group in held.release for x in group]
        done = [x.ep for x in released]
        turns, rows = turn_columns(done, {"policy_version": None}), episode_columns(done)
        turns["policy_version"] = [x.versions[t.end - 1] if t.end else -1 for x in released for t in x.ep.turns]
        for table, columns in (("turns", turns), ("episodes", rows)):
            n = len(columns["prompt_id"])
            with ParquetWriter(storage.fs, writer.path(table_file(table)), table) as out:
                out.write({"run_id": [run_id] * n, "iteration": [self.iteration] * n} | columns)

    def summary(self, held: Held) -> dict:
        """The rollouts summary's episode figures (as without segments): turns per released episode, their tool calls
        and errors; seconds environments took answering turns here (in their workers, all together), the longest; the
        carried episodes whose environments were re-created, and the seconds that took (what carrying costs)."""
        done = [x.ep for group in held.release for x in group]
        seconds = [t.tool_s for x in self.here for t in x.ep.turns]
        return {
            "turns_per_episode": sum(len(e.turns) for e in done) / max(len(done), 1),
            "tool_calls": sum(len(t.calls) for e in done for t in e.turns),
            "tool_errors": sum(len(t.errors) for e in done for t in e.turns),
            "tool_s": sum(seconds),
            "tool_s_max": max(seconds, default=0.0),
            "episodes_replayed": self.replayed,
            "replay_s": self.replay_s,
        }
