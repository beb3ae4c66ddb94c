"""Stage 4: group-relative advantages from the rewards (grpo.core.group_advantages).

Each prompt's G samples form a group; the stage checks every group is complete,
stores per-sample advantages with their group's mean and std, and optionally
drops groups with zero reward variance (they give no gradient signal); under dynamic sampling
(rollout.min_signal_groups) keeps only groups with signal, as many as a batch (signal_groups_kept), and refuses
the iteration when they do not fill one minibatch, naming the groups found and needed.
Finite rewards whose group statistics overflow float64 (a mean or std of inf or nan) are refused,
naming the group and the function.
"""

from __future__ import annotations

import math

import pyarrow.compute as pc
import torch

from grpo.config import RunConfig
from grpo.core import group_advantages, teacher_advantages
from grpo.record.identity import section
from grpo.record.lineage import check_chain, committed_input
from grpo.record.storage import Committed, Storage
from grpo.tasks.functions import reward_source
from schemas import read_parquet, table_file, write_parquet
from stages.common import StageError, load_run, measured, run_stage


@measured
def advantages(storage: Storage, run_id: str, iteration: int, force: bool = False) -> Committed:
    cfg = load_run(storage, run_id)
    rewards_in = committed_input(storage, run_id, iteration, "rewards")
    inputs = {"rewards": rewards_in}
    if cfg.teacher is not None:  # on-policy distillation: the teacher's log-probs, the sampler's (stages/teacher.py)
        inputs |= {s: committed_input(storage, run_id, iteration, s) for s in ("rollouts", "teacher")}
    check_chain(storage, run_id, iteration, "advantages", inputs)
    group_size, acfg = cfg.rollout.group_size, cfg.advantage
    dynamic = stage_config(cfg).get("dynamic_sampling")

    def body(writer):
        table = read_parquet(
            storage.fs,
            rewards_in.read_path(table_file("rewards")),
            "rewards",
            columns=["run_id", "iteration", "prompt_id", "sample_index", "reward"],
        )
        table = table.sort_by([("prompt_id", "ascending"), ("sample_index", "ascending")])
        prompt_ids = table.column("prompt_id").to_numpy()
        counts = pc.value_counts(table.column("prompt_id")).to_pylist()
        bad = [c for c in counts if c["counts"] != group_size]
        if bad:
            raise StageError(
                f"{rewards_in.uri}: prompt_id {bad[0]['values']} has {bad[0]['counts']} samples, "
                f"rollout.group_size is {group_size}"
            )
        rewards = torch.tensor(table.column("reward").to_numpy(), dtype=torch.float64)
        adv, stats = group_advantages(rewards, group_size, acfg.mode, acfg.eps)
        reward_mean, reward_std = rewards.mean().item(), rewards.std().item() if len(rewards) > 1 else 0.0
        bad = overflowed(adv, stats, group_size, [reward_mean, reward_std])
        if bad is not None:
            refuse(table.slice(*bad), (reward_mean, reward_std))
        spread = stats["max"] > stats["min"]  # (n_groups,)
        if dynamic:
            keep = signal_groups_kept(spread, **dynamic)
            if not keep.any():  # the learner would refuse an empty batch: say what was found against what it needs
                raise StageError(too_few_signal_groups(cfg, int(spread.sum()), len(counts)))
            kept = keep.repeat_interleave(group_size)
        else:
            kept = (
                spread.repeat_interleave(group_size)
                if acfg.filter_zero_variance
                else torch.ones_like(rewards, dtype=torch.bool)
            )
        cols = {k: table.column(k) for k in ["run_id", "iteration", "prompt_id", "sample_index", "reward"]}
        cols.update(
            advantage=adv.tolist(),
            group_mean=stats["mean"].repeat_interleave(group_size).tolist(),
            group_std=stats["std"].repeat_interleave(group_size).tolist(),
            kept=kept.tolist(),
        )
        write_parquet(
            storage.fs,
            writer.path(table_file("advantages")),
            "advantages",
            {k: v if isinstance(v, list) else v.to_pylist() for k, v in cols.items()},
        )
        if cfg.teacher is not None:
            write_token_advantages(storage, inputs, writer.path(table_file("token_advantages")), cfg, table, adv)
        summary = {
            "samples": len(prompt_ids),
            "groups": len(counts),
            "reward_mean": reward_mean,
            "reward_std": reward_std,
            "zero_variance_groups": int((~spread).sum()),
            "kept": int(kept.sum()),
        }
        if dynamic:
            summary.update(signal_groups=int(spread.sum()), kept_groups=int(kept.sum()) // group_size)
        return summary

    def refuse(rows, totals: tuple[float, float]) -> None:
        """Fail naming the rows' group (or the batch) and the function of their largest reward."""
        group = rows.num_rows == group_size
        where = f"prompt_id {rows.column('prompt_id')[0].as_py()}" if group else "the batch"
        stats = "its group's mean or std" if group else f"the mean {totals[0]} or std {totals[1]}"
        top = max(range(rows.num_rows), key=lambda i: abs(rows.column("reward")[i].as_py()))
        found = read_parquet(storage.fs, rewards_in.path(table_file("rewards")), "rewards")
        found = found.filter(
            pc.and_(
                pc.equal(found.column("prompt_id"), rows.column("prompt_id")[top]),
                pc.equal(found.column("sample_index"), rows.column("sample_index")[top]),
            )
        )
        source = reward_source(cfg.task.name, cfg.reward.functions, dict(found.column("components")[0].as_py()))
        raise StageError(
            f"advantages: rewards of {where} overflow float64 in {stats} (not finite): {source} returned "
            f"{rows.column('reward')[top].as_py():.3g}; scale its rewards down (nothing was committed)"
        )

    config = stage_config(cfg)
    return run_stage(storage, run_id, iteration, "advantages", config=config, inputs=inputs, body=body, force=force)


def stage_config(cfg: RunConfig) -> dict:
    """What the stage's identity covers: the advantage section and G; with dynamic sampling
    (rollout.min_signal_groups) also how many groups with signal the learner keeps (signal_groups_kept)."""
    config = {"advantage": section(cfg, "advantage"), "group_size": cfg.rollout.group_size}
    if cfg.rollout.min_signal_groups is not None:
        per_step = cfg.learn.minibatch_size // cfg.rollout.group_size
        config["dynamic_sampling"] = {"at_most": cfg.rollout.prompts_per_iteration, "multiple_of": per_step}
    if cfg.teacher is not None:  # runs without a teacher keep their identity
        config["teacher"] = {"mode": cfg.teacher.mode, "coef": cfg.teacher.coef}
    return config


def write_token_advantages(storage: Storage, inputs: dict, path: str, cfg: RunConfig, table, adv) -> None:
    """token_advantages.parquet: each sample's per-token advantage from its teacher log-probs and sampler log-probs
    (grpo.core.teacher_advantages), rows in `table`'s order (prompt_id, sample_index), whose advantages are `adv`."""
    keys = ["prompt_id", "sample_index"]
    ro = read_parquet(storage.fs, inputs["rollouts"].read_path(table_file("rollouts")), "rollouts",
                      columns=keys + ["sampler_logprobs", "loss_mask"])  # fmt: skip
    te = read_parquet(storage.fs, inputs["teacher"].read_path(table_file("teacher")), "teacher",
                      columns=keys + ["teacher_logprobs"])  # fmt: skip
    at = {k: i for i, k in enumerate(zip(*(ro.column(c).to_pylist() for c in keys)))}
    te_at = {k: i for i, k in enumerate(zip(*(te.column(c).to_pylist() for c in keys)))}
    order = list(zip(*(table.column(c).to_pylist() for c in keys)))
    if missing := [k for k in order if k not in at or k not in te_at]:
        raise StageError(f"{inputs['teacher'].uri}: sample {missing[0]} has no teacher or rollouts row")
    sampler, mask = ro.column("sampler_logprobs").to_pylist(), ro.column("loss_mask").to_pylist()
    teacher = te.column("teacher_logprobs").to_pylist()
    out = []
    for k, a in zip(order, adv.tolist()):
        s, m, t = sampler[at[k]], mask[at[k]], teacher[te_at[k]]
        if not len(s) == len(m) == len(t):
            raise StageError(f"{inputs['teacher'].uri}: sample {k} has {len(t)} teacher log-probs for {len(s)} tokens")
        args = (torch.tensor([s]), torch.tensor([t]), torch.tensor([m]), torch.tensor([a]))  # (1, T) x 3, (1,)
        out.append(teacher_advantages(*args, cfg.teacher.mode, cfg.teacher.coef)[0].tolist())
    cols = {c: table.column(c).to_pylist() for c in ["run_id", "iteration", *keys]}
    write_parquet(storage.fs, path, "token_advantages", {**cols, "token_advantage": out})


def signal_groups_kept(spread, at_most: int, multiple_of: int):
    """Dynamic sampling (rollout.min_signal_groups; stages.rollouts.sample_rounds): the groups the learner
    trains on. Only groups with signal (unequal rewards, by the committed rewards), the first of them in draw
    order (prompt_id: round by round), at most `at_most` (prompts_per_iteration: the batch a round
    makes, as verl keeps train_batch_size groups) and a multiple of `multiple_of` (the groups of a minibatch),
    so every kept group trains in every epoch; none when there are fewer than a minibatch's (the stage then
    refuses the iteration: too_few_signal_groups).

    spread: (n_groups,) bool in prompt_id order -> (n_groups,) bool.

    >>> signal_groups_kept(torch.tensor([True, False, True, True, True, True]), at_most=4, multiple_of=3).tolist()
    [True, False, True, True, False, False]
    """
    n = min(int(spread.sum()), at_most) // multiple_of * multiple_of
    return spread & (spread.cumsum(0) <= n)


def too_few_signal_groups(cfg: RunConfig, found: int, drawn: int) -> str:
    """The one line for dynamic sampling that found fewer groups with signal than one minibatch of the learner takes
    (signal_groups_kept then keeps none)."""
    mb, g = cfg.learn.minibatch_size, cfg.rollout.group_size
    return (
        f"advantages: dynamic sampling found {found} groups with signal among the {drawn} drawn "
        f"(rollout.max_sampling_rounds {cfg.rollout.max_sampling_rounds}), fewer than the {mb // g} groups one "
        f"minibatch needs (learn.minibatch_size {mb} / rollout.group_size {g}); lower learn.minibatch_size or raise "
        "rollout.max_sampling_rounds (nothing was committed)"
    )


def overflowed(adv, stats: dict, group_size: int, totals: list[float]) -> tuple[int, int] | None:
    """(offset, length) of the rows of the first group whose mean, std or advantages are not finite, or of
    the whole batch when only its mean or std (`totals`) is not; None when everything is finite.

    adv: (B,); stats: {mean, std}, each (G,), B = G * group_size.
    """
    bad = ~(torch.isfinite(stats["mean"]) & torch.isfinite(stats["std"]))  # (G,)
    bad |= ~torch.isfinite(adv).reshape(-1, group_size).all(dim=1)
    if bad.any():
        return int(bad.nonzero()[0, 0]) * group_size, group_size
    return None if all(map(math.isfinite, totals)) else (0, len(adv))
