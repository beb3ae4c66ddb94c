"""Stage 3: score every rollout with the task's verifiable reward, or the user's functions.

`reward.functions` replace the task's reward: they are loaded from the run's base commit
(a file is copied there at `grpo init`) or imported by module name, and get each sample's
dataset row as keyword arguments (grpo.tasks.functions).

Rewards run in worker processes the stage watches (RewardPool); each sample has a time limit. A
response cut off at max_tokens scores `reward.truncated_reward` when that is set (an unfinished
answer is not an answer; without it a policy that never emits eos is never shown that stopping
after the answer pays); with `reward.overlong_buffer` a response within that many tokens of max_tokens
loses a share of `reward.overlong_penalty` growing linearly with its length (DAPO), recorded as the
component `overlong`. An exception, a timeout, a MemoryError past `reward.max_memory_mb`, a
function that ignores its alarm or a worker that dies (os._exit, a signal, the OOM killer) is
recorded in the `error` column with reward 0, naming the function; a hung or dead worker is
replaced at once; and the stage fails (committing nothing) as soon as more than
`max_error_fraction` of its samples erred. What reward functions print goes to a file per worker:
the log shows its first few KB once per scoring. Processes a function leaves running are killed as its job
ends, logged and counted (`processes_left`), not an error. A mean reward that is not finite (rewards whose
sum overflows float64) is refused, naming the function.

With `reward.judge` a model judges the shard's rows first, as one batch (grpo/scoring/judge.py): its score is the
reward component `judge`, weighted by the last of reward.weights; every call is committed in judge.parquet beside
rewards.parquet (the `judge` view of `grpo query`). An answer that does not parse scores
reward.judge.parse_error_reward and is counted in the summary (`judge_errors`), not in `errors`: it never fails the
stage. A call that failed every try (the endpoint down) is the sample's error and counts against max_error_fraction.
"""

from __future__ import annotations

import logging
import math

import pyarrow.compute as pc
import pyarrow.parquet as pq

from grpo.config import RunConfig
from grpo.progress import progress
from grpo.record import reward_files
from grpo.record.identity import section
from grpo.record.lineage import check_chain, committed_input
from grpo.record.storage import Committed, Storage
from grpo.runtime.pool import WARM_POOLS
from grpo.scoring import judge as judge_engine
from grpo.scoring.score import (
    allowed_errors,
    arguments_by_episode,
    batch_items,
    score_batch,
    score_samples,
    scorer_key,
    shaped,
    with_judge,
)
from grpo.tasks import functions
from schemas import ParquetWriter, iter_batches, read_parquet, table_file
from stages.common import StageError, load_run, measured
from stages.shards import ranges, run_sharded

log = logging.getLogger("grpo.stages")


@measured
def rewards(storage: Storage, run_id: str, iteration: int, force: bool = False, shard: int | None = None) -> Committed:
    """Score every sample; with reward.shards > 1, shard `shard` alone or every shard then their rows
    merged (stages.shards). A sample's reward depends on that sample alone, so 1 and N shards score the
    same rows."""
    cfg = load_run(storage, run_id)
    rollouts = committed_input(storage, run_id, iteration, "rollouts")
    inputs = {"rollouts": rollouts}
    if cfg.reward.functions:  # the committed copies of reward files, and their hashes in the identity
        inputs |= reward_files.holder_input(storage, run_id)
    check_chain(storage, run_id, iteration, "rewards", inputs)
    path = rollouts.path(table_file("rollouts"))
    jcfg = cfg.reward.judge  # a local judge's revision (its files' hash, its hub commit) is in the identity
    local_judge = judge_engine.make_judge(jcfg, cfg.rollout) if jcfg is not None and jcfg.url is None else None

    def score(writer, shard_k: int = 0) -> dict:
        rollouts.read_path(table_file("rollouts"))  # its size and sha256 checked before any row is read
        with storage.fs.open(path, "rb") as f:
            sampled = pq.ParquetFile(f).metadata.num_rows
        if sampled == 0:
            raise StageError(f"{rollouts.uri}: rollouts.parquet has no rows")
        rows = ranges(sampled, cfg.reward.shards)[shard_k]
        if not rows:  # more shards than samples (prompts skipped as over-long): this one's range holds none
            for table in ("rewards", "judge") if cfg.reward.judge is not None else ("rewards",):
                ParquetWriter(storage.fs, writer.path(table_file(table)), table).close()  # a table of no rows
            return {"samples": 0, "errors": 0, "reward_mean": None, "processes_left": 0}
        n = n_err = 0
        total, biggest = 0.0, (0.0, {})  # the sum of the rewards; the largest in magnitude and its components
        allowed = allowed_errors(cfg.reward.max_error_fraction, len(rows))
        keys = ["run_id", "iteration", "prompt_id", "sample_index"]
        episodes = None  # an episode's stored environment and conversation, for functions that take them
        if table_file("episodes") in {f.path for f in rollouts.manifest.files}:
            episodes = arguments_by_episode(
                read_parquet(storage.fs, rollouts.read_path(table_file("episodes")), "episodes")
            )
        judging = judge_rows(writer, path, rows) if cfg.reward.judge is not None else None
        with (
            WARM_POOLS.pool(cfg.reward.workers, cfg.reward.pass_env) as pool,
            ParquetWriter(storage.fs, writer.path(table_file("rewards")), "rewards") as out,
        ):
            key, left_before = scorer_key(cfg, reward_files.holder_of(inputs)), pool.left_running
            for batch in batches_in(path, rows):
                finish = batch.column("finish_reason").to_pylist()
                lengths = pc.list_value_length(batch.column("response_ids")).to_pylist()
                items = batch_items(batch, episodes)
                if judging is None:
                    scored = score_samples(pool, key, cfg, items, finish, lengths, allowed - n_err)
                else:  # the judge's score joined before the shaping (a cut-off response loses it too)
                    scored = score_batch(pool, key, cfg.reward, items, max_errors=allowed - n_err)
                    scored = shaped(cfg, with_judge(cfg, scored, judging[0][n : n + len(scored)]), finish, lengths)
                cols = {k: batch.column(k).to_pylist() for k in keys}
                cols["reward"] = [r for r, _, _ in scored]
                cols["components"] = [list(c.items()) for _, c, _ in scored]
                cols["error"] = [e for _, _, e in scored]
                out.write(cols)
                n += len(scored)
                progress(f"rewards {iteration}" + (f" shard {shard_k}" if cfg.reward.shards > 1 else ""), n, len(rows))
                n_err += sum(e is not None for _, _, e in scored)
                total += sum(cols["reward"])
                biggest = max([biggest] + [(r, c) for r, c, _ in scored], key=lambda rc: abs(rc[0]))
            left = pool.left_running - left_before  # processes the functions left running (killed; logged)
        if n_err / n > cfg.reward.max_error_fraction:
            raise StageError(
                f"rewards: {n_err}/{n} samples failed (> reward.max_error_fraction="
                f"{cfg.reward.max_error_fraction}); see the error column of an uncommitted "
                f"attempt under {storage.uri(writer.attempt_dir)}"
            )
        if not math.isfinite(total / n):  # each reward is finite (functions.components_of); their sum is not
            source = functions.reward_source(cfg.task.name, cfg.reward.functions, biggest[1])
            raise StageError(
                f"rewards: the mean reward is {total / n} (the rewards' sum overflows float64): {source} "
                f"returned {biggest[0]:.3g}; scale its rewards down (nothing was committed)"
            )
        judge = {f"judge_{k}": v for k, v in judging[1].items()} if judging is not None else {}
        judge |= {"judged_on": judging[2]} if judging is not None and judging[2] else {}
        return {"samples": n, "errors": n_err, "reward_mean": total / n, "processes_left": left, **judge}

    def judge_rows(writer, path: str, rows: range) -> tuple[list[dict], dict, str | None]:
        """The judge over the shard's rows as one batch (grpo/scoring/judge.py), its table written: (each row's
        judgement, in order; the counts; where a local judge ran unless on transformers by default, e.g. "vllm
        (auto: a GPU)"). An answer that does not parse is counted, never the stage's failure."""
        cols = ["prompt_id", "sample_index", "prompt", "response", "ground_truth"]  # {reference}: the ground truth
        table = [r for b in batches_in(path, rows) for r in b.select(["run_id", "iteration", *cols]).to_pylist()]
        judge = local_judge or judge_engine.make_judge(cfg.reward.judge, cfg.rollout)
        judged, counts = judge_engine.judged(storage, cfg.reward.judge, table, judge)
        keep = ("judge_revision", "prompt_hash", "raw", "verdicts", "score", "error", "attempts", "cached")
        with ParquetWriter(storage.fs, writer.path(table_file("judge")), "judge") as out:
            if table:
                keys = {k: [r[k] for r in table] for k in ("run_id", "iteration", "prompt_id", "sample_index")}
                out.write(keys | {k: [j[k] for j in judged] for k in keep})
        log.info(
            "rewards %d: the judge (%s) made %d calls, %d answers from its cache; %d did not parse, %d failed every "
            "try (each scored reward.judge.parse_error_reward=%g)",
            iteration, judged[0]["judge_revision"] if judged else "-", counts["calls"], counts["cached"],
            counts["errors"], counts["failed"], cfg.reward.judge.parse_error_reward,
        )  # fmt: skip
        backend = getattr(judge, "backend", "hf"), cfg.reward.judge.backend
        return judged, counts, None if backend == ("hf", "auto") else f"{backend[0]} ({judge.why})"

    def batches_in(path: str, rows: range):
        """The rollouts' record batches of rows `rows` (at most 8192 rows each)."""
        at = 0
        for batch in iter_batches(storage.fs, path, "rollouts", batch_size=8192):
            lo, hi = max(rows.start - at, 0), min(rows.stop - at, batch.num_rows)
            if lo < hi:
                yield batch.slice(lo, hi - lo)
            at += batch.num_rows
            if at >= rows.stop:
                return

    return run_sharded(
        storage,
        run_id,
        iteration,
        "rewards",
        shards=cfg.reward.shards,
        setting="reward.shards",
        config=stage_config(cfg, local_judge.revision if local_judge is not None else None),
        inputs=inputs,
        shard_body=lambda k, writer: score(writer, k),
        merge_summary=merged_summary,
        force=force,
        shard=shard,
    )


def stage_config(cfg: RunConfig, judge_revision: str | None = None) -> dict:
    """What the stage's identity covers: the task and the reward section, less reward.shards (1 and N shards
    score the same rows) and settings added later at their defaults (grpo.record.identity); with a local judge
    (reward.judge.model), once resolved, its revision (`folder:<hash of its files>`, `<hub id>@<commit>`), so changed
    judge files make a new attempt instead of reusing one judged by the old model. An endpoint's revision is its
    settings (model_name, url), in the reward section already."""
    config = {"task": section(cfg, "task"), "reward": section(cfg, "reward")}
    return config | ({"judge_revision": judge_revision} if judge_revision is not None else {})


def merged_summary(parts: list[dict]) -> dict:
    """The rewards summary of its shards'."""
    samples = sum(s["samples"] for s in parts)
    mean = sum(s["reward_mean"] * s["samples"] for s in parts if s["samples"]) / samples  # an empty shard: no mean
    left = sum(s.get("processes_left", 0) for s in parts)
    judged = sorted({k for s in parts for k in s if k.startswith("judge_")})  # reward.judge's counts
    judge = {k: sum(s.get(k, 0) for s in parts) for k in judged}
    judge |= next(({"judged_on": s["judged_on"]} for s in parts if "judged_on" in s), {})  # where a judge ran
    return {
        "samples": samples, "errors": sum(s["errors"] for s in parts), "reward_mean": mean, "processes_left": left,
        **judge,
    }  # fmt: skip
