"""Sharded stages (rollout.shards, reward.shards): a stage's work split into N contiguous ranges, each
committed on its own as stage `<stage>-shard-<k>-of-<N>` (grpo.record.layout.shard_stage), then the stage
commits the shards' rows merged, in shard order.

Each shard goes through `run_stage` like any stage: its identity is the stage's config plus its range,
and the stage's inputs, so a rerun reuses the shards that committed and runs only the missing or failed
ones; `force` makes new attempts of all of them. The merged attempt lists every shard among its inputs,
so lineage checks follow a forced shard to the stages after it. The number of shards is not part of a
stage's config: 1 and N shards write the same rows (each stage says why), and the merged table is what
every reader (the next stages, `grpo query`) reads as before.

Where shards run is the caller's choice: `grpo stage <stage>` runs them one after the other in its
process; the flow `grpo` runs each as its own task run, on the stage's work pool or stage workers when
the stage is placed (flows/grpo.py), then merges here.
"""

from __future__ import annotations

from typing import Callable

from grpo.record.commit import StageWriter
from grpo.record.layout import shard_stage
from grpo.record.storage import Committed, Storage
from schemas import ParquetWriter, iter_row_groups, table_file
from schemas.tables import TABLE_FILES
from stages.common import StageError, run_stage


def ranges(total: int, n: int, unit: int = 1) -> list[range]:
    """`n` contiguous ranges covering range(total), near-equal in whole `unit`s (the last unit may be short).

    >>> ranges(10, 3), ranges(1024, 2, unit=512), ranges(5, 2, unit=2)
    ([range(0, 3), range(3, 6), range(6, 10)], [range(0, 512), range(512, 1024)], [range(0, 2), range(2, 5)])
    """
    units = -(-total // unit)
    bounds = [min(total, (units * i // n) * unit) for i in range(n + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(n)]


def run_sharded(
    storage: Storage,
    run_id: str,
    iteration: int,
    stage: str,
    *,
    shards: int,
    setting: str,
    config: dict,
    inputs: dict[str, Committed],
    shard_body: Callable[[int, StageWriter], dict],
    merge_summary: Callable[[list[dict]], dict],
    force: bool = False,
    shard: int | None = None,
) -> Committed:
    """Shard `shard` alone (its committed attempt), or, with shard None, every shard (reusing those committed)
    and then the stage: their tables merged (the stage's, and those it writes beside it: the rollouts' turns and
    episodes). `shard_body(k, writer)` writes shard k's table and
    returns its summary; `merge_summary` makes the stage's summary of the shards'. `setting` names the
    shards' setting for errors (rollout.shards)."""
    if shards == 1 and not shard:  # the stage as it always ran: no shard folders
        body = lambda writer: shard_body(0, writer)  # noqa: E731
        return run_stage(storage, run_id, iteration, stage, config=config, inputs=inputs, body=body, force=force)
    if shard is not None and not 0 <= shard < shards:
        raise StageError(f"{stage}: there is no shard {shard}: {setting}={shards} makes shards 0..{shards - 1}")

    def one(k: int) -> Committed:
        return run_stage(
            storage,
            run_id,
            iteration,
            shard_stage(stage, k, shards),
            config={**config, "shard": [k, shards]},
            inputs=inputs,
            body=lambda writer: shard_body(k, writer),
            force=force,
        )

    if shard is not None:
        return one(shard)
    done = [one(k) for k in range(shards)]

    def merge(writer: StageWriter) -> dict:
        files = {f.path for f in done[0].manifest.files}
        for table in [t for t, (s, name) in TABLE_FILES.items() if s == stage and name in files]:  # rollouts: turns
            with ParquetWriter(storage.fs, writer.path(table_file(table)), table) as out:
                for part in done:  # row group by row group: memory stays bounded however big the stage
                    for group in iter_row_groups(storage.fs, part.read_path(table_file(table)), table):
                        out.write(group)
        return {**merge_summary([part.manifest.summary for part in done]), "shards": shards}

    parts = {f"shard-{k}": part for k, part in enumerate(done)}
    return run_stage(storage, run_id, iteration, stage, config=config, inputs={**inputs, **parts}, body=merge)
