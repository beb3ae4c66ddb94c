"""`grpo fork | rescore`: a new run from another's committed iterations, taken by reference, with new settings or
its rollouts scored again with another reward."""

from __future__ import annotations

from flows.commands.hints import grpo_command


def cmd_fork(args, storage):
    from grpo.record.fork import fork_config, fork_run
    from stages.teacher import check_fork_teacher

    check_fork_teacher(storage, args.parent, *fork_config(storage, args.parent, args.set))  # another teacher's tokens
    forked = fork_run(storage, args.parent, args.at, args.run, args.set)
    print(
        f"run {args.run}: a fork of run {args.parent} at iteration {args.at}: {forked.attempts} committed attempts "
        f"of {args.parent} taken by reference ({forked.bytes_referenced / 1e6:.1f} MB, none copied)\n"
        f"next: {grpo_command(args.storage)} run --run {args.run} --iterations N   # iterations {args.at}.., "
        f"each stage with {args.parent}'s config and inputs taken by reference, the others run"
    )


def listed(cell) -> list:
    """A list cell of a DuckDB result as a list: NULL (None or pandas' NA, as the FILTER of no row gives) is [].

    >>> import pandas as pd
    >>> listed(pd.NA), listed(None), listed(["1/0: 0 -> 1"])
    ([], [], ['1/0: 0 -> 1'])
    """
    import pandas as pd

    return list(cell) if cell is not None and cell is not pd.NA else []


def cmd_rescore(args, storage):
    from grpo.record.lineage import next_iteration
    from stages.common import load_run
    from stages.rescore import changes, new_files, rescore, rescore_run_id

    load_run(storage, args.run)
    first, last = args.iterations if args.iterations else (0, next_iteration(storage, args.run) - 1)
    fork = args.as_run or rescore_run_id(args.run, first, last, args.set, new_files(storage, args.run, args.set))
    rescore(storage, args.run, first, last, args.set, fork)
    table = changes(storage, fork, first, last)
    print(f"{'iteration':>9}  {'samples changed':>15}  {'reward before':>13}  {'after':>7}  {'groups flipped':>14}")
    for row in table.itertuples():
        print(
            f"{row.iteration:>9}  {row.samples_changed:>7} of {row.samples:<5}  {row.reward_before:>13.4f}  "
            f"{row.reward_after:>7.4f}  {row.groups_flipped:>14}"
        )
    for row in table.itertuples():
        changed, flipped = listed(row.changed), listed(row.flipped)
        if changed:
            more = f" ... and {len(changed) - 5} more" if len(changed) > 5 else ""
            print(f"iteration {row.iteration}: reward changed (prompt/sample: before -> after): "
                  f"{', '.join(changed[:5])}{more}")  # fmt: skip
        if flipped:
            groups = ", ".join(map(str, flipped[:20])) + (
                f" ... and {len(flipped) - 20} more" if len(flipped) > 20 else ""
            )
            print(f"iteration {row.iteration}: advantage sign flipped in groups (prompt_id) {groups}")
    for what, column in (("sample's reward changed", "changed"), ("group's advantage flipped sign", "flipped")):
        if not any(listed(v) for v in table[column]):
            print(f"no {what} in iterations {first}..{last}")
    print(
        f"rescored into run {fork} (a fork of {args.run}; no rollouts written); per sample: "
        f'{grpo_command(args.storage)} query --run {fork} "SELECT * FROM rescore WHERE reward_changed"'
    )
