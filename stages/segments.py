"""Partial rollouts (rollout.segment_tokens B), a part of the rollouts stage: an iteration samples at most B new tokens
per response, and hands what has not ended, unfinished, to the next iteration's rollouts.

    responses = those the previous iteration carried (its `carried` table) + G of each of this iteration's prompts
    a round (one, unless fewer than a minibatch of groups would be complete):
        every unfinished response continued by at most B tokens: one sampler call a chunk, each response's context
        exactly its prompt's ids and its ids so far (never decoded and encoded again), its random numbers drawn from
        (the iteration, the round, the response) alone; each token recorded with this iteration's policy version
    release the oldest complete groups (prompt_id order), prompts_per_iteration of them where that many are complete,
        in whole minibatches: the rollouts table, what rewards, advantages and learn read
    the rest, unfinished or ended with their group still waiting, to the `carried` table: the next iteration's input
    a row per response held to the `segments` table: what became of it here
With rollout.tools or rollout.environment each response is an episode, continued turn by turn and its environment
re-created by replay (stages/episode_segments.py).

How many new prompts. Every iteration starts its own prompts_per_iteration prompts (those it would start without
segments), whatever it carries: as AReaL admits a batch of new prompts per policy version and its trainer takes a
batch of complete ones, the learn takes prompts_per_iteration groups once the pipeline is full, and fewer (whole
minibatches) only while it fills, in the first iterations. Complete groups it cannot take wait for the next learn,
oldest first; what waits is bounded (every response ends within ceil(max_tokens / B) iterations). An iteration that
would release less than one minibatch samples another round with the same policy, as a learner waits for its batch.

Which rows. A group's prompt_id is its place in the run's prompts, started x prompts_per_iteration + its place among
that iteration's, so rows of groups started in different iterations never share one. What an iteration samples and
releases depends on the committed inputs (its policy, the previous iteration's carried table) and the seeds alone,
never on timing: a rerun, a resumed run, a fork and a placed stage commit the same rows.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field

from grpo.config import RunConfig
from grpo.episodes import carry
from grpo.episodes.records import Episode
from grpo.progress import Progress
from grpo.record.layout import Salt, episode_seed, round_seed
from grpo.record.storage import Committed, Storage
from grpo.sampling.base import Generator, SamplingSpec, decode_responses
from schemas import ParquetWriter, read_parquet, table_file
from stages import samples
from stages.prompts import Prompts


@dataclass
class Response:
    """One response in flight, from its prompt to its end, across iterations."""

    prompt_id: int
    sample_index: int
    started: int
    """The iteration whose prompts its group was among."""
    prompt: str
    prompt_ids: list[int]
    budget: int
    """Its most tokens after the prompt: rollout.max_tokens, or what the model's context leaves."""
    ground_truth: str
    row: str
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The policy version that sampled each token (an episode's appended ones: the iteration's that appended them)."""
    finish: str | None = None
    """stop or length once ended; None while unfinished."""
    policy_hash: str = ""
    """Of the policy that sampled its newest token."""
    ep: Episode | None = None
    """An episode's turns and conversation so far (grpo/episodes: its token lists are this response's own); None: a
    single-turn response."""
    before: int = 0
    """Its tokens when this iteration began."""

    def extend(self, ids: list[int], logprobs: list[float], mask: list[int], version: int) -> None:
        """Append tokens sampled (mask 1) or appended (mask 0) by the policy of `version`."""
        self.response_ids += ids
        self.logprobs += logprobs
        self.loss_mask += mask
        self.versions += [version] * len(ids)


def carried_in(storage: Storage, previous: Committed | None) -> list[Response]:
    """The responses the previous iteration's rollouts carried on (none in iteration 0), in prompt_id order."""
    if previous is None:
        return []
    table = read_parquet(storage.fs, previous.read_path(table_file("carried")), "carried").to_pylist()
    out = []
    for r in table:
        ids, logprobs, mask = list(r["response_ids"]), list(r["sampler_logprobs"]), list(r["loss_mask"])
        x = Response(
            r["prompt_id"], r["sample_index"], r["started"], r["prompt"], list(r["prompt_ids"]), r["budget"],
            r["ground_truth"], r["row"], ids, logprobs, mask, list(r["token_versions"]), r["finish_reason"],
            r["policy_hash"], before=len(ids),
        )  # fmt: skip
        if r["episode"] is not None:
            x.ep = carry.loads(r["episode"], x.prompt, x.prompt_ids, ids, mask, logprobs, x.prompt_id, x.sample_index)
        out.append(x)
    return out


def started_here(p: Prompts, iteration: int, n: int, g: int) -> list[Response]:
    """G new responses of each of the iteration's prompts `p` (prompt_id iteration x n + its place, n:
    prompts_per_iteration)."""
    from grpo import data

    return [
        Response(iteration * n + i, j, iteration, text, list(ids), budget, e.ground_truth, data.row_json(e))
        for i, text, ids, budget, e in zip(p.index, p.texts, p.ids, p.budgets, p.examples)
        for j in range(g)
    ]


def segment_seeds(seed: int, live: list[Response]) -> list[int]:
    """Each response's seed for a round whose seed is `seed`: a hash of it and the response alone, whatever else
    shares the sampler call (grpo.record.layout.episode_seed: a single-turn response is an episode of one turn)."""
    return [episode_seed(seed, x.prompt_id, x.sample_index, 0) for x in live]


def advance(
    gen: Generator, live: list[Response], spec: SamplingSpec, b: int, rows: int, stamp: dict, progress=None
) -> int:
    """Continue each response of `live` by at most `b` tokens, `rows` responses a sampler call; each from exactly its
    prompt's ids and its ids so far, seeded by spec.seed and itself. Returns the tokens sampled."""
    one, sampled = dataclasses.replace(spec, n=1), 0
    for at in range(0, len(live), rows):
        part = live[at : at + rows]
        contexts = [x.prompt_ids + x.response_ids for x in part]
        budgets = [min(b, x.budget - len(x.response_ids)) for x in part]
        done = None if progress is None else (lambda k, at=at: progress(at + k))
        out = gen.generate(contexts, one, budgets, done, seeds=segment_seeds(spec.seed, part))
        for x, [s] in zip(part, out):
            x.extend(list(s.response_ids), list(s.logprobs), [1] * len(s.response_ids), stamp["policy_version"])
            x.policy_hash = stamp["policy_hash"]
            sampled += len(s.response_ids)
            if s.finish_reason == "stop" or len(x.response_ids) >= x.budget:
                x.finish = s.finish_reason
    return sampled


def groups_of(responses: list[Response]) -> list[list[Response]]:
    """The responses by group, in prompt_id order (each group's in sample order)."""
    by: dict[int, list[Response]] = {}
    for x in sorted(responses, key=lambda x: (x.prompt_id, x.sample_index)):
        by.setdefault(x.prompt_id, []).append(x)
    return list(by.values())


def released(complete: int, n: int, per_step: int) -> int:
    """How many of `complete` complete groups a learn takes: n (prompts_per_iteration) where that many are complete,
    else the whole minibatches (of `per_step` groups) there are.

    >>> released(11, 8, 4), released(7, 8, 4), released(3, 8, 4), released(8, 8, 4)
    (8, 4, 0, 8)
    """
    return min(complete, n) // per_step * per_step


@dataclass
class Held:
    """What an iteration holds once sampled: the groups it releases, the responses it carries on, all of them."""

    release: list[list[Response]]
    carry: list[Response]
    responses: list[Response]


def hold(responses: list[Response], n: int, per_step: int) -> Held:
    """Split the iteration's responses into the groups released (the oldest complete ones: `released`) and the rest."""
    groups = groups_of(responses)
    complete = [grp for grp in groups if all(x.finish is not None for x in grp)]
    release = complete[: released(len(complete), n, per_step)]
    out = {id(x) for grp in release for x in grp}
    return Held(release, [x for grp in groups for x in grp if id(x) not in out], [x for grp in groups for x in grp])


def sample_segments(gen: Generator, p: Prompts, responses: list[Response], cfg: RunConfig, iteration: int,
                    stamp: dict, report: Progress, episodes=None) -> tuple[Held, dict]:  # fmt: skip
    """Round after round until at least a minibatch of groups is complete (or nothing is left unfinished): (what the
    iteration holds, the summary's sampling figures). `episodes` (stages.episode_segments.Episodes): the responses
    are episodes, advanced by it."""
    r = cfg.rollout
    per_step, rows = cfg.learn.minibatch_size // r.group_size, r.chunk_prompts * r.group_size
    rounds = sampled = 0
    t0 = time.perf_counter()
    while True:
        live = [x for x in responses if x.finish is None]
        spec = samples.sampling_spec(r, round_seed(cfg.seed, iteration, rounds, Salt.SAMPLING))
        if episodes is None:
            sampled += advance(gen, live, spec, r.segment_tokens, rows, stamp, report.part)
        else:
            sampled += episodes.advance(live, spec, r.segment_tokens, rows, stamp)
        rounds += 1
        held = hold(responses, r.prompts_per_iteration, per_step)
        if held.release or all(x.finish is not None for x in responses):
            break
    report.end()
    return held, {"rounds": rounds, "sampled_tokens": sampled, "generate_s": time.perf_counter() - t0}


def row_groups(groups: list[list[Response]], chunk: int) -> list[list[list[Response]]]:
    """The released groups in row groups of `chunk` groups (rollout.chunk_prompts)."""
    return [groups[i : i + chunk] for i in range(0, len(groups), chunk)] or [[]]


ATTRIBUTE = {"sampler_logprobs": "logprobs", "token_versions": "versions", "finish_reason": "finish"}
"""A table's column named otherwise than the Response attribute it holds."""


def response_columns(run_id: str, iteration: int, rows: list[Response], names: tuple[str, ...]) -> dict[str, list]:
    """Columns `names` of a table with a row per response (run_id and iteration first): each the Response attribute
    of its name (ATTRIBUTE: or the one named there)."""
    n = len(rows)
    out: dict[str, list] = {"run_id": [run_id] * n, "iteration": [iteration] * n}
    return out | {name: [getattr(x, ATTRIBUTE.get(name, name)) for x in rows] for name in names}


ROLLOUTS = ("prompt_id", "sample_index", "prompt", "prompt_ids", "response_ids", "sampler_logprobs", "loss_mask",
            "token_versions", "finish_reason", "ground_truth", "row", "policy_hash")  # fmt: skip
CARRIED = ROLLOUTS[:2] + ("started",) + ROLLOUTS[2:4] + ("budget",) + ROLLOUTS[4:]


def rollouts_columns(run_id: str, iteration: int, groups: list[list[Response]], p: Prompts) -> dict[str, list]:
    """The rollouts table's columns of released groups: each row as the learner reads it, its token_versions listed
    and its policy the one that sampled its newest token."""
    rows = [x for grp in groups for x in grp]
    out = response_columns(run_id, iteration, rows, ROLLOUTS)
    out["response"] = decode_responses(p.tokenizer, out["response_ids"], p.eos_ids)
    out["policy_version"] = [max(x.versions, default=-1) for x in rows]
    return out


def carried_columns(run_id: str, iteration: int, rows: list[Response]) -> dict[str, list]:
    """The carried table's columns: every response handed on, whole (an episode's turns and conversation as JSON)."""
    out = response_columns(run_id, iteration, rows, CARRIED)
    return out | {"episode": [None if x.ep is None else carry.dumps(x.ep) for x in rows]}


def state(x: Response, out: set[int]) -> str:
    """released, carried (unfinished) or finished (ended, its group waits)."""
    return "released" if id(x) in out else "carried" if x.finish is None else "finished"


def segment_columns(run_id: str, iteration: int, held: Held, version: int) -> dict[str, list]:
    """The segments table's columns: a row per response the iteration held."""
    rows, out = held.responses, {id(x) for grp in held.release for x in grp}
    return response_columns(run_id, iteration, rows, ("prompt_id", "sample_index", "started")) | {
        "tokens_before": [x.before for x in rows],
        "tokens": [len(x.response_ids) for x in rows],
        "sampled": [sum(x.loss_mask[x.before :]) for x in rows],
        "state": [state(x, out) for x in rows],
        "finish_reason": [x.finish for x in rows],
        "policy_version": [version] * len(rows),
    }


def ages(counts: Counter) -> dict[str, int]:
    """{age: count}, ages ascending (JSON keys: strings)."""
    return {str(a): counts[a] for a in sorted(counts)}


def summary(held: Held, iteration: int, figures: dict) -> dict:
    """The rollouts summary's segment figures: responses carried on (unfinished), finished here, waiting (ended, their
    group not complete or not taken), groups released, and ages (iterations since their group started)."""
    out = {id(x) for grp in held.release for x in grp}
    carried = [x for x in held.responses if x.finish is None]
    waiting = [x for x in held.responses if x.finish is not None and id(x) not in out]
    ended_here = [x for x in held.responses if x.finish is not None and len(x.response_ids) > x.before]
    return {
        "segment_rounds": figures["rounds"],
        "sampled_tokens": figures["sampled_tokens"],
        "responses_held": len(held.responses),
        "responses_carried": len(carried),
        "responses_finished": len(ended_here),
        "responses_waiting": len(waiting),
        "groups_released": len(held.release),
        "carried_ages": ages(Counter(iteration - x.started for x in carried)),
        "released_ages": ages(Counter(iteration - grp[0].started for grp in held.release)),
        "released_age_mean": sum(iteration - grp[0].started for grp in held.release) / max(len(held.release), 1),
        "oldest_age": max((iteration - x.started for x in held.responses), default=0),
    }


def write(storage: Storage, writer, run_id: str, iteration: int, held: Held, p: Prompts, cfg: RunConfig,
          version: int) -> int:  # fmt: skip
    """Write the rollouts (released groups), carried and segments tables; returns the rollouts' rows."""
    with ParquetWriter(storage.fs, writer.path(table_file("rollouts")), "rollouts") as out:
        for groups in row_groups(held.release, cfg.rollout.chunk_prompts):
            out.write(rollouts_columns(run_id, iteration, groups, p))
    with ParquetWriter(storage.fs, writer.path(table_file("carried")), "carried") as out:
        out.write(carried_columns(run_id, iteration, held.carry))
    with ParquetWriter(storage.fs, writer.path(table_file("segments")), "segments") as out:
        out.write(segment_columns(run_id, iteration, held, version))
    return sum(map(len, held.release))
