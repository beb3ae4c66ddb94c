"""Stage 6: held-out evaluation of the iteration's new policy.

The held-out prompts are the same every iteration (stages.rollouts.eval_prompts):
`eval.dataset`, else the held-out split of `task.dataset` (never drawn for training),
else the task generator's prompts of `eval.seed`. Each gets a greedy response
(accuracy); with `eval.samples_per_prompt` k > 1 also k samples at the rollout
temperature (avg@k: the share correct, pass@k: any correct). Responses are scored in
the reward worker pool like the rollouts, with the same per-sample timeout. With episodes
(rollout.tools, rollout.environment) each is an episode as the rollouts sample them, greedy
(the same environments, seeded from eval.seed: the same every iteration).
"""

from __future__ import annotations

import time

from grpo import devices
from grpo.config import RunConfig
from grpo.episodes import adapters
from grpo.progress import Progress
from grpo.record import reward_files
from grpo.record.identity import section
from grpo.record.layout import Salt, iteration_seed, stage_dir
from grpo.record.lineage import check_chain, committed_input
from grpo.record.storage import Committed, Storage, committed_attempts, latest_committed
from grpo.runtime.pool import WARM_POOLS
from grpo.sampling.base import SamplingSpec, decode_responses
from grpo.scoring.score import score_batch, scorer_key
from schemas import table_file, write_parquet
from stages.common import StageError, load_run, measured, run_stage
from stages.prompts import environments, eval_prompts, held_out_config, policy_and_prompts, sampler
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


def due(iteration: int, every: int, last: bool) -> bool:
    """Whether iteration k is evaluated: after every `every`-th learn (k = every-1, 2*every-1, ...), and the
    last iteration of a call whatever its number.

    >>> [k for k in range(5) if due(k, 2, last=k == 4)]
    [1, 3, 4]
    """
    return last or (iteration + 1) % every == 0


@measured
def evaluate(storage: Storage, run_id: str, iteration: int, force: bool = False, last: bool = True) -> Committed:
    """The held-out eval of iteration k's policy; where it is not due (eval.every, `last`: whether k is the last
    iteration its caller runs; a forced eval is always due), a skipped eval instead (see `skip`)."""
    cfg = load_run(storage, run_id)
    inputs = {"policy": committed_input(storage, run_id, iteration, "learn")}
    if cfg.learn.lora is not None or adapters.names_files(
        cfg.rollout
    ):  # the weights under the adapters; tool and environment files
        inputs["base"] = committed_input(storage, run_id, None, "base")
    if cfg.reward.functions:  # the committed copies of reward files (the base, or a fork's own)
        inputs |= reward_files.holder_input(storage, run_id)
    check_chain(storage, run_id, iteration, "eval", inputs)
    if not force and not due(iteration, cfg.eval.every, last):
        return skip(storage, run_id, iteration, inputs)
    k = cfg.eval.samples_per_prompt

    def body(writer):
        with environments(cfg, inputs.get("base")) as env:  # episodes: the rollouts' environments and tools
            return held_out(writer, env)

    def held_out(writer, env):
        p = policy_and_prompts(inputs["policy"], eval_prompts(cfg), cfg, base=inputs.get("base"), tools=env.tools)
        t0 = time.perf_counter()
        gen, settings = sampler(p, cfg)
        t1 = time.perf_counter()
        report = Progress(f"eval {iteration}", len(p.ids) * (1 if k == 1 else 2), "prompts")  # greedy, then k samples
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
            scored = score_batch(pool, scorer_key(cfg, reward_files.holder_of(inputs)), cfg.reward, items)
        correct = [exact_match(c, cfg.eval.correct) if err is None else 0.0 for _, c, err in scored]
        n = len(greedy)
        per_prompt = [correct[n + i * k : n + (i + 1) * k] for i in range(n)] if k > 1 else [None] * n
        rows = {
            "run_id": [run_id] * n,
            "iteration": [iteration] * n,
            "prompt_id": p.index,
            "prompt": texts,
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
        if k > 1:  # config.EvalConfig.metric_key names these
            summary.update({f"avg@{k}": sum(rows["avg_at_k"]) / n, f"pass@{k}": sum(rows["pass_at_k"]) / n})
        return summary

    with devices.current(devices.sampler_device(cfg.rollout)):  # this thread's CUDA device the sampler's
        return run_stage(
            storage, run_id, iteration, "eval", config=stage_config(cfg), inputs=inputs, body=body, force=force
        )


def skip(storage: Storage, run_id: str, iteration: int, inputs: dict[str, Committed]) -> Committed:
    """An eval that is not due commits an attempt of its own, summary {"skipped": true} and no files, rather than
    nothing: "iteration k is finished" stays "its eval committed and is current" (stages.iteration), so resume,
    status, gc and the report need no copy of the cadence rule, and a rerun learn makes the skip stale like any
    eval. (Counting a committed learn as finished when its eval is not due would not do: whether it is due
    depends on which iteration ends the caller's call, which storage does not record, so a resume could not tell
    a skip from an eval that crashed.) A newest eval that already read this policy is kept as it is: an eval that
    ran because k was the last iteration of an earlier call is never replaced by a skip (and a skip is replaced
    by an eval when a later call ends at k: the real eval's identity differs)."""
    sdir = stage_dir(storage, run_id, iteration, "eval")
    newest = latest_committed(storage, sdir, verify=False) if committed_attempts(storage, sdir) else None
    read = {name: c.manifest_sha256 for name, c in inputs.items()}
    if newest is not None and {name: r.manifest_sha256 for name, r in newest.manifest.inputs.items()} == read:
        return newest
    return run_stage(
        storage, run_id, iteration, "eval", config={"skipped": True}, inputs=inputs, body=lambda w: {"skipped": True}
    )


def stage_config(cfg: RunConfig) -> dict:
    """What the eval stage's identity covers: the held-out prompts, the sampler and the reward (not
    grpo.record.identity.EVAL_READING: when evals run and which figure is read as the best)."""
    config = {
        "task": section(cfg, "task"),
        "eval": section(cfg, "eval"),
        "backend": cfg.rollout.backend,
        "max_tokens": cfg.rollout.max_tokens,
        "max_prompt_tokens": cfg.rollout.max_prompt_tokens,
        "stop": cfg.rollout.stop,
        "reward": {"functions": cfg.reward.functions, "weights": cfg.reward.weights},
    }
    if cfg.eval.samples_per_prompt > 1:
        config["sampling"] = {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p}
    if cfg.task.dataset:
        config["held_out"] = held_out_config(cfg)
    if cfg.rollout.environment_kind() is not None:  # episodes, as the rollouts sample them
        names = ("tools", "environment", "max_turns", "tool_timeout_s", "tool_max_memory_mb")
        config["episodes"] = {name: section(cfg, "rollout")[name] for name in names}
    return config
