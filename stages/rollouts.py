"""Stage 2: sample G responses per prompt from the snapshot policy into Parquet.

Prompts come from the task generator (seeded by the run seed and the iteration)
or from a user dataset of rows `prompt`, `ground_truth` (Parquet or JSONL).
Generation goes chunk by chunk and each chunk is one Parquet row group, so memory
stays bounded however many samples an iteration has.
"""
from __future__ import annotations

import random
import time

import fsspec
import pandas as pd

from grpo.checkpoint import content_hash, local_checkpoint, tokenizer_and_config
from grpo.config import RunConfig
from grpo.generation import Sample, SamplingSpec, decode_responses, get_generator
from grpo.storage import Committed, Storage
from grpo.tasks import Example, get_task
from schemas import ParquetWriter
from stages.common import StageError, committed_input, load_run, log, run_stage


def iteration_seed(run_seed: int, iteration: int, salt: int = 0) -> int:
    """Distinct, reproducible seed per (run seed, iteration, purpose)."""
    return (run_seed * 1_000_003 + iteration * 7919 + salt) % (2**31 - 1)


def load_dataset(uri: str) -> list[Example]:
    """Rows `prompt`, `ground_truth` from a Parquet or JSONL file (any fsspec URL)."""
    with fsspec.open(uri, "rb") as f:
        df = pd.read_json(f, lines=True) if uri.endswith((".jsonl", ".json")) else pd.read_parquet(f)
    missing = {"prompt", "ground_truth"} - set(df.columns)
    if missing:
        raise StageError(f"dataset {uri}: missing column(s) {sorted(missing)}; needs prompt, ground_truth")
    if df.empty:
        raise StageError(f"dataset {uri}: no rows")
    return [Example(str(p), str(g)) for p, g in zip(df["prompt"], df["ground_truth"])]


def iteration_prompts(cfg: RunConfig, iteration: int) -> list[Example]:
    n, seed = cfg.rollout.prompts_per_iteration, iteration_seed(cfg.seed, iteration, salt=1)
    if cfg.task.dataset:
        rows = load_dataset(cfg.task.dataset)
        return random.Random(seed).choices(rows, k=n) if n > len(rows) else random.Random(seed).sample(rows, n)
    return get_task(cfg.task.name, **cfg.task.params).generate(n, seed)


def policy_and_prompts(policy: Committed, examples: list[Example], max_tokens: int):
    """Local checkpoint folder, tokenizer, prompt token ids and the response budget they leave.

    Prompts with words outside the vocabulary, or too long for the model, fail naming the prompt.
    """
    model_dir = local_checkpoint(policy)
    tokenizer, config = tokenizer_and_config(policy)
    max_len = config.max_position_embeddings
    ids = tokenizer([e.prompt for e in examples])["input_ids"]
    for e, p in zip(examples, ids):
        if tokenizer.unk_token_id in p:
            raise StageError(f"prompt {e.prompt!r} has words outside the model's vocabulary")
        if len(p) >= max_len:
            raise StageError(f"prompt {e.prompt!r} is {len(p)} tokens, the model's limit is {max_len}")
    return model_dir, tokenizer, ids, min(max_tokens, max_len - max(map(len, ids)))


def chunk_columns(run_id: str, iteration: int, first_id: int, examples: list[Example], prompt_ids: list[list[int]],
                  groups: list[list[Sample]], tokenizer, version: str) -> dict[str, list]:
    """The rollouts table's columns for one chunk: a row per sample, each prompt's group together."""
    samples = [s for group in groups for s in group]
    n = len(samples)

    def per_sample(values) -> list:  # one value per prompt -> one per sample
        return [v for v, group in zip(values, groups) for _ in group]
    return {"run_id": [run_id] * n, "iteration": [iteration] * n,
            "prompt_id": per_sample(range(first_id, first_id + len(groups))),
            "sample_index": [j for group in groups for j in range(len(group))],
            "prompt": per_sample([e.prompt for e in examples]), "prompt_ids": per_sample(prompt_ids),
            "response_ids": [s.response_ids for s in samples],
            "response": decode_responses(tokenizer, [s.response_ids for s in samples]),
            "sampler_logprobs": [s.logprobs for s in samples], "finish_reason": [s.finish_reason for s in samples],
            "ground_truth": per_sample([e.ground_truth for e in examples]), "policy_version": [version] * n}


def rollouts(storage: Storage, run_id: str, iteration: int, force: bool = False) -> Committed:
    cfg = load_run(storage, run_id)
    snap = committed_input(storage, run_id, iteration, "snapshot")
    r = cfg.rollout

    def body(writer):
        examples = iteration_prompts(cfg, iteration)
        model_dir, tokenizer, prompt_ids, budget = policy_and_prompts(snap, examples, r.max_tokens)
        t0 = time.perf_counter()
        gen = get_generator(r.backend, model_dir)  # starts the engine, or reloads a warm one's weights
        engine_s, generate_s = time.perf_counter() - t0, 0.0
        spec = SamplingSpec(n=r.group_size, temperature=r.temperature, top_p=r.top_p,
                            max_tokens=budget,
                            stop=tuple(r.stop), seed=iteration_seed(cfg.seed, iteration, salt=2))
        version = content_hash(snap)[:16]
        n_tokens = n_stop = 0
        with ParquetWriter(storage.fs, writer.path("rollouts.parquet"), "rollouts") as out:
            for start in range(0, len(examples), r.chunk_prompts):
                chunk = slice(start, start + r.chunk_prompts)
                t0 = time.perf_counter()
                groups = gen.generate(prompt_ids[chunk], spec)
                generate_s += time.perf_counter() - t0
                columns = chunk_columns(run_id, iteration, start, examples[chunk], prompt_ids[chunk], groups,
                                        tokenizer, version)
                out.write(columns)
                n_tokens += sum(map(len, columns["response_ids"]))
                n_stop += columns["finish_reason"].count("stop")
                log.info("rollouts iteration %d: %d/%d prompts", iteration, min(start + r.chunk_prompts,
                                                                                len(examples)), len(examples))
        return {"prompts": len(examples), "samples": out.num_rows, "response_tokens": n_tokens,
                "stop_fraction": n_stop / max(out.num_rows, 1), "policy_version": version,
                "engine_s": engine_s, "generate_s": generate_s}

    config = {"seed": cfg.seed, "task": cfg.to_dict()["task"], "rollout": cfg.to_dict()["rollout"]}
    return run_stage(storage, run_id, iteration, "rollouts", config=config,
                     inputs={"snapshot": snap}, body=body, force=force)
