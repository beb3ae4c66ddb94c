"""What a rollouts stage does with each chunk of its prompts: samples it, single-turn (the sampler's G samples of each
prompt) or as episodes (rollout.tools, rollout.environment: the episode loop of grpo/episodes over the stage's sampler
and environment workers), and writes its rows: the rollouts table's, a row per sample; with episodes also the turns
table's (a row per sampled assistant turn) and the episodes table's (how each ended, its conversation, its
environment's final state), in the rollouts' attempt. Each chunk is one row group of each table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

from grpo import data
from grpo.config import RolloutConfig, RunConfig
from grpo.episodes.environment import FinalState
from grpo.episodes.loop import Limits, Loop
from grpo.episodes.records import Episode, episode_columns, turn_columns
from grpo.episodes.workers import Workers
from grpo.record.commit import StageWriter
from grpo.record.storage import Storage
from grpo.sampling.base import Generator, Sample, SamplingSpec, decode_responses
from grpo.sampling.rollout_func import RolloutFunction, RolloutSample
from schemas import ParquetWriter, table_file
from stages.prompts import Prompts, episode_starts


def chunk_columns(
    run_id: str, iteration: int, p: Prompts, chunk: slice, groups: list[list[Sample | Episode]], stamp: dict
) -> dict[str, list]:
    """The rollouts table's columns for one chunk: a row per sample (an episode: with its own prompt, rendered with
    what its environment's reset added, and its loss mask), each prompt's group together."""
    samples = [s for group in groups for s in group]
    n, episodes = len(samples), p.tools is not None
    own = episodes or any(isinstance(s, RolloutSample) for s in samples)  # each sample its prompt ids and mask

    def per_sample(values) -> list:  # one value per prompt -> one per sample
        return [v for v, group in zip(values, groups) for _ in group]

    return {
        "run_id": [run_id] * n,
        "iteration": [iteration] * n,
        "prompt_id": per_sample(p.index[chunk]),
        "sample_index": [j for group in groups for j in range(len(group))],
        "prompt": [s.prompt_text for s in samples] if episodes else per_sample(p.texts[chunk]),
        "prompt_ids": [s.prompt_ids for s in samples] if own else per_sample(p.ids[chunk]),
        "response_ids": [s.response_ids for s in samples],
        "response": decode_responses(p.tokenizer, [s.response_ids for s in samples], p.eos_ids),
        "sampler_logprobs": [s.logprobs for s in samples],
        "loss_mask": [s.loss_mask if own else [1] * len(s.response_ids) for s in samples],
        "token_versions": [None] * n,  # every token by the row's policy_version
        "finish_reason": [s.finish_reason for s in samples],
        "ground_truth": per_sample([e.ground_truth for e in p.examples[chunk]]),
        "row": per_sample([data.row_json(e) for e in p.examples[chunk]]),
    } | {k: [v] * n for k, v in stamp.items()}


def episode_loop(gen: Generator, p: Prompts, workers: Workers, cfg: RunConfig) -> Loop:
    """The episode loop of a stage (grpo/episodes) over its sampler and workers, bounded by the rollout settings; the
    sampler's prefix cache emptied, so what it reuses depends on the stage's own requests (a resumed stage commits the
    same bytes)."""
    r = cfg.rollout
    gen.reset_prefix_cache()
    return Loop(gen, p.tokenizer, p.eos_ids, workers, Limits(r.max_turns, r.max_tokens, p.context, r.tool_timeout_s))


def sampling_spec(r: RolloutConfig, seed: int) -> SamplingSpec:
    """The rollout settings as the sampler takes them, seeded."""
    return SamplingSpec(
        n=r.group_size, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens, stop=tuple(r.stop), seed=seed
    )


@dataclasses.dataclass
class Tally:
    """What a rollouts stage has sampled and written so far: response tokens, stopped samples, seconds in the
    sampler's generate calls (an episode's environment's included); with episodes, their loop and tables; with
    rollout.rollout_func, the function that makes each chunk's samples."""

    tokens: int = 0
    stops: int = 0
    generate_s: float = 0.0
    episodes: Episodes | None = None
    rollout: RolloutFunction | None = None

    def sample(
        self,
        gen,
        p: Prompts,
        chunk: slice,
        spec: SamplingSpec,
        out: ParquetWriter,
        run_id: str,
        iteration: int,
        stamp: dict,
        progress=None,
    ) -> tuple[dict[str, list], list[list[Sample]]]:
        """Sample one chunk of prompts and write its rows to `out`: (its columns, its groups); `progress(k)` as
        the chunk's first k prompts' samples end (the sampler's, which it never changes)."""
        t0 = time.perf_counter()
        if self.episodes is not None:
            groups = self.episodes.sample(p, chunk, spec, run_id, iteration, stamp, progress)
        elif self.rollout is not None:
            groups = self.rollout(gen, p.tokenizer, p.texts[chunk], spec, p.context)
        else:
            groups = gen.generate(p.ids[chunk], spec, p.budgets[chunk], progress)
        self.generate_s += time.perf_counter() - t0
        columns = chunk_columns(run_id, iteration, p, chunk, groups, stamp)
        out.write(columns)
        self.tokens += sum(map(len, columns["response_ids"]))
        self.stops += columns["finish_reason"].count("stop")
        return columns, groups

    def tables(self):
        """The episodes' tables, closed when the stage is done with them (nothing without episodes)."""
        return contextlib.nullcontext() if self.episodes is None else contextlib.closing(self.episodes)

    def rows(self, samples: int) -> dict:
        """The summary's figures of the rows written (with episodes, theirs: Episodes.summary)."""
        out = {"samples": samples, "response_tokens": self.tokens, "stop_fraction": self.stops / max(samples, 1)}
        return out | (self.episodes.summary(samples) if self.episodes is not None else {})


class Episodes:
    """A stage's episodes (grpo/episodes): the loop over its sampler and workers, the turns and episodes tables
    written beside the rollouts, what they counted."""

    def __init__(
        self,
        storage: Storage,
        writer: StageWriter,
        gen: Generator,
        p: Prompts,
        workers: Workers,
        cfg: RunConfig,
        seed: int,
    ):
        """`seed`: the environments' (grpo.record.layout.Salt.ENVIRONMENT). The sampler's prefix cache starts empty,
        so what it reuses depends on this stage's requests alone (a resumed stage commits the same bytes)."""
        self.loop, self.cfg, self.seed = episode_loop(gen, p, workers, cfg), cfg, seed
        self.turns = self.calls = self.errors = 0
        self.tool_s, self.slowest = 0.0, 0.0  # seconds environments took: timings stay out of the tables' bytes
        self.tables = {t: ParquetWriter(storage.fs, writer.path(table_file(t)), t) for t in ("turns", "episodes")}

    def sample(
        self, p: Prompts, chunk: slice, spec: SamplingSpec, run_id: str, iteration: int, stamp: dict, progress=None
    ) -> list[list[Episode]]:
        """The episodes of one chunk of prompts, grouped by prompt; their turns and episodes rows written."""
        groups = self.loop.run(episode_starts(p, chunk, self.cfg), spec, self.seed, progress)
        done = [e for group in groups for e in group]
        turns, rows = turn_columns(done, stamp), episode_columns(done)
        for table, columns in (("turns", turns), ("episodes", rows)):
            n = len(columns["prompt_id"])
            self.tables[table].write({"run_id": [run_id] * n, "iteration": [iteration] * n} | columns)
        self.turns += sum(rows["turns"])
        self.calls += sum(rows["tool_calls"])
        self.errors += sum(rows["tool_errors"])
        seconds = [t.tool_s for e in done for t in e.turns]
        self.tool_s, self.slowest = self.tool_s + sum(seconds), max([self.slowest] + seconds)
        return groups

    def summary(self, samples: int) -> dict:
        """The rollouts summary's episode figures: turns per episode, tool calls and errors of the iteration, the
        seconds environments took answering turns (in their workers, all together) and the longest answer."""
        return {
            "turns_per_episode": self.turns / max(samples, 1),
            "tool_calls": self.calls,
            "tool_errors": self.errors,
            "tool_s": self.tool_s,
            "tool_s_max": self.slowest,
        }

    def close(self) -> None:
        for table in self.tables.values():
            table.close()


def sample_all(gen: Generator, p: Prompts, spec: SamplingSpec, env, cfg: RunConfig, seed: int, progress=None) -> list:
    """Every prompt of `p` sampled at once, grouped by prompt: the sampler's spec.n samples of each, or with `env`
    (stages.prompts.environments: episodes) spec.n episodes of each (the held-out eval's; `seed` its environments')."""
    if env is None:
        return gen.generate(p.ids, spec, p.budgets, progress)
    loop = episode_loop(gen, p, env[0], cfg)
    return loop.run(episode_starts(p, slice(None), cfg), spec, seed, progress)


def reward_arguments(samples: list) -> list[dict]:
    """What reward functions get of each sample beside its dataset row: an episode's environment and messages
    (grpo.tasks.functions.EPISODE_ARGUMENTS), nothing for a single-turn sample."""
    return [
        {"environment": None if s.final is None else FinalState(s.final), "messages": s.messages[s.prompt_messages :]}
        if isinstance(s, Episode)
        else {}
        for s in samples
    ]
