"""What a tracker receives for each committed iteration, named as TRL users look for it: the iteration's figures
(grpo.report.iteration_rows) grouped by prefix, each reward function's mean and std over the samples, a few sample
completions, and every setting of the run once.

    train/     the samples: reward_mean, reward_std, response_length, stop_fraction, samples
    rewards/   <function>/mean and /std (a component of one: <function>/<component>/mean)
    eval/      the held-out eval: exact_match, reward_mean, avg@k, pass@k
    actor/     the update: loss, kl, entropy, clip_frac, grad_norm, logprob_gap, lr, reference_iteration
    behavior/  sampler-learner mismatch (learn.behavior_correction): weight_mean, weight_max, clipped_frac,
               sampler_kl
    perf/      seconds: iteration_s, rollouts_s, learn_s
"""

from __future__ import annotations

import json
import math

from grpo.config import RunConfig
from grpo.record.layout import stage_dir
from grpo.record.storage import Storage, latest_committed
from schemas import table_file

NAMES = {
    **{k: f"train/{k}" for k in ("reward_mean", "reward_std", "response_length", "stop_fraction", "samples")},
    "eval_exact_match": "eval/exact_match",
    "eval_reward": "eval/reward_mean",
    **{k: f"actor/{k}" for k in ("loss", "kl", "entropy", "clip_frac", "grad_norm", "logprob_gap", "lr")},
    "reference_iteration": "actor/reference_iteration",
    "behavior_weight_mean": "behavior/weight_mean",
    "behavior_weight_max": "behavior/weight_max",
    "behavior_clipped_frac": "behavior/clipped_frac",
    "sampler_kl": "behavior/sampler_kl",
    **{k: f"perf/{k}" for k in ("iteration_s", "rollouts_s", "learn_s")},
}
"""iteration_rows' key -> the name a tracker shows; avg@k and pass@k go under eval/, anything new under train/."""

COMPLETIONS = 8
"""Sample completions sent an iteration: the first sample of each of the first prompts, by prompt id."""


def metric_name(key: str) -> str:
    """The tracked name of an iteration_rows key.

    >>> metric_name("kl"), metric_name("pass@4"), metric_name("behavior_clipped_frac")
    ('actor/kl', 'eval/pass@4', 'behavior/clipped_frac')
    """
    if key in NAMES:
        return NAMES[key]
    return f"eval/{key}" if key.startswith(("avg@", "pass@")) else f"train/{key}"


def iteration_metrics(storage: Storage, run_id: str, row: dict) -> dict[str, float]:
    """{tracked name: value} of one iteration: its row's figures (None left out) and its rewards' per function."""
    out = {metric_name(k): float(v) for k, v in row.items() if k != "iteration" and v is not None}
    return out | reward_stats(storage, run_id, row["iteration"])


def reward_stats(storage: Storage, run_id: str, k: int) -> dict[str, float]:
    """rewards/<component>/mean and /std over iteration k's samples: each reward function's total (its name, or the
    task's components), and each of its components (<function>/<component>); `total` is the weighted sum."""
    from schemas import read_parquet

    rewards = latest_committed(storage, stage_dir(storage, run_id, k, "rewards"), verify=False)
    table = read_parquet(storage.fs, rewards.read_path(table_file("rewards")), "rewards", columns=["components"])
    values: dict[str, list[float]] = {}
    for components in table.column("components").to_pylist():
        for name, v in components:
            values.setdefault(name, []).append(v)
    out = {}
    for name, xs in values.items():
        mean = sum(xs) / len(xs)
        out[f"rewards/{name}/mean"] = mean
        out[f"rewards/{name}/std"] = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    return out


def completions(storage: Storage, run_id: str, k: int, n: int = COMPLETIONS) -> list[dict]:
    """[{iteration, prompt_id, prompt, response, reward}] of n sample completions of iteration k (COMPLETIONS)."""
    from schemas import read_parquet

    rollouts, rewards = (latest_committed(storage, stage_dir(storage, run_id, k, s), verify=False) for s in
                         ("rollouts", "rewards"))  # fmt: skip
    keys = ["prompt_id", "sample_index"]
    samples = read_parquet(storage.fs, rollouts.read_path(table_file("rollouts")), "rollouts",
                           columns=[*keys, "prompt", "response"]).to_pylist()  # fmt: skip
    scored = read_parquet(storage.fs, rewards.read_path(table_file("rewards")), "rewards", columns=[*keys, "reward"])
    reward = {(r["prompt_id"], r["sample_index"]): r["reward"] for r in scored.to_pylist()}
    first = sorted((s for s in samples if s["sample_index"] == 0), key=lambda s: s["prompt_id"])[:n]
    return [{"iteration": k, "prompt_id": s["prompt_id"], "prompt": s["prompt"], "response": s["response"],
             "reward": reward[(s["prompt_id"], 0)]} for s in first]  # fmt: skip


def settings(cfg: RunConfig) -> dict[str, str | int | float | bool]:
    """Every setting of the run as `section.field`: scalars as they are, None, lists and dicts as JSON text.

    >>> s = settings(RunConfig())
    >>> s["learn.lr"], s["rollout.group_size"], s["seed"], s["model.base_model"]
    (0.0015, 8, 0, 'null')
    """
    out = {}
    for section, value in cfg.to_dict().items():
        fields = value.items() if isinstance(value, dict) else [(None, value)]
        for name, v in fields:
            key = section if name is None else f"{section}.{name}"
            out[key] = v if isinstance(v, (str, int, float, bool)) else json.dumps(v, sort_keys=True)
    return out
