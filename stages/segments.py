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

Every response is an episode (grpo/episodes), continued by the one Loop.advance; with rollout.tools or
rollout.environment it has an environment, and the rounds go turn by turn:
    open: the G episodes of each new prompt reset, as without segments (the stage's environment seed); the environment
        of each episode carried in re-created by replay: reset with its seed, each answered turn asked again with its
        seed, every answer checked against the one recorded (Loop.reopen)
    a round: every unfinished episode goes on until it ends or has sampled B tokens in the round: a turn cut at B stays
        open and the next round or iteration continues it from exactly its ids; a turn that ends is answered and its
        observation appended, as without segments (appended tokens are sampled by no policy: they count to max_tokens,
        not to B, and carry the version of the iteration that appended them)
    close: the final state of each episode that ended here, every other environment closed (Loop.close)
    write: the turns and episodes tables of the released episodes, as without segments (a turn's policy_version: the
        one that sampled its last token); what is carried on keeps the rest in its `episode` (grpo.episodes.carry)
An environment's numbers come from the seed of the stage that reset it, the episode and the turn, so a rerun, a
resumed run and a fork commit the same bytes; an environment that answers otherwise on replay fails the stage in one
line.

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
from dataclasses import dataclass

from grpo.config import RunConfig
from grpo.episodes import carry
from grpo.episodes.loop import Loop
from grpo.episodes.records import Episode, end_of
from grpo.progress import Progress
from grpo.record.layout import Salt, iteration_seed, round_seed
from grpo.record.storage import Committed, Storage
from schemas import ParquetWriter, read_parquet, table_file
from stages.prompts import Environments, Prompts, episode_starts
from stages.samples import Rows, sampling_spec


def carried_in(storage: Storage, previous: Committed | None) -> list[Episode]:
    """The responses the previous iteration's rollouts carried on (none in iteration 0), in prompt_id order; an
    episode's turns and conversation from its `episode` (grpo.episodes.carry)."""
    if previous is None:
        return []
    table = read_parquet(storage.fs, previous.read_path(table_file("carried")), "carried").to_pylist()
    out = []
    for r in table:
        ids = list(r["response_ids"])
        e = Episode(
            r["prompt_id"], r["sample_index"], None, r["prompt"], list(r["prompt_ids"]), budget=r["budget"],
            response_ids=ids, loss_mask=list(r["loss_mask"]), logprobs=list(r["sampler_logprobs"]),
            end=None if r["finish_reason"] is None else end_of(r["finish_reason"]), ground_truth=r["ground_truth"],
            row_json=r["row"], started=r["started"], versions=list(r["token_versions"]), policy_hash=r["policy_hash"],
            before=len(ids),
        )  # fmt: skip
        out.append(e if r["episode"] is None else carry.loads(r["episode"], e))
    return out


def opened(loop: Loop, p: Prompts, carried: list[Episode], cfg: RunConfig, iteration: int) -> tuple[list, list, dict]:
    """(the iteration's responses: those carried in, then G new ones of each of its prompts `p`, prompt_id
    iteration x n + its place; those whose environments this stage holds; the replay's figures). The environments of
    the unfinished carried ones are re-created (Loop.reopen), the new ones reset with the stage's environment seed."""
    going = [x for x in carried if x.end is None]
    t0 = time.perf_counter()
    loop.reopen(going)
    replay = {"episodes_replayed": len(going), "replay_s": time.perf_counter() - t0}
    n, g = cfg.rollout.prompts_per_iteration, cfg.rollout.group_size
    placed = dataclasses.replace(p, index=[iteration * n + i for i in p.index])  # their prompt_ids
    seed = iteration_seed(cfg.seed, iteration, Salt.ENVIRONMENT)
    new = [e for group in loop.open(episode_starts(placed, slice(None), cfg, iteration), g, seed) for e in group]
    for e in new:
        carry.check_row(e)  # before anything is sampled
    return carried + new, going + new, replay


def groups_of(responses: list[Episode]) -> list[list[Episode]]:
    """The responses by group, in prompt_id order (each group's in sample order)."""
    by: dict[int, list[Episode]] = {}
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

    release: list[list[Episode]]
    carry: list[Episode]
    responses: list[Episode]


def hold(responses: list[Episode], n: int, per_step: int) -> Held:
    """Split the iteration's responses into the groups released (the oldest complete ones: `released`) and the rest."""
    groups = groups_of(responses)
    complete = [grp for grp in groups if all(x.finish is not None for x in grp)]
    release = complete[: released(len(complete), n, per_step)]
    out = {id(x) for grp in release for x in grp}
    return Held(release, [x for grp in groups for x in grp if id(x) not in out], [x for grp in groups for x in grp])


def sample_segments(loop: Loop, responses: list[Episode], cfg: RunConfig, iteration: int,
                    report: Progress) -> tuple[Held, dict]:  # fmt: skip
    """Round after round until at least a minibatch of groups is complete (or nothing is left unfinished): (what the
    iteration holds, the summary's sampling figures)."""
    r = cfg.rollout
    per_step, rows = cfg.learn.minibatch_size // r.group_size, r.chunk_prompts * r.group_size
    rounds = sampled = 0
    t0 = time.perf_counter()
    while True:
        live = [x for x in responses if x.finish is None]
        spec = sampling_spec(r, round_seed(cfg.seed, iteration, rounds, Salt.SAMPLING))
        sampled += loop.advance(live, spec, r.segment_tokens, rows, report.part)
        rounds += 1
        held = hold(responses, r.prompts_per_iteration, per_step)
        if held.release or all(x.finish is not None for x in responses):
            break
    report.end()
    return held, {"rounds": rounds, "sampled_tokens": sampled, "generate_s": time.perf_counter() - t0}


def row_groups(groups: list[list[Episode]], chunk: int) -> list[list[list[Episode]]]:
    """The released groups in row groups of `chunk` groups (rollout.chunk_prompts)."""
    return [groups[i : i + chunk] for i in range(0, len(groups), chunk)] or [[]]


ATTRIBUTE = {"prompt": "prompt_text", "sampler_logprobs": "logprobs", "token_versions": "versions",
             "finish_reason": "finish", "row": "row_json"}  # fmt: skip
"""A table's column named otherwise than the Episode attribute it holds."""


def response_columns(run_id: str, iteration: int, rows: list[Episode], names: tuple[str, ...]) -> dict[str, list]:
    """Columns `names` of a table with a row per response (run_id and iteration first): each the Episode attribute
    of its name (ATTRIBUTE: or the one named there)."""
    n = len(rows)
    out: dict[str, list] = {"run_id": [run_id] * n, "iteration": [iteration] * n}
    return out | {name: [getattr(x, ATTRIBUTE.get(name, name)) for x in rows] for name in names}


CARRIED = ("prompt_id", "sample_index", "started", "prompt", "prompt_ids", "budget", "response_ids", "sampler_logprobs",
           "loss_mask", "token_versions", "finish_reason", "ground_truth", "row", "policy_hash")  # fmt: skip


def carried_columns(run_id: str, iteration: int, rows: list[Episode]) -> dict[str, list]:
    """The carried table's columns: every response handed on, whole (an episode's turns and conversation as JSON;
    null without an environment)."""
    out = response_columns(run_id, iteration, rows, CARRIED)
    return out | {"episode": [carry.dumps(x) if x.has_environment else None for x in rows]}


def state(x: Episode, out: set[int]) -> str:
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


def write(storage: Storage, writer, run_id: str, iteration: int, held: Held, p: Prompts, cfg: RunConfig, version: int,
          here: list[Episode], env: Environments) -> Rows:  # fmt: skip
    """Write the rollouts (released groups; with an environment their turns and episodes too), carried and segments
    tables; returns their Rows, counting the released ones (the environments' seconds: those of `here`, the episodes
    this stage held)."""
    with Rows(storage, writer, env) as rows:
        for groups in row_groups(held.release, cfg.rollout.chunk_prompts):
            rows.rollouts(run_id, iteration, groups, p)
        rows.episodes(run_id, iteration, [x for grp in held.release for x in grp], answered=here)
    with ParquetWriter(storage.fs, writer.path(table_file("carried")), "carried") as out:
        out.write(carried_columns(run_id, iteration, held.carry))
    with ParquetWriter(storage.fs, writer.path(table_file("segments")), "segments") as out:
        out.write(segment_columns(run_id, iteration, held, version))
    return rows
