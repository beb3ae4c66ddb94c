"""The held-out figures of a policy: each eval prompt's greedy response (exact match) and, with k > 1, k samples at
the rollout temperature (avg@k, pass@k), scored in the reward worker pool as the rollouts are. The eval stage commits
them for every iteration's policy; the warm start (stages/sft.py) measures its gate (sft.gate_pass_at_k) with them.
"""

from __future__ import annotations

import time

from grpo.config import RunConfig
from grpo.errors import StageError
from grpo.progress import Progress
from grpo.record.layout import Salt, iteration_seed
from grpo.runtime.pool import WARM_POOLS
from grpo.sampling.base import SamplingSpec, decode_responses
from grpo.scoring.score import score_batch
from stages.prompts import Prompts, sampler
from stages.samples import reward_arguments, sample_all


def exact_match(components: dict[str, float], correct: str | None = None) -> float:
    """Whether a response counts as correct: the component `correct` names (eval.correct) is >= 1; without one, the
    task's `exact` (sort) or `correct` (math, arithmetic) component, else whether the total is perfect.

    >>> exact_match({"exact": 0.0, "total": 1.0}), exact_match({"fmt": 1.0, "total": 0.5}, "fmt")
    (0.0, 1.0)
    """
    if correct is None:
        return float(components.get("exact", components.get("correct", components.get("total", 0.0) >= 1.0)))
    if correct not in components:
        raise StageError(f"eval.correct={correct!r}: the reward has no such component; it has {sorted(components)}")
    return float(components[correct] >= 1.0)


def held_out_figures(cfg: RunConfig, p: Prompts, env, k: int, label: str, scorer: tuple) -> tuple[dict, dict]:
    """(the eval table's columns less run_id and iteration, the summary) of the policy `p` samples from over its
    held-out prompts: greedy, then with k > 1 k samples each; `env`: the episodes' Environments; `scorer`: the
    reward's key (grpo.scoring.score.scorer_key)."""
    t0 = time.perf_counter()
    gen, settings = sampler(p, cfg)
    t1 = time.perf_counter()
    report = Progress(label, len(p.ids) * (1 if k == 1 else 2), "prompts")  # greedy, then k samples
    seed = iteration_seed(cfg.eval.seed, 0, Salt.ENVIRONMENT)  # episodes: the same every iteration
    greedy_spec = SamplingSpec(n=1, temperature=0.0, stop=tuple(cfg.rollout.stop))
    greedy = [g[0] for g in sample_all(gen, p, greedy_spec, env, cfg, seed, report.part)]
    r = cfg.rollout
    spec = SamplingSpec(n=k, temperature=r.temperature, top_p=r.top_p, stop=tuple(r.stop), seed=cfg.eval.seed)
    later = lambda done: report.part(len(p.ids) + done)  # noqa: E731
    sampled = [] if k == 1 else sample_all(gen, p, spec, env, cfg, seed, later)
    report.end()
    engine_s, generate_s = t1 - t0, time.perf_counter() - t1
    flat = greedy + [s for group in sampled for s in group]
    responses = decode_responses(p.tokenizer, [s.response_ids for s in flat], p.eos_ids)
    owner = list(range(len(greedy))) + [i for i, group in enumerate(sampled) for _ in group]
    texts = [s.prompt_text for s in greedy]
    rows = [(p.examples[i].row or {}) | extra for i, extra in zip(owner, reward_arguments(flat))]
    items = [(r, p.examples[i].ground_truth, texts[i], row) for r, i, row in zip(responses, owner, rows)]
    with WARM_POOLS.pool(cfg.reward.workers, cfg.reward.pass_env) as pool:
        scored = score_batch(pool, scorer, cfg.reward, items)
    correct = [exact_match(c, cfg.eval.correct) if err is None else 0.0 for _, c, err in scored]
    n = len(greedy)
    per_prompt = [correct[n + i * k : n + (i + 1) * k] for i in range(n)] if k > 1 else [None] * n
    columns = {
        "prompt_id": p.index,
        "prompt": texts,
        "response": responses[:n],
        "ground_truth": [e.ground_truth for e in p.examples],
        "reward": [r for r, _, _ in scored[:n]],
        "exact": correct[:n],
        "avg_at_k": [None if c is None else sum(c) / k for c in per_prompt],
        "pass_at_k": [None if c is None else float(max(c)) for c in per_prompt],
    }
    summary = {
        "prompts": n,
        "skipped_prompts": p.skipped,
        "reward_mean": sum(columns["reward"]) / n,
        "exact_match": sum(columns["exact"]) / n,
        "engine_s": engine_s,
        "generate_s": generate_s,
        "sampler": settings,
    }
    if k > 1:  # config.EvalConfig.metric_key names these
        summary.update({f"avg@{k}": sum(columns["avg_at_k"]) / n, f"pass@{k}": sum(columns["pass_at_k"]) / n})
    return columns, summary
