"""Rescore: the committed rollouts of a run's iterations scored again with a changed reward, in a fork, without
sampling. `grpo rescore` goes through here.

The fork (grpo.record.fork) is made at the iteration after the last one rescored, so every stage up to it is the
parent's by reference; then the rewards and advantages of the rescored iterations run with the fork's config and
supersede the referenced ones (its learns of those iterations, trained on the old rewards, then show as stale:
`grpo run` on the fork would retrain from the first rescored iteration). What changed is the `rescore` view
of `grpo query` on the fork (grpo.query.RESCORE_VIEW).
"""

from __future__ import annotations

import pandas as pd

from grpo.config import ConfigError
from grpo.query import query
from grpo.record import reward_files
from grpo.record.digests import sha256_local
from grpo.record.fork import fork_config, fork_run
from grpo.record.identity import config_hash
from grpo.record.lineage import next_iteration
from grpo.record.storage import Storage
from grpo.runtime.pool import WARM_POOLS
from stages import advantages as advantages_stage
from stages import rewards as rewards_stage
from stages import teacher as teacher_stage
from stages.common import StageError

RESCORE_SETTINGS = ("reward.", "task.params", "advantage.", "teacher.")
"""What a rescore may change: how samples are scored (their reward, their teacher's log-probs: on-policy
distillation) and their advantages computed."""


def rescore_run_id(
    parent: str, first: int, last: int, overrides: list[str], files: dict[str, str] | None = None
) -> str:
    """The fork a rescore makes unless named: the same rescore again finds it (and reuses its stages); `files`,
    {committed name: sha256} of reward files whose bytes changed (new_files), name another fork per fix.

    >>> rescore_run_id("demo", 0, 4, ["reward.truncated_reward=-1"])
    'demo-rescore-0-4-b4001306'
    """
    key = [sorted(overrides), files] if files else sorted(overrides)
    return f"{parent}-rescore-{first}-{last}-{config_hash(key)[:8]}"


def new_files(storage: Storage, parent: str, overrides: list[str]) -> dict[str, str]:
    """{committed name: sha256} of the reward files a rescore with `overrides` scores with whose bytes differ from
    what `parent` scores with: files named by a `reward.functions` in `overrides`, read here (grpo.scoring.files)."""
    _, after = fork_config(storage, parent, overrides)
    named = any(o.split("=", 1)[0].strip() == "reward.functions" for o in overrides)
    if not (named and after.reward.functions):
        return {}
    holder = reward_files.holder_of(reward_files.holder_input(storage, parent))
    changed = reward_files.changed_files(after, True, reward_files.held_files(holder))
    want = reward_files.wanted_files(after, True, reward_files.held_files(holder))
    return {n: sha256_local(want[n]) for n in changed if want.get(n)}


def check_rescore(storage: Storage, parent: str, first: int, last: int, overrides: list[str]) -> None:
    """Refuse, in one line and before anything is written, settings a rescore cannot change, iterations the
    parent has not finished, and settings that change nothing the rewards or advantages read."""
    if not overrides:
        raise ConfigError("--set: name the settings to rescore with (reward.*, task.params, advantage.*, teacher.*)")
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if not key.startswith(RESCORE_SETTINGS):
            raise ConfigError(
                f"--set {key}: a rescore changes only how samples are scored (reward.*, task.params, advantage.*, "
                "teacher.*); "
                "fork the run to change anything else (`grpo fork`)"
            )
    before, after = fork_config(storage, parent, overrides)
    if first < 0 or last < first:
        raise StageError(f"--iterations {first}:{last}: give A:B with 0 <= A <= B (both rescored)")
    done = next_iteration(storage, parent)
    if last >= done:
        raise StageError(
            f"--iterations {first}:{last}: run {parent} has finished iterations 0..{done - 1} only "
            f"(`grpo status --run {parent}`)"
        )
    teacher_stage.check_fork_teacher(storage, parent, before, after)  # another teacher: the student's tokenizer
    read = (rewards_stage.stage_config, advantages_stage.stage_config, teacher_stage.stage_config)
    if all(f(before) == f(after) for f in read) and not new_files(storage, parent, overrides):
        raise ConfigError(
            f"--set {' '.join(overrides)}: changes nothing the rewards, teacher or advantages of {parent} read "
            "(a reward file named in reward.functions counts where its bytes differ from the run's copy)"
        )


def rescore(storage: Storage, parent: str, first: int, last: int, overrides: list[str], run_id: str) -> None:
    """Fork `parent` into `run_id` at `last + 1` with `overrides`, then score iterations first..last again
    (rewards, the teacher's log-probs where the fork has a teacher, and advantages; no rollouts are written)."""
    check_rescore(storage, parent, first, last, overrides)
    fork_run(storage, parent, last + 1, run_id, overrides)
    taught = fork_config(storage, parent, overrides)[1].teacher is not None
    with WARM_POOLS.keep():  # one reward worker pool for every iteration
        for k in range(first, last + 1):
            rewards_stage.rewards(storage, run_id, k)
            if taught:  # the committed token ids scored by the fork's teacher: a prefill, no sampling
                teacher_stage.teacher(storage, run_id, k)
            advantages_stage.advantages(storage, run_id, k)


def changes(storage: Storage, run_id: str, first: int, last: int) -> pd.DataFrame:
    """Per rescored iteration: samples whose reward changed, the reward mean before and after, the groups
    (prompts) whose advantage flipped sign in at least one sample, and the first few of each."""
    return query(
        storage,
        run_id,
        f"""SELECT iteration,
                   count(*) FILTER (WHERE reward_changed) AS samples_changed,
                   count(*) AS samples,
                   avg(reward_before) AS reward_before,
                   avg(reward_after) AS reward_after,
                   count(DISTINCT prompt_id) FILTER (WHERE advantage_flipped) AS groups_flipped,
                   list(DISTINCT prompt_id ORDER BY prompt_id) FILTER (WHERE advantage_flipped) AS flipped,
                   list(printf('%d/%d: %.3g -> %.3g', prompt_id, sample_index, reward_before, reward_after)
                        ORDER BY prompt_id, sample_index) FILTER (WHERE reward_changed) AS changed
            FROM rescore WHERE iteration BETWEEN {int(first)} AND {int(last)} GROUP BY 1 ORDER BY 1""",
    )
