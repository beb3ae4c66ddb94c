"""Stage 2: sample G responses per prompt from the snapshot policy into Parquet.

The iteration's prompts (stages.prompts: the task's or the dataset's, rendered and tokenized) go
to the sampler; the rollouts table keeps the rendered text, what the model saw. Generation goes
chunk by chunk and each chunk is one Parquet row group, so memory stays bounded however many
samples an iteration has.
"""

from __future__ import annotations

import time

from grpo import data
from grpo.checkpoint import content_hash, non_finite_weights
from grpo.generation import Sample, SamplingSpec, decode_responses
from grpo.layout import Salt, iteration_seed
from grpo.progress import progress
from grpo.storage import Committed, Storage
from schemas import ParquetWriter, table_file
from stages.common import StageError, check_chain, committed_input, load_run
from stages.prompts import Prompts, held_out_config, iteration_prompts, policy_and_prompts, sampler
from stages.shards import ranges, run_sharded


def chunk_columns(
    run_id: str, iteration: int, p: Prompts, chunk: slice, groups: list[list[Sample]], version: str
) -> dict[str, list]:
    """The rollouts table's columns for one chunk: a row per sample, each prompt's group together."""
    samples = [s for group in groups for s in group]
    n = len(samples)

    def per_sample(values) -> list:  # one value per prompt -> one per sample
        return [v for v, group in zip(values, groups) for _ in group]

    return {
        "run_id": [run_id] * n,
        "iteration": [iteration] * n,
        "prompt_id": per_sample(p.index[chunk]),
        "sample_index": [j for group in groups for j in range(len(group))],
        "prompt": per_sample(p.texts[chunk]),
        "prompt_ids": per_sample(p.ids[chunk]),
        "response_ids": [s.response_ids for s in samples],
        "response": decode_responses(p.tokenizer, [s.response_ids for s in samples], p.eos_ids),
        "sampler_logprobs": [s.logprobs for s in samples],
        "finish_reason": [s.finish_reason for s in samples],
        "ground_truth": per_sample([e.ground_truth for e in p.examples[chunk]]),
        "row": per_sample([data.row_json(e) for e in p.examples[chunk]]),
        "policy_version": [version] * n,
    }


def rollouts(storage: Storage, run_id: str, iteration: int, force: bool = False, shard: int | None = None) -> Committed:
    """Sample the iteration's prompts; with rollout.shards > 1, shard `shard` alone or every shard then
    their rows merged (stages.shards). A shard is whole chunks and every chunk draws its seeds as it would
    in one process (the sampler seeds a chunk's generate call from the stage's seed alone), so 1 and N
    shards sample the same rows."""
    cfg = load_run(storage, run_id)
    snap = committed_input(storage, run_id, iteration, "snapshot")
    check_chain(storage, run_id, iteration, "rollouts", {"snapshot": snap})
    r = cfg.rollout

    def sample(writer, shard_k: int = 0) -> dict:
        p = policy_and_prompts(snap, iteration_prompts(cfg, iteration), cfg)
        bad = non_finite_weights(p.model_dir) + (non_finite_weights(p.adapter_dir) if p.adapter_dir else [])
        if bad:  # sampling would die in torch ("probability tensor contains inf/nan") or sample garbage
            raise StageError(
                f"{snap.uri}: the policy has non-finite weights ({', '.join(bad[:3])}); "
                f"nothing sampled. Rerun the learn that made it with a lower learn.lr"
            )
        chunks = -(-len(p.ids) // r.chunk_prompts)
        if r.shards > chunks:  # fewer prompts than asked for were left (skipped ones)
            raise StageError(
                f"rollouts iteration {iteration}: rollout.shards={r.shards} is more than the {chunks} chunk(s) "
                f"of rollout.chunk_prompts={r.chunk_prompts} left of {len(p.ids)} prompts; lower either"
            )
        part = ranges(len(p.ids), r.shards, unit=r.chunk_prompts)[shard_k]
        t0 = time.perf_counter()
        gen, settings = sampler(p, cfg)  # starts the engine, or wakes a warm one and reloads its weights
        engine_s, generate_s = time.perf_counter() - t0, 0.0
        spec = SamplingSpec(
            n=r.group_size,
            temperature=r.temperature,
            top_p=r.top_p,
            max_tokens=r.max_tokens,
            stop=tuple(r.stop),
            seed=iteration_seed(cfg.seed, iteration, Salt.SAMPLING),
        )
        version = content_hash(snap)[:16]
        n_tokens = n_stop = 0
        with ParquetWriter(storage.fs, writer.path(table_file("rollouts")), "rollouts") as out:
            for start in range(part.start, part.stop, r.chunk_prompts):
                chunk = slice(start, start + r.chunk_prompts)
                t0 = time.perf_counter()
                groups = gen.generate(p.ids[chunk], spec, p.budgets[chunk])
                generate_s += time.perf_counter() - t0
                columns = chunk_columns(run_id, iteration, p, chunk, groups, version)
                out.write(columns)
                n_tokens += sum(map(len, columns["response_ids"]))
                n_stop += columns["finish_reason"].count("stop")
                progress(
                    f"rollouts {iteration}" + (f" shard {shard_k}" if r.shards > 1 else ""),
                    min(start + r.chunk_prompts, part.stop) - part.start,
                    len(part),
                    "prompts",
                )
        return {
            "prompts": len(part),
            "skipped_prompts": p.skipped,
            "samples": out.num_rows,
            "response_tokens": n_tokens,
            "stop_fraction": n_stop / max(out.num_rows, 1),
            "policy_version": version,
            "engine_s": engine_s,
            "generate_s": generate_s,
            "sampler": settings,
        }

    rollout = {k: v for k, v in cfg.to_dict()["rollout"].items() if k != "shards"}  # same rows for any
    config = {"seed": cfg.seed, "task": cfg.to_dict()["task"], "rollout": rollout}
    if cfg.task.dataset:  # the held-out rows are never drawn
        config["held_out"] = held_out_config(cfg)
    inputs = {"snapshot": snap}
    return run_sharded(
        storage,
        run_id,
        iteration,
        "rollouts",
        shards=r.shards,
        setting="rollout.shards",
        config=config,
        inputs=inputs,
        shard_body=lambda k, writer: sample(writer, k),
        merge_summary=merged_summary,
        force=force,
        shard=shard,
    )


def merged_summary(parts: list[dict]) -> dict:
    """The rollouts summary of its shards'."""
    samples = sum(s["samples"] for s in parts)
    total = {k: sum(s[k] for s in parts) for k in ("prompts", "samples", "response_tokens", "engine_s", "generate_s")}
    stops = sum(s["stop_fraction"] * s["samples"] for s in parts)
    first = parts[0]
    return {
        **total,
        "skipped_prompts": first["skipped_prompts"],  # of the iteration's prompts: every shard counts them all
        "stop_fraction": stops / max(samples, 1),
        "policy_version": first["policy_version"],
        "sampler": first["sampler"],
    }
