"""Stage 2: sample G responses per prompt from the snapshot policy into Parquet.

The iteration's prompts (stages.prompts: the task's or the dataset's, rendered and tokenized) go
to the sampler; the rollouts table keeps the rendered text, what the model saw. Generation goes
chunk by chunk and each chunk is one Parquet row group, so memory stays bounded however many
samples an iteration has. With rollout.min_signal_groups the stage samples in rounds until enough
groups have signal (dynamic sampling: `sample_rounds` says how and why). Each row records the policy that
sampled it (policy_stamp); a snapshot of another than rollout.staleness names is refused (lineage.check_policy).
Every sample is an episode (grpo/episodes, stages/samples.py); with rollout.tools or rollout.environment it has an
environment, which lives in a worker process forked before the sampler starts, and its turns and its end are written
beside it.
"""

from __future__ import annotations

import dataclasses
import time

from grpo.config import RunConfig
from grpo.devices import current, sampler_device
from grpo.episodes import adapters
from grpo.episodes.loop import Loop
from grpo.progress import Progress
from grpo.record import reward_files
from grpo.record.checkpoint import content_hash, non_finite_weights
from grpo.record.commit import StageWriter
from grpo.record.identity import section
from grpo.record.layout import Salt, iteration_seed, round_seed
from grpo.record.lineage import check_chain, check_policy, committed_input, frozen_version
from grpo.record.storage import Committed, Storage
from grpo.runtime.pool import WARM_POOLS
from grpo.scoring.score import scorer_key
from grpo.tasks import functions
from schemas import ParquetWriter, table_file
from stages import rewards, segments
from stages.common import StageError, load_run, measured
from stages.dynamic_sampling import draw_start, dynamic_inputs, flat_epoch, group_signal
from stages.prompts import (
    Environments,
    Prompts,
    environments,
    episode_starts,
    held_out_config,
    iteration_prompts,
    policy_and_prompts,
    rollout_function,
    round_prompts,
    sampler,
)
from stages.samples import Rows, episode_loop, sample_chunk, sampling_spec
from stages.shards import ranges, run_sharded


def policy_stamp(storage: Storage, snap: Committed) -> dict:
    """What every row (and the summary) records of the policy that sampled it: policy_version, the learn iteration
    that committed it (-1: the base, grpo.record.lineage.policy_version), and policy_hash, its checkpoint's content
    hash."""
    return {"policy_version": frozen_version(storage, snap), "policy_hash": content_hash(snap)[:16]}


@measured
def rollouts(storage: Storage, run_id: str, iteration: int, force: bool = False, shard: int | None = None) -> Committed:
    """Sample the iteration's prompts; with rollout.shards > 1, shard `shard` alone or every shard then
    their rows merged (stages.shards). A shard is whole chunks and every chunk draws its seeds as it would
    in one process (the sampler seeds a chunk's generate call from the stage's seed alone), so 1 and N
    shards sample the same rows."""
    cfg = load_run(storage, run_id)
    snap = committed_input(storage, run_id, iteration, "snapshot")
    stamp = policy_stamp(storage, snap)
    check_policy(run_id, iteration, "rollouts", stamp["policy_version"], cfg.rollout.staleness)
    inputs = {"snapshot": snap}
    if cfg.rollout.min_signal_groups is not None:
        inputs.update(dynamic_inputs(storage, cfg, run_id, iteration))
    if adapters.names_files(cfg.rollout) or functions.is_file_spec(cfg.rollout.rollout_func or ""):  # their copies
        inputs["base"] = committed_input(storage, run_id, None, "base")
    if cfg.rollout.segment_tokens is not None and iteration > 0:  # the responses iteration k - 1 carried on
        inputs["carried"] = committed_input(storage, run_id, iteration - 1, "rollouts")
    check_chain(storage, run_id, iteration, "rollouts", inputs)
    r = cfg.rollout

    def sample(writer, shard_k: int = 0) -> dict:
        if r.min_signal_groups is not None:  # one shard (config.validate_dynamic_sampling)
            return sample_rounds(storage, cfg, run_id, iteration, inputs, writer)
        with environments(cfg, inputs.get("base")) as env:  # episodes: workers forked before the sampler starts
            if r.segment_tokens is not None:  # one shard (config: check_segments)
                return sample_segmented(writer, env)
            return sample_part(writer, shard_k, env)

    def sample_segmented(writer, env) -> dict:
        """rollout.segment_tokens: the carried responses and this iteration's, at most B new tokens each (segments)."""
        p = checked_prompts(snap, iteration_prompts(cfg, iteration), cfg, env.tools)
        t0 = time.perf_counter()
        gen, settings = sampler(p, cfg)
        engine_s = time.perf_counter() - t0
        loop = episode_loop(gen, p, env, cfg, stamp)
        responses, here, replay = segments.opened(loop, p, segments.carried_in(storage, inputs.get("carried")), cfg,
                                                  iteration)  # fmt: skip
        report = Progress(f"rollouts {iteration}", sum(x.finish is None for x in responses), "responses")
        held, figures = segments.sample_segments(loop, responses, cfg, iteration, report)
        loop.close(here)  # the final states of those that ended here: stored with them, carried or released
        rows = segments.write(storage, writer, run_id, iteration, held, p, cfg, stamp["policy_version"], here, env)
        return {
            **summary(len(p.ids), p.skipped, rows, loop, stamp, engine_s, figures["generate_s"], settings),
            **segments.summary(held, iteration, figures),
            **(replay if rows.environment else {}),  # what carrying an environment costs
            "segment_tokens": r.segment_tokens,
        }

    def sample_part(writer, shard_k: int, env) -> dict:
        p = checked_prompts(snap, iteration_prompts(cfg, iteration), cfg, env.tools)
        chunks = -(-len(p.ids) // r.chunk_prompts)
        if r.shards > chunks:  # fewer prompts than asked for were left (skipped ones)
            raise StageError(
                f"rollouts iteration {iteration}: rollout.shards={r.shards} is more than the {chunks} chunk(s) "
                f"of rollout.chunk_prompts={r.chunk_prompts} left of {len(p.ids)} prompts; lower either"
            )
        part = ranges(len(p.ids), r.shards, unit=r.chunk_prompts)[shard_k]
        t0 = time.perf_counter()
        gen, settings = sampler(p, cfg)  # starts the engine, or wakes a warm one and reloads its weights
        engine_s = time.perf_counter() - t0
        spec = sampling_spec(r, iteration_seed(cfg.seed, iteration, Salt.SAMPLING))
        seed = iteration_seed(cfg.seed, iteration, Salt.ENVIRONMENT)
        loop, generate_s = episode_loop(gen, p, env, cfg, stamp), 0.0
        fn = rollout_function(cfg, inputs.get("base"), p)  # rollout.rollout_func: TRL's, in place of the sampler call
        report = Progress(f"rollouts {iteration}" + (f" shard {shard_k}" if r.shards > 1 else ""), len(part), "prompts")
        with Rows(storage, writer, env) as rows:
            for start in range(part.start, part.stop, r.chunk_prompts):
                chunk, at = slice(start, start + r.chunk_prompts), start - part.start
                t0 = time.perf_counter()
                done = lambda k, at=at: report.part(at + k)  # noqa: E731
                groups = sample_chunk(loop, fn, episode_starts(p, chunk, cfg, iteration), spec, seed, p, done)
                generate_s += time.perf_counter() - t0
                rows.write(run_id, iteration, groups, p, stamp)
                report(min(start + r.chunk_prompts, part.stop) - part.start)
        return summary(len(part), p.skipped, rows, loop, stamp, engine_s, generate_s, settings)

    with current(sampler_device(r)):  # this thread's CUDA device the sampler's (a learner may hold another)
        return run_sharded(
            storage,
            run_id,
            iteration,
            "rollouts",
            shards=r.shards,
            setting="rollout.shards",
            config=stage_config(cfg),
            inputs=inputs,
            shard_body=lambda k, writer: sample(writer, k),
            merge_summary=merged_summary,
            force=force,
            shard=shard,
        )


def stage_config(cfg: RunConfig) -> dict:
    """What the stage's identity covers: the seed, the task and the rollout section, less rollout.shards (1 and N
    shards sample the same rows) and settings added later at their defaults (grpo.record.identity)."""
    config = {"seed": cfg.seed, "task": section(cfg, "task"), "rollout": section(cfg, "rollout")}
    if cfg.task.dataset:  # the held-out rows are never drawn
        config["held_out"] = held_out_config(cfg)
    if cfg.rollout.min_signal_groups is not None:  # dynamic sampling scores as the rewards stage does
        config["reward"] = rewards.stage_config(cfg)["reward"]
    return config


def checked_prompts(snap: Committed, examples: list, cfg: RunConfig, tools: list[dict] | None = None) -> Prompts:
    """policy_and_prompts (`tools`: an episode's, rendered in), refused when the policy has non-finite weights."""
    p = policy_and_prompts(snap, examples, cfg, tools=tools)
    bad = non_finite_weights(p.model_dir) + (non_finite_weights(p.adapter_dir) if p.adapter_dir else [])
    if bad:  # sampling would die in torch ("probability tensor contains inf/nan") or sample garbage
        raise StageError(
            f"{snap.uri}: the policy has non-finite weights ({', '.join(bad[:3])}); "
            f"nothing sampled. Rerun the learn that made it with a lower learn.lr"
        )
    return p


def summary(prompts: int, skipped: int, rows: Rows, loop: Loop, stamp: dict, engine_s: float, generate_s: float,
            sampler: dict) -> dict:  # fmt: skip
    """The rollouts summary: the prompts sampled and skipped, what the rows written by `loop` count (Rows), the
    policy that sampled them, the seconds the engine took to start and the sampling took, the sampler's settings."""
    return {
        "prompts": prompts,
        "skipped_prompts": skipped,
        **rows.summary(loop),
        **stamp,
        "engine_s": engine_s,
        "generate_s": generate_s,
        "sampler": sampler,
    }


def merged_summary(parts: list[dict]) -> dict:
    """The rollouts summary of its shards'."""
    samples = sum(s["samples"] for s in parts)
    total = {k: sum(s[k] for s in parts) for k in ("prompts", "samples", "response_tokens", "engine_s", "generate_s")}
    stops = sum(s["stop_fraction"] * s["samples"] for s in parts)
    first = parts[0]
    episodes = {}
    if "tool_calls" in first:  # rollout.tools, rollout.environment
        episodes = {k: sum(s[k] for s in parts) for k in ("tool_calls", "tool_errors", "tool_s")}
        episodes["tool_s_max"] = max(s["tool_s_max"] for s in parts)
        episodes |= {k: sum(s.get(k, 0) for s in parts) for k in ("observations_cut", "episodes_rerun")}
        episodes["turns_per_episode"] = sum(s["turns_per_episode"] * s["samples"] for s in parts) / max(samples, 1)
    return {
        **total,
        **episodes,
        "skipped_prompts": first["skipped_prompts"],  # of the iteration's prompts: every shard counts them all
        "stop_fraction": stops / max(samples, 1),
        "policy_version": first["policy_version"],
        "policy_hash": first["policy_hash"],  # every shard samples the one snapshot
        "sampler": first["sampler"],
    }


def sample_rounds(
    storage: Storage, cfg: RunConfig, run_id: str, iteration: int, inputs: dict[str, Committed], writer: StageWriter
) -> dict:
    """Dynamic sampling (DAPO: Yu et al. 2025; verl's algorithm.filter_groups), rollout.min_signal_groups.

    Round 0 samples the iteration's prompts as the stage always does (same prompts, same seed). While fewer
    than min_signal_groups of the groups sampled so far have unequal rewards, and fewer than
    max_sampling_rounds rounds ran, round r samples the next prompts_per_iteration prompts of the epoch order
    (stages.prompts.round_prompts) with its own seed (layout.round_seed), prompt_ids continuing r * n + i.
    Rounds are whole, so what is drawn depends on the committed inputs alone: a rerun or a resumed run draws
    the same prompts. The draws table records each prompt's round and signal; the summary the rounds.

    Where scoring happens. The decision to draw more needs rewards, so this stage scores each chunk with the
    rewards stage's code (grpo.scoring.score.score_samples, in its warm worker pool) and keeps only the per-group signal
    (the draws table), not the rewards. The rewards stage scores the committed rollouts again as always: it
    stays the one stage whose side effect is rewards (its error column, max_error_fraction, shards, a forced
    rescoring all unchanged), and the advantages stage decides what the learner trains on from those
    committed rewards, so a nondeterministic reward function can never make it train on a group the
    committed rewards show as equal. The cost is scoring twice; a slow reward function pays it.

    Where the next iteration draws. With a dataset the extra prompts are borrowed from the epoch order, so
    the next iteration starts where this one's draws ended: its draw_start is this stage's committed
    draw_end (the next rollouts takes this one as its `previous` input), never in-memory state. The task
    generators' prompts are seeded by the iteration alone; round r takes the next n of that stream.

    When to give up. Rounds that drew a whole epoch of a dataset without one group with signal stop the stage
    in one line (flat_epoch): the reward looks constant there, and more rounds, or the learner, cannot help.
    """
    r, n = cfg.rollout, cfg.rollout.prompts_per_iteration
    snap, start = inputs["snapshot"], draw_start(cfg, iteration, inputs)
    stamp = policy_stamp(storage, snap)
    key = scorer_key(cfg, reward_files.holder_of(inputs))
    loop = settings = None
    rounds = signal = kept = skipped = 0
    engine_s = score_s = generate_s = 0.0
    with (
        WARM_POOLS.pool(cfg.reward.workers, cfg.reward.pass_env) as pool,  # forked before the sampler starts
        Rows(storage, writer, Environments()) as rows,  # single-turn (config.validate_dynamic_sampling)
        ParquetWriter(storage.fs, writer.path(table_file("draws")), "draws") as draws,
    ):
        while rounds < r.max_sampling_rounds and (rounds == 0 or signal < r.min_signal_groups):
            p = checked_prompts(snap, round_prompts(cfg, iteration, rounds, start), cfg)
            p = dataclasses.replace(p, index=[rounds * n + i for i in p.index])  # prompt_id: place in the draw order
            if loop is None:
                t0 = time.perf_counter()
                gen, settings = sampler(p, cfg)
                engine_s = time.perf_counter() - t0
                loop = episode_loop(gen, p, Environments(), cfg, stamp)
            spec = sampling_spec(r, round_seed(cfg.seed, iteration, rounds, Salt.SAMPLING))
            fn = rollout_function(cfg, inputs.get("base"), p)
            report = Progress(f"rollouts {iteration} round {rounds}", len(p.ids), "prompts")
            for at in range(0, len(p.ids), r.chunk_prompts):
                chunk = slice(at, at + r.chunk_prompts)
                part = lambda k, at=at: report.part(at + k)  # noqa: E731
                t0 = time.perf_counter()
                groups = sample_chunk(loop, fn, episode_starts(p, chunk, cfg, iteration), spec, 0, p, part)
                generate_s += time.perf_counter() - t0
                columns = rows.write(run_id, iteration, groups, p, stamp)
                t0 = time.perf_counter()
                has = group_signal(cfg, pool, key, columns, [len(g) for g in groups])
                score_s += time.perf_counter() - t0
                ids = p.index[chunk]
                draws.write(
                    {"run_id": [run_id] * len(ids), "iteration": [iteration] * len(ids), "prompt_id": ids}
                    | {"round": [rounds] * len(ids), "signal": has}
                )
                signal += sum(has)
                report(min(at + r.chunk_prompts, len(p.ids)))
            kept, skipped, rounds = kept + len(p.ids), skipped + p.skipped, rounds + 1
            if signal == 0 and (flat := flat_epoch(cfg, iteration, rounds)):
                raise StageError(flat)
    return {
        **summary(kept, skipped, rows, loop, stamp, engine_s, generate_s, settings),
        "rounds": rounds,
        "prompts_drawn": rounds * n,
        "signal_groups": signal,
        "draw_start": start,
        "draw_end": start + rounds * n,
        "score_s": score_s,
    }
