"""Stage 6: greedy decoding of a fixed held-out prompt set with the iteration's new policy.

The held-out prompts come from the task generator with `eval.seed`, the same
set every iteration, so mean reward and exact match are comparable over time.
"""
from __future__ import annotations

import time

from grpo.generation import SamplingSpec, decode_responses, get_generator
from grpo.storage import Committed, Storage
from grpo.tasks import get_task
from schemas import write_parquet
from stages.common import committed_input, load_run, run_stage
from stages.rollouts import policy_and_prompts


def exact_match(components: dict[str, float]) -> float:
    """The task's `exact` component, else whether the total reward is perfect."""
    return float(components.get("exact", components["total"] >= 1.0))


def evaluate(storage: Storage, run_id: str, iteration: int, force: bool = False) -> Committed:
    cfg = load_run(storage, run_id)
    policy = committed_input(storage, run_id, iteration, "learn")

    def body(writer):
        task = get_task(cfg.task.name, **cfg.task.params)
        examples = task.generate(cfg.eval.n_prompts, cfg.eval.seed)
        model_dir, tokenizer, prompt_ids, budget = policy_and_prompts(policy, examples, cfg.rollout.max_tokens)
        spec = SamplingSpec(n=1, temperature=0.0, max_tokens=budget, stop=tuple(cfg.rollout.stop))
        t0 = time.perf_counter()
        gen = get_generator(cfg.rollout.backend, model_dir)
        t1 = time.perf_counter()
        outs = gen.generate(prompt_ids, spec)
        engine_s, generate_s = t1 - t0, time.perf_counter() - t1
        responses = decode_responses(tokenizer, [o[0].response_ids for o in outs])
        scores = [task.reward(r, e.ground_truth, e.prompt) for r, e in zip(responses, examples)]
        n = len(examples)
        rows = {"run_id": [run_id] * n, "iteration": [iteration] * n, "prompt_id": list(range(n)),
                "prompt": [e.prompt for e in examples], "response": responses,
                "ground_truth": [e.ground_truth for e in examples],
                "reward": [float(s["total"]) for s in scores], "exact": [exact_match(s) for s in scores]}
        write_parquet(storage.fs, writer.path("eval.parquet"), "eval", rows)
        return {"prompts": n, "reward_mean": sum(rows["reward"]) / n, "exact_match": sum(rows["exact"]) / n,
                "engine_s": engine_s, "generate_s": generate_s}

    config = {"task": cfg.to_dict()["task"], "eval": cfg.to_dict()["eval"], "backend": cfg.rollout.backend,
              "max_tokens": cfg.rollout.max_tokens, "stop": cfg.rollout.stop}
    return run_stage(storage, run_id, iteration, "eval", config=config, inputs={"policy": policy},
                     body=body, force=force)
