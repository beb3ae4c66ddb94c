"""Dynamic sampling's rules (DAPO, Yu et al. 2025; verl's algorithm.filter_groups), for the rollouts stage's
rounds (stages.rollouts.sample_rounds): where an iteration's draws start (after the previous iteration's
rounds), which inputs say so, whether a group has signal (unequal rewards, scored as the rewards stage scores,
grpo.scoring), and when a whole epoch without signal stops the rounds.
"""

from __future__ import annotations

import json

from grpo.config import RunConfig
from grpo.record.lineage import committed_input
from grpo.record.storage import Committed, Storage
from grpo.scoring.score import score_samples
from stages.prompts import held_out_split


def dynamic_inputs(storage: Storage, cfg: RunConfig, run_id: str, iteration: int) -> dict[str, Committed]:
    """Dynamic sampling's inputs beyond the snapshot: the base with reward files (the scorer), and for a
    dataset the previous iteration's rollouts, whose committed summary says where this iteration's draws
    start (draw_start)."""
    inputs = {}
    if cfg.reward.functions:
        inputs["base"] = committed_input(storage, run_id, None, "base")
    if cfg.task.dataset and iteration > 0:
        inputs["previous"] = committed_input(storage, run_id, iteration - 1, "rollouts")
    return inputs


def draw_start(cfg: RunConfig, iteration: int, inputs: dict[str, Committed]) -> int:
    """The epoch-order position of the iteration's first draw: iteration * prompts_per_iteration, or under
    dynamic sampling with a dataset where the previous iteration's draws ended (its committed draw_end)."""
    if "previous" not in inputs:
        return iteration * cfg.rollout.prompts_per_iteration
    return inputs["previous"].manifest.summary["draw_end"]


def flat_epoch(cfg: RunConfig, iteration: int, rounds: int) -> str | None:
    """The line that stops dynamic sampling once `rounds` rounds drew a whole epoch of task.dataset and none of
    their groups had signal: more rounds redraw the same prompts, and no learner setting helps a reward that
    is the same for every response; None before that (and for a task's own prompts, an endless stream)."""
    if not cfg.task.dataset:
        return None
    rows, drawn = len(held_out_split(cfg)[0]), rounds * cfg.rollout.prompts_per_iteration
    if drawn < rows:
        return None
    scorer = f"reward.functions {cfg.reward.functions}" if cfg.reward.functions else f"task {cfg.task.name}'s reward"
    return (
        f"rollouts iteration {iteration}: dynamic sampling stopped after {rounds} round(s), {drawn} prompts drawn, a "
        f"whole epoch of task.dataset's {rows} training rows, in which no group of rollout.group_size="
        f"{cfg.rollout.group_size} responses had unequal rewards: the reward looks constant on this dataset; check "
        f"that {scorer} scores task.answer_column={cfg.task.answer_column!r} as meant on a few rows (else the model "
        "solves none yet: raise rollout.group_size or rollout.temperature); nothing committed"
    )


def group_signal(cfg: RunConfig, pool, key: tuple, columns: dict[str, list], sizes: list[int]) -> list[bool]:
    """Whether each group of a chunk's rows has unequal rewards, scored as the rewards stage scores."""
    items = list(zip(columns["response"], columns["ground_truth"], columns["prompt"], map(json.loads, columns["row"])))
    lengths = [len(ids) for ids in columns["response_ids"]]
    rewards = [reward for reward, _, _ in score_samples(pool, key, cfg, items, columns["finish_reason"], lengths)]
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [max(rewards[a:b]) > min(rewards[a:b]) for a, b in zip(bounds, bounds[1:])]
