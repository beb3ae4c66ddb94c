"""Stage 6: held-out evaluation of the iteration's new policy.

The held-out prompts are the same every iteration (stages.rollouts.eval_prompts):
`eval.dataset`, else the held-out split of `task.dataset` (never drawn for training),
else the task generator's prompts of `eval.seed`. Each gets a greedy response
(accuracy); with `eval.samples_per_prompt` k > 1 also k samples at the rollout
temperature (avg@k: the share correct, pass@k: any correct). Responses are scored in
the reward worker pool like the rollouts, with the same per-sample timeout.
"""

from __future__ import annotations

import time

from grpo.generation import SamplingSpec, decode_responses
from grpo.storage import Committed, Storage
from schemas import table_file, write_parquet
from stages.common import check_chain, committed_input, load_run, run_stage
from stages.prompts import eval_prompts, held_out_config, policy_and_prompts, sampler
from stages.rewards import WARM_POOLS, score_batch, scorer_key


def exact_match(components: dict[str, float]) -> float:
    """The task's `exact` (sort) or `correct` (math, arithmetic) component, else whether the total is perfect."""
    return float(components.get("exact", components.get("correct", components.get("total", 0.0) >= 1.0)))


def evaluate(storage: Storage, run_id: str, iteration: int, force: bool = False) -> Committed:
    cfg = load_run(storage, run_id)
    inputs = {"policy": committed_input(storage, run_id, iteration, "learn")}
    if cfg.reward.functions or cfg.learn.lora is not None:  # reward files; LoRA: the weights under the adapters
        inputs["base"] = committed_input(storage, run_id, None, "base")
    check_chain(storage, run_id, iteration, "eval", inputs)
    k = cfg.eval.samples_per_prompt

    def body(writer):
        p = policy_and_prompts(inputs["policy"], eval_prompts(cfg), cfg, base=inputs.get("base"))
        t0 = time.perf_counter()
        gen, settings = sampler(p, cfg)
        t1 = time.perf_counter()
        greedy = [
            g[0]
            for g in gen.generate(p.ids, SamplingSpec(n=1, temperature=0.0, stop=tuple(cfg.rollout.stop)), p.budgets)
        ]
        sampled = (
            []
            if k == 1
            else gen.generate(
                p.ids,
                SamplingSpec(
                    n=k,
                    temperature=cfg.rollout.temperature,
                    top_p=cfg.rollout.top_p,
                    stop=tuple(cfg.rollout.stop),
                    seed=cfg.eval.seed,
                ),
                p.budgets,
            )
        )
        engine_s, generate_s = t1 - t0, time.perf_counter() - t1
        flat = greedy + [s for group in sampled for s in group]
        responses = decode_responses(p.tokenizer, [s.response_ids for s in flat], p.eos_ids)
        owner = list(range(len(greedy))) + [i for i, group in enumerate(sampled) for _ in group]
        items = [(r, p.examples[i].ground_truth, p.texts[i], p.examples[i].row or {}) for r, i in zip(responses, owner)]
        with WARM_POOLS.pool(cfg.reward.workers) as pool:
            scored = score_batch(pool, scorer_key(cfg, inputs.get("base")), cfg.reward, items)
        correct = [exact_match(c) if err is None else 0.0 for _, c, err in scored]
        n = len(greedy)
        per_prompt = [correct[n + i * k : n + (i + 1) * k] for i in range(n)] if k > 1 else [None] * n
        rows = {
            "run_id": [run_id] * n,
            "iteration": [iteration] * n,
            "prompt_id": p.index,
            "prompt": p.texts,
            "response": responses[:n],
            "ground_truth": [e.ground_truth for e in p.examples],
            "reward": [r for r, _, _ in scored[:n]],
            "exact": correct[:n],
            "avg_at_k": [None if c is None else sum(c) / k for c in per_prompt],
            "pass_at_k": [None if c is None else float(max(c)) for c in per_prompt],
        }
        write_parquet(storage.fs, writer.path(table_file("eval")), "eval", rows)
        summary = {
            "prompts": n,
            "skipped_prompts": p.skipped,
            "reward_mean": sum(rows["reward"]) / n,
            "exact_match": sum(rows["exact"]) / n,
            "engine_s": engine_s,
            "generate_s": generate_s,
            "sampler": settings,
        }
        if k > 1:
            summary.update({f"avg@{k}": sum(rows["avg_at_k"]) / n, f"pass@{k}": sum(rows["pass_at_k"]) / n})
        return summary

    config = {
        "task": cfg.to_dict()["task"],
        "eval": cfg.to_dict()["eval"],
        "backend": cfg.rollout.backend,
        "max_tokens": cfg.rollout.max_tokens,
        "max_prompt_tokens": cfg.rollout.max_prompt_tokens,
        "stop": cfg.rollout.stop,
        "reward": {"functions": cfg.reward.functions, "weights": cfg.reward.weights},
    }
    if k > 1:
        config["sampling"] = {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p}
    if cfg.task.dataset:
        config["held_out"] = held_out_config(cfg)
    return run_stage(storage, run_id, iteration, "eval", config=config, inputs=inputs, body=body, force=force)
