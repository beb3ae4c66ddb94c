"""`grpo status | query | report | timeline`: read a run: its iterations x stages, SQL over its tables, its plots."""

from __future__ import annotations

from flows.commands.hints import grpo_command, newest_policy
from grpo.record.digests import rehashing
from grpo.record.layout import STATE_STAGE, run_ids, shard_dirs, stage_dir, stages_of
from grpo.record.lineage import next_iteration, stale_attempt
from grpo.record.storage import ArtifactError, Storage, committed_attempts, list_attempts, load_manifest
from grpo.report import best_iteration
from stages import StageError
from stages.common import load_run


def cmd_status(args, storage):
    from grpo.gc import collected_summary
    from grpo.record.fork import fork_of
    from grpo.record.liveness import running_attempts
    from stages.common import check_datasets

    cfg = load_run(storage, args.run)
    names = stages_of(cfg)  # a teacher's stage where the run has one
    last = next_iteration(storage, args.run)
    while list_attempts(storage, stage_dir(storage, args.run, last + 1, "snapshot")):  # tried after a stale one
        last += 1
    running = running_attempts(storage, args.run)
    if fork := fork_of(storage, args.run):
        print(
            f"run {args.run}: a fork of run {fork['parent']} at iteration {fork['at']} (its base and iterations "
            f"before {fork['at']} are {fork['parent']}'s by reference)"
        )
    forks = [f"{r} (at {f['at']})" for r in run_ids(storage) if (f := fork_of(storage, r)) and f["parent"] == args.run]
    if forks:
        print(f"forked by: {', '.join(forks)}")
    corrupt, shard_lines, stale_from = [], [], None
    for line in sft_line(storage, args.run, cfg, running, args.verify, corrupt):
        print(line)
    print(f"{'iteration':>9}  " + "  ".join(f"{s:>10}" for s in names))
    for k in range(last + 1):
        cells, after_stale = [], stale_from is not None  # past a stale learn: made from the policy it made
        for s in names:
            cell, state = stage_cell(storage, stage_dir(storage, args.run, k, s), running, args.verify, after_stale)
            cells.append(cell)
            if state == "corrupt":
                corrupt.append(f"grpo stage {s} --run {args.run} --iteration {k} --force")
            if s == "learn" and state == "stale" and stale_from is None:
                stale_from = k
        print(f"{k:>9}  " + "  ".join(f"{c:>10}" for c in cells))
        shard_lines += shard_line(storage, args.run, k, running, args.verify, after_stale, corrupt)
        shard_lines += state_line(storage, args.run, k, args.verify, corrupt)
    for line in shard_lines:
        print(line)
    print(
        "(xN: committed attempts; +Nr: attempts running now (a recent heartbeat); +Nf: attempts that failed or "
        "stopped beating; stale: made from inputs a newer attempt replaced, or after a stale learn; corrupt, with "
        "--verify: files changed after the commit; skipped: an eval eval.every did not run; shards: each shard's "
        "attempts, k of rollout.shards or reward.shards; ref: another run's attempt taken by reference, `grpo fork`)"
    )
    if (best := best_iteration(storage, args.run)) and not best.all_zero:  # all 0: none is better than another
        print(f"best so far: {best}; export it: {grpo_command(args.storage)} export --run {args.run} --best")
    if collected := collected_summary(storage, args.run):  # removed on purpose: not corrupt
        print(collected)
    if newest := newest_policy(storage, args.run, args.storage):
        print(newest)
    check_datasets(storage, args.run)  # a dataset changed since init: the next stage would refuse it
    if corrupt:
        raise ArtifactError(
            f"{len(corrupt)} committed attempt(s) corrupt; make new ones with `{corrupt[0]}`"
            + (f" and {len(corrupt) - 1} more" if len(corrupt) > 1 else "")
        )


def shard_line(storage, run_id: str, k: int, running: set[str], verify: bool, after_stale: bool, corrupt: list):
    """[`grpo status`'s line of iteration k's shards (`iteration 3 shards: rewards 0 ok x1, 1 failed x1`)], or []
    without shards; the command remaking each corrupt shard is added to `corrupt`."""
    stages = []
    for s, dirs in shard_dirs(storage, run_id, k).items():
        shards = [stage_cell(storage, d, running, verify, after_stale) for d in dirs]
        stages.append(f"{s} " + ", ".join(f"{j} {cell}" for j, (cell, _) in enumerate(shards)))
        corrupt += [
            f"grpo stage {s} --run {run_id} --iteration {k} --shard {j} --force"
            for j, (_, state) in enumerate(shards)
            if state == "corrupt"
        ]
    return [f"iteration {k} shards: {'; '.join(stages)}"] if stages else []


def sft_line(storage, run_id: str, cfg, running: set[str], verify: bool, corrupt: list) -> list[str]:
    """[`grpo status`'s line of the run's warm start (`grpo sft`): its attempts, and once committed its steps, last
    loss and the gate's figure], or [] for a run whose config sets no sft and that has none; the command remaking a
    corrupt one is added to `corrupt`."""
    from grpo.record.storage import latest_committed

    d = stage_dir(storage, run_id, None, "sft")
    if cfg.sft is None and not list_attempts(storage, d):
        return []
    cell, state = stage_cell(storage, d, running, verify, False)
    if state == "corrupt":
        corrupt.append(f"grpo sft --run {run_id} --force")
    if not state:  # none committed: iteration 0 cannot sample until one is
        return [f"warm start (sft): {cell}; iteration 0 samples it: `grpo sft --run {run_id}` (or `grpo run`) makes it"]
    summary = latest_committed(storage, d, verify=False).manifest.summary
    parts = [f"{summary.get('steps')} steps on {summary.get('conversations')} conversations ({summary.get('source')})"]
    if isinstance(summary.get("loss"), (int, float)):
        parts.append(f"last loss {summary['loss']:.4g}")
    gate, k = summary.get("gate_pass_at_k"), cfg.sft.gate_k if cfg.sft is not None else None
    figure = summary.get(f"pass@{k}")
    if gate is not None and isinstance(figure, (int, float)):
        parts.append(f"held-out pass@{k} {figure:.4g} {'>=' if figure >= gate else '<'} gate {gate:g}")
        parts[-1] += "" if figure >= gate else " (GRPO does not start)"
    return [f"warm start (sft): {cell}, " + ", ".join(parts)]


def state_line(storage, run_id: str, k: int, verify: bool, corrupt: list) -> list[str]:
    """With `verify`: [the line of iteration k's resume state (grpo/record/resume.py) when its newest committed
    attempt's files changed (`iteration 3 state: corrupt`)], its remaking command added to `corrupt`; else []."""
    done = committed_attempts(storage, stage_dir(storage, run_id, k, STATE_STAGE)) if verify else []
    if not done or not _corrupt(storage, done[-1]):
        return []
    corrupt.append(f"grpo stage {STATE_STAGE} --run {run_id} --iteration {k} --force")
    return [f"iteration {k} {STATE_STAGE}: corrupt (learn {k}'s optimizer state; the learn after it reads it)"]


def stage_cell(storage, d: str, running: set[str], verify: bool, after_stale: bool) -> tuple[str, str]:
    """(`grpo status`'s cell of the stage folder `d`, the state of its newest committed attempt: ok, stale, corrupt
    (with `verify`), skipped, ref (a fork's attempt taken by reference), or '' when none committed).
    `after_stale`: the folder is of an iteration after one whose learn is stale, so whatever it committed
    descends from that learn and is stale too."""
    tried, done = list_attempts(storage, d), committed_attempts(storage, d)
    live = sum(f"{d}/{a}" in running for a in tried)
    if live and not done:
        return "running" + (f" +{len(tried) - live}f" if len(tried) > live else ""), ""
    if not done:
        return ("missing" if not tried else f"failed x{len(tried)}"), ""
    failed = "".join(f" +{n}{x}" for n, x in ((live, "r"), (len(tried) - len(done) - live, "f")) if n)
    state = (
        "corrupt"
        if verify and _corrupt(storage, done[-1])
        else "stale"
        if after_stale or stale_attempt(storage, done[-1])
        else "skipped"
        if d.endswith("/eval") and load_manifest(storage, done[-1], verify=False)[0].summary.get("skipped")
        else "ref"
        if load_manifest(storage, done[-1], verify=False)[0].origin is not None
        else "ok"
    )
    return f"{state} x{len(done)}{failed}", state


def _corrupt(storage: Storage, attempt_dir: str) -> bool:
    """Whether a committed attempt's files no longer match its manifest (size or sha256), every file hashed."""
    try:
        with rehashing():
            load_manifest(storage, attempt_dir, verify=True)
    except ArtifactError:
        return True
    return False


def cmd_report(args, storage):
    from grpo.report import write_compare, write_report

    png, md = write_compare(storage, args.run, args.compare) if args.compare else write_report(storage, args.run)
    print(f"{png}\n{md}")


def cmd_timeline(args, storage):
    from grpo.report import segment_rows, write_timeline

    png, rows = write_timeline(storage, args.run)
    placed = any("sent" in r for r in rows)
    print(f"{'iteration':>9}  {'stage':>10}  {'start s':>8}  {'end s':>8}  {'seconds':>8}" + "  start-up s" * placed)
    for r in rows:
        seconds, waited = r["end"] - r["start"], f"{r['start'] - r['sent']:>11.1f}" if "sent" in r else f"{'-':>11}"
        line = f"{r['iteration']:>9}  {r['stage']:>10}  {r['start']:>8.1f}  {r['end']:>8.1f}  {seconds:>8.1f}"
        print(line + ("  " + waited) * placed)
    if placed:
        print("(start-up s: a placed stage, from the flow sending it off to its start: a worker and its process)")
    print_segments(segment_rows(storage, args.run))
    print(png)


def print_segments(rows: list[dict]) -> None:
    """rollout.segment_tokens: per iteration the responses carried on, finished, waiting, the groups released, and
    their ages (iterations since their group started: {age: count}); nothing for a run without segments."""
    if not rows:
        return
    head = f"{'iteration':>9}  {'carried':>7}  {'finished':>8}  {'waiting':>7}  {'released':>8}"
    print(f"\n{head}  ages carried / released")
    for r in rows:
        ages = f"{_ages(r['carried_ages'])} / {_ages(r['released_ages'])}"
        print(f"{r['iteration']:>9}  {r['responses_carried']:>7}  {r['responses_finished']:>8}  "
              f"{r['responses_waiting']:>7}  {r['groups_released']:>8}  {ages}")  # fmt: skip
    print("(carried: unfinished, continued next iteration; waiting: ended, its group not complete or not taken yet; "
          "released: groups on to rewards and learn)")  # fmt: skip


def _ages(counts: dict) -> str:
    """{"0": 26, "1": 3} -> 0:26 1:3; "-" for none."""
    return " ".join(f"{a}:{n}" for a, n in counts.items()) or "-"


def cmd_query(args, storage):
    import duckdb

    from grpo.query import connect

    try:
        con = connect(storage, args.run[0], verify=not args.no_verify, others=tuple(args.run[1:]))
        try:
            result = con.execute(args.sql)
            names, rows = [d[0] for d in result.description], result.fetchall()
        finally:
            con.close()
    except duckdb.Error as e:
        raise StageError(f"query failed: {e}") from e
    print(table_text(names, rows) if rows else f"(no rows; columns: {', '.join(names)})")


def table_text(names: list[str], rows: list[tuple]) -> str:
    """Rows under their column names, right-aligned; floats to 6 significant digits, NULL for a null (no pandas:
    `grpo query` answers at once).

    >>> print(table_text(["iteration", "reward"], [(0, 0.0601234567), (1, None)]))
    iteration     reward
            0  0.0601235
            1       NULL
    """

    def cell(v) -> str:
        return "NULL" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v)

    cells = [names] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(names))]
    return "\n".join("  ".join(f"{c:>{w}}" for c, w in zip(r, widths)) for r in cells)
