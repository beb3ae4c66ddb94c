"""`grpo`: create runs, run one stage or whole iterations, and inspect a run.

grpo init --run demo [--config cfg.yaml] [--set learn.lr=1e-3 ...]
grpo stage rollouts --run demo --iteration 0 [--force]
grpo stage learn --run demo --iteration 0 --node-rank 1   # node 1 of a learner on learn.nodes machines
grpo run --run demo --iterations 3          # every stage of each iteration, in order
grpo demo                                    # init + train the tiny sort model until it sorts
grpo status --run demo
grpo query --run demo "SELECT iteration, avg(reward) FROM rewards GROUP BY 1"
grpo report --run demo                       # report.png and report.md in the run folder
grpo timeline --run demo                     # each iteration's stages against time (timeline.png)
grpo export --run demo                       # the newest policy as an HF folder under the run (LoRA merged)
grpo export --run demo --best ./demo-best    # the best by eval.metric, into a folder named (or --iteration k)
grpo k8s render [--stage learn]              # each stage's Kubernetes Job from deploy/kubernetes, as YAML
grpo fork --from demo --at 3 --run demo-gspo --set learn.loss_type=gspo   # iterations 0-2 by reference
grpo rescore --run demo --iterations 0:4 --set reward.truncated_reward=-1  # rewards again, no sampling
grpo delete --run demo-gspo --yes           # a run no other run references
"""

from __future__ import annotations

import datetime as dt
import os

# before torch loads: its C++ warnings (vLLM's NUMA binding note on CPU) print straight to stderr
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import argparse  # noqa: E402
import dataclasses
import json
import logging  # noqa: E402
import sys
import time
from pathlib import Path

from flows.kubernetes import PREFECT_FILE
from grpo import threads
from grpo.config import ConfigError, load_config_file
from grpo.errors import describe
from grpo.layout import SHARDED, STAGES, export_dir, run_dir, run_ids, shard_dirs, stage_dir
from grpo.lineage import next_iteration, resume_problem, stale_attempt
from grpo.progress import show_in_terminal
from grpo.quiet import quiet_libraries
from grpo.report import best_iteration
from grpo.storage import (
    ArtifactError,
    Storage,
    committed_attempts,
    is_local,
    list_attempts,
    load_manifest,
    open_storage,
    rehashing,
    url_to_fs,
)
from schemas import SchemaError
from stages import StageError, stage_function
from stages.common import load_run
from stages.iteration import run_warm


def cmd_init(args, storage):
    from stages.init import init_run, run_config

    cfg = run_config(storage, args.run, args.config, args.set)
    init_run(storage, args.run, cfg)
    print(f"run {args.run}: {storage.uri(storage.path('runs', args.run))}")


def cmd_stage(args, storage):
    started = dt.datetime.now(dt.timezone.utc)
    iteration = next_iteration(storage, args.run) if args.iteration == "next" else args.iteration
    shard = {} if args.shard is None else {"shard": args.shard}
    if shard and args.name not in SHARDED:
        raise StageError(f"--shard: stage {args.name} has no shards; {' and '.join(SHARDED)} have")
    node = {"node_rank": args.node_rank} if args.node_rank is not None else {}
    if node and args.name != "learn":
        raise StageError(f"--node-rank: stage {args.name} runs on one machine; learn runs on learn.nodes")
    committed = stage_function(args.name)(storage, args.run, iteration, force=args.force, **shard, **node)
    where = f"{args.name} iteration {iteration}"
    if dt.datetime.fromisoformat(committed.manifest.committed_at) < started:  # found with the same identity
        print(f"{where}: already committed ({committed.uri}): nothing to do; --force for a new attempt")
        return
    print(f"{where}: committed {committed.uri}\n{summary_lines(committed.manifest.summary)}")


def summary_lines(summary: dict, indent: str = "  ") -> str:
    """A manifest summary as aligned `key: value` lines, numbers rounded to 4 significant digits.

    >>> print(summary_lines({"loss": 0.0291667617857, "steps": 2, "sampler": {"backend": "hf", "why": "x"}}))
      loss:    0.02917
      steps:   2
      sampler: backend=hf, why=x
    """

    def text(v) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, dict):
            return ", ".join(f"{k}={text(x)}" for k, x in v.items())
        return str(v)

    width = max((len(k) for k in summary), default=0) + 1
    return "\n".join(f"{indent}{k + ':':<{width}} {text(v)}" for k, v in summary.items())


def train(storage, run_id: str, start: int, iterations: int, target: float | None = None) -> int | None:
    """Run iterations start.. warm, one line each (eval exact `-` where eval.every skipped it); stop early once
    eval's exact match reaches `target`. Returns the iteration that reached it (None: not reached, or no target)."""
    t0 = time.perf_counter()
    print(f"{'iteration':>9}  {'reward':>6}  {'eval exact':>10}  {'elapsed s':>9}", flush=True)
    for k, out in run_warm(storage, run_id, start, iterations):
        exact = out["eval"].manifest.summary.get("exact_match")
        reward = out["advantages"].manifest.summary["reward_mean"]
        shown = "-" if exact is None else f"{exact:.3f}"
        print(f"{k:>9}  {reward:>6.3f}  {shown:>10}  {time.perf_counter() - t0:>9.1f}", flush=True)
        if target is not None and exact is not None and exact >= target:
            return k
    return None


def grpo_command(storage_arg: str | None) -> str:
    """How to call grpo again from here: the venv's script (relative when under the working folder)."""
    script = Path(sys.executable).with_name("grpo")
    command = "grpo"
    if script.exists():
        command = str(script.relative_to(Path.cwd())) if script.is_relative_to(Path.cwd()) else str(script)
    return command + (f" --storage {storage_arg}" if storage_arg else "")


def next_steps(storage, run_id: str, storage_arg: str | None) -> str:
    grpo = grpo_command(storage_arg)
    return (
        f"run {run_id}: {storage.uri(run_dir(storage, run_id))}\n"
        f"next: {grpo} status --run {run_id}                 # iterations x stages\n"
        f'      {grpo} query --run {run_id} "SELECT iteration, avg(reward) FROM rewards GROUP BY 1 ORDER BY 1"\n'
        f"      {grpo} report --run {run_id}                 # report.png and report.md in the run folder\n"
        f"      {grpo} run --run {run_id} --iterations 10    # 10 more\n"
        f"      {grpo} export --run {run_id}                 # the newest policy as a Hugging Face folder under the run"
    )


def newest_policy(storage, run_id: str, storage_arg: str | None) -> str:
    """Where the newest committed policy is and the command that exports it ('' before the first learn)."""
    k = newest_learn(storage, run_id)
    if k < 0:
        return ""
    attempt = committed_attempts(storage, stage_dir(storage, run_id, k, "learn"))[-1]
    into = shown_path(default_export(storage, run_id, k))
    return (
        f"newest policy: iteration {k}, {storage.uri(attempt)}\n"
        f"export it: {grpo_command(storage_arg)} export --run {run_id}   # into {into}"
    )


def newest_learn(storage, run_id: str) -> int:
    """The last iteration of the unbroken chain of committed learns from 0 (-1: none yet)."""
    k = -1
    while committed_attempts(storage, stage_dir(storage, run_id, k + 1, "learn")):
        k += 1
    return k


def cmd_run(args, storage):
    from stages.common import load_run

    load_run(storage, args.run)  # no such run: its one line, before the table's header
    start = next_iteration(storage, args.run) if args.start == "next" else args.start
    if problem := resume_problem(storage, args.run, start):  # its learn could not be rerun: before any stage
        raise StageError(problem)
    train(storage, args.run, start, args.iterations)
    if newest := newest_policy(storage, args.run, args.storage):  # none after --iterations 0 on a new run
        print(newest)


def cmd_demo(args, storage):
    from stages.init import init_run

    cfg = load_config_file(args.config, args.set)
    init_run(storage, args.run, cfg)
    if (there := first_reaching(storage, args.run, args.target)) is not None:  # a rerun of a finished demo
        k, exact = there
        print(
            f"run {args.run} reached held-out exact match {args.target} already, at iteration {k} ({exact:.3f}); "
            f"nothing to train (`grpo run --run {args.run} --iterations 10` trains on)\n"
            f"{next_steps(storage, args.run, args.storage)}"
        )
        return
    start = next_iteration(storage, args.run)
    print(
        f"training run {args.run} ({cfg.task.name} task, {cfg.model.base_model or 'a tiny model built here'}) "
        f"until held-out exact match "
        f"reaches {args.target}, at most {args.iterations} iterations; the first one also starts the sampler",
        flush=True,
    )
    reached = train(storage, args.run, start, args.iterations, target=args.target)
    done = (
        f"held-out exact match reached {args.target} at iteration {reached}"
        if reached is not None
        else (f"held-out exact match did not reach {args.target} in {args.iterations} iterations")
    )
    print(f"{done}\n{next_steps(storage, args.run, args.storage)}")


def first_reaching(storage, run_id: str, target: float) -> tuple[int, float] | None:
    """(iteration, exact match) of the first committed eval whose held-out exact match reached `target`; None if
    none did."""
    from grpo.report import iteration_rows

    rows = iteration_rows(storage, run_id)
    return next(((r["iteration"], e) for r in rows if (e := r["eval_exact_match"]) is not None and e >= target), None)


def cmd_status(args, storage):
    from grpo.fork import fork_of
    from grpo.gc import collected_summary, running_attempts
    from stages.common import check_datasets

    load_run(storage, args.run)
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
    print(f"{'iteration':>9}  " + "  ".join(f"{s:>10}" for s in STAGES))
    corrupt, shard_lines, stale_from = [], [], None
    for k in range(last + 1):
        cells, after_stale = [], stale_from is not None  # past a stale learn: made from the policy it made
        for s in STAGES:
            cell, state = stage_cell(storage, stage_dir(storage, args.run, k, s), running, args.verify, after_stale)
            cells.append(cell)
            if state == "corrupt":
                corrupt.append(f"grpo stage {s} --run {args.run} --iteration {k} --force")
            if s == "learn" and state == "stale" and stale_from is None:
                stale_from = k
        print(f"{k:>9}  " + "  ".join(f"{c:>10}" for c in cells))
        shard_lines += shard_line(storage, args.run, k, running, args.verify, after_stale, corrupt)
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


def cmd_gc(args, storage):
    from grpo.gc import held_summary, plan, remove
    from stages.common import load_run

    cfg = load_run(storage, args.run)
    found = plan(storage, args.run, min_age_s=args.older_than_s, retention=cfg.retention if args.retention else None)
    for g in found.garbage:
        files = sorted({f.split("/")[0] + ("/" if "/" in f else "") for f in g.files})
        what = storage.uri(g.path) + (f" [{', '.join(files)}]  ({g.note})" if g.files else "")
        print(f"{g.why:>10}  {g.bytes / 1e6:9.1f} MB  {what}")
    for h in found.held:
        print(f"{'left':>10}  {'':>12}  {storage.uri(h.path)}  ({h.note})")
    for line in found.kept:
        print(f"{'keep':>10}  {'':>12}  {line}")
    if found.held:
        print(f"held back: {held_summary(found.held)}")
    total = sum(g.bytes for g in found.garbage) / 1e6
    if args.delete:
        remove(storage, found.garbage)
        print(f"removed {len(found.garbage)} item(s), {total:.1f} MB")
    else:
        print(f"{len(found.garbage)} item(s), {total:.1f} MB; nothing removed (dry run): add --delete to remove them")


def cmd_fork(args, storage):
    from grpo.fork import fork_run

    forked = fork_run(storage, args.parent, args.at, args.run, args.set)
    print(
        f"run {args.run}: a fork of run {args.parent} at iteration {args.at}: {forked.attempts} committed attempts "
        f"of {args.parent} taken by reference ({forked.bytes_referenced / 1e6:.1f} MB, none copied)\n"
        f"next: {grpo_command(args.storage)} run --run {args.run} --iterations N   # iterations {args.at}.., "
        f"each stage with {args.parent}'s config and inputs taken by reference, the others run"
    )


def _iterations_range(text: str) -> tuple[int, int]:
    """'A:B' (both included) or 'K'."""
    parts = text.split(":")
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give A:B (iterations A to B, both included) or K")
    return int(parts[0]), int(parts[-1])


def cmd_rescore(args, storage):
    from grpo.lineage import next_iteration
    from stages.common import load_run
    from stages.rescore import changes, rescore, rescore_run_id

    load_run(storage, args.run)
    first, last = args.iterations if args.iterations else (0, next_iteration(storage, args.run) - 1)
    fork = args.as_run or rescore_run_id(args.run, first, last, args.set)
    rescore(storage, args.run, first, last, args.set, fork)
    table = changes(storage, fork, first, last)
    print(f"{'iteration':>9}  {'samples changed':>15}  {'reward before':>13}  {'after':>7}  {'groups flipped':>14}")
    for row in table.itertuples():
        print(
            f"{row.iteration:>9}  {row.samples_changed:>7} of {row.samples:<5}  {row.reward_before:>13.4f}  "
            f"{row.reward_after:>7.4f}  {row.groups_flipped:>14}"
        )
    for row in table.itertuples():
        changed, flipped = list(row.changed if row.changed is not None else []), row.flipped
        if changed:
            more = f" ... and {len(changed) - 5} more" if len(changed) > 5 else ""
            print(f"iteration {row.iteration}: reward changed (prompt/sample: before -> after): "
                  f"{', '.join(changed[:5])}{more}")  # fmt: skip
        if flipped is not None and len(flipped):
            groups = ", ".join(map(str, flipped[:20])) + (
                f" ... and {len(flipped) - 20} more" if len(flipped) > 20 else ""
            )
            print(f"iteration {row.iteration}: advantage sign flipped in groups (prompt_id) {groups}")
    print(
        f"rescored into run {fork} (a fork of {args.run}; no rollouts written); per sample: "
        f'{grpo_command(args.storage)} query --run {fork} "SELECT * FROM rescore WHERE reward_changed"'
    )


def cmd_delete(args, storage):
    from grpo.gc import delete_run, run_files

    files, size = run_files(storage, args.run)
    if not args.yes:
        print(f"run {args.run}: {files} files, {size / 1e6:.1f} MB; nothing removed (dry run): add --yes to delete it")
        return
    delete_run(storage, args.run)
    print(f"run {args.run}: deleted ({files} files, {size / 1e6:.1f} MB); `grpo gc` of its parent may now free more")


def cmd_export(args, storage):
    from grpo.checkpoint import export_policy
    from grpo.lineage import committed_input
    from stages.common import load_run

    load_run(storage, args.run)
    if args.dir is not None and args.out is not None:
        raise StageError("export: name the folder to write once: `grpo export --run R DIR` or `--out DIR`")
    which = ""
    k = newest_learn(storage, args.run) if args.iteration is None else args.iteration
    if args.best:
        best = best_iteration(storage, args.run)
        if best is None:
            raise StageError(f"run {args.run}: no eval has run yet, so none is best; export --latest or --iteration K")
        if best.all_zero:
            raise StageError(
                f"run {args.run}: every eval so far scored {best.metric} 0, so none is best; "
                "export --latest or --iteration K"
            )
        k, which = best.iteration, f" (the best: {best.metric} {best.value:.4g})"
    base = committed_input(storage, args.run, None, "base")
    policy = base if k < 0 else export_source(storage, args.run, k)
    out = args.dir or args.out or default_export(storage, args.run, None if k < 0 else k)
    what = f"{'the base model' if k < 0 else f'the policy of iteration {k}'} of run {args.run}{which}"
    source = {"run_id": args.run, "iteration": None if k < 0 else k, **dataclasses.asdict(policy.ref())}
    fs, root = url_to_fs(out)
    try:
        export_policy(policy, base, out)
    except FileExistsError as e:
        if args.dir is None and args.out is None and _exported_from(fs, root) == source:
            print(f"{what}: exported already, {shown_path(out)}")
            return
        raise StageError(str(e)) from e
    fs.pipe_file(f"{root}/{EXPORT_SOURCE}", json.dumps(source, indent=1).encode())  # last: the export is whole
    print(f"{what}: {shown_path(out)}")


EXPORT_SOURCE = "grpo_export.json"
"""Written into an exported folder last: the run, iteration and committed attempt it holds (so a second export to
the default folder knows it is there already)."""


def default_export(storage: Storage, run_id: str, k: int | None) -> str:
    """Where `grpo export` writes without a folder named (layout.export_dir): a local path, or a URL."""
    path = export_dir(storage, run_id, k)
    return path if is_local(storage.fs) else storage.uri(path)


def _exported_from(fs, root: str) -> dict | None:
    """What an exported folder's EXPORT_SOURCE says it holds (None: none, or not readable)."""
    try:
        return json.loads(fs.cat_file(f"{root}/{EXPORT_SOURCE}"))
    except (OSError, ValueError):
        return None


def shown_path(out: str) -> str:
    """A local folder relative to the working folder where under it (to paste into from_pretrained), else as is."""
    path = Path(out)
    return str(path.relative_to(Path.cwd())) if path.is_absolute() and path.is_relative_to(Path.cwd()) else out


def export_source(storage, run_id: str, k: int):
    """Iteration k's committed learn, verified; one line when it has none, its files changed after the commit
    (committed_input says so) or `grpo gc --retention` collected its policy."""
    from grpo.checkpoint import ADAPTER_PREFIX, CHECKPOINT_PREFIX
    from grpo.lineage import committed_input

    if not committed_attempts(storage, stage_dir(storage, run_id, k, "learn")):
        n = newest_learn(storage, run_id)
        newest = f"the newest committed is iteration {n}" if n >= 0 else "none is committed yet"
        raise StageError(f"run {run_id}: iteration {k} has no committed learn (its policy is not committed; {newest})")
    policy = committed_input(storage, run_id, k, "learn")
    if any(p.startswith((CHECKPOINT_PREFIX, ADAPTER_PREFIX)) for p in policy.collected):
        raise StageError(f"run {run_id}: the policy of iteration {k} was collected by `grpo gc --retention`")
    return policy


def cmd_report(args, storage):
    from grpo.report import write_compare, write_report

    png, md = write_compare(storage, args.run, args.compare) if args.compare else write_report(storage, args.run)
    print(f"{png}\n{md}")


def cmd_timeline(args, storage):
    from grpo.report import write_timeline

    png, rows = write_timeline(storage, args.run)
    print(f"{'iteration':>9}  {'stage':>10}  {'start s':>8}  {'end s':>8}  {'seconds':>8}")
    for r in rows:
        seconds = r["end"] - r["start"]
        print(f"{r['iteration']:>9}  {r['stage']:>10}  {r['start']:>8.1f}  {r['end']:>8.1f}  {seconds:>8.1f}")
    print(png)


def cmd_k8s_render(args, storage):
    from flows import kubernetes as k8s

    if args.deployment:
        found = k8s.deployments(args.prefect_file)
        if args.deployment not in found:
            raise StageError(f"--deployment {args.deployment}: {args.prefect_file} has {', '.join(sorted(found))}")
        d = found[args.deployment]
        job = k8s.render_job(d, k8s.job_template(args.prefect_file), {"run_id": args.run}, args.run)
        what = f"deployment {args.deployment}: a flow run on pool {d['work_pool']['name']}"
        print(k8s.as_yaml([(what, job)]), end="")
        return
    jobs = k8s.stage_jobs(args.stage or STAGES, args.run, args.iteration, args.prefect_file)
    shown = [(f"stage {s}: a flow run of deployment {name}", job) for s, (name, job) in jobs.items()]
    print(k8s.as_yaml(shown), end="")


def cmd_query(args, storage):
    import duckdb

    from grpo.query import query

    try:
        df = query(storage, args.run[0], args.sql, verify=not args.no_verify, others=tuple(args.run[1:]))
    except duckdb.Error as e:
        raise StageError(f"query failed: {e}") from e
    print(df.to_string(index=False) if len(df) else f"(no rows; columns: {', '.join(df.columns)})")


def _iteration(text: str) -> int | str:
    """An iteration argument: 'next' or an integer >= 0."""
    if text == "next":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not an iteration: give an integer >= 0 or 'next'")
    return int(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--storage", help="storage URL (default $GRPO_STORAGE or ./storage)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument(
        "--threads",
        help="torch's CPU threads in this process and the grpo processes it starts: N, or cores/K for K processes "
        "sharing the machine (default $GRPO_THREADS, else torch's: one per core)",
    )
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp):
        sp.add_argument("--config", help="YAML file of config sections (see grpo/config.py)")
        sp.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")

    sp = sub.add_parser("init", help="create a run: config and base model")
    sp.add_argument("--run", required=True)
    with_config(sp)
    sp.set_defaults(fn=cmd_init)
    sp = sub.add_parser("stage", help="run one stage of one iteration")
    sp.add_argument("name", choices=STAGES)
    sp.add_argument("--run", required=True)
    sp.add_argument("--iteration", required=True, type=_iteration, help="an integer >= 0, or 'next'")
    sp.add_argument("--force", action="store_true", help="write a new attempt even if one is committed")
    sp.add_argument(
        "--shard",
        type=int,
        help="rollouts, rewards: only this shard (0-based) of rollout.shards or reward.shards; without it "
        "every shard not committed yet, then the stage",
    )
    sp.add_argument(
        "--node-rank",
        type=int,
        help="learn with learn.nodes > 1: run node r (1..nodes-1) of the learner on this machine; it joins node 0, "
        "the learn stage run without --node-rank, through storage and returns once node 0 committed",
    )
    sp.set_defaults(fn=cmd_stage)
    sp = sub.add_parser("run", help="run whole iterations")
    sp.add_argument("--run", required=True)
    sp.add_argument("--iterations", type=int, default=1)
    sp.add_argument("--start", default="next", type=_iteration, help="first iteration (default: next unfinished)")
    sp.set_defaults(fn=cmd_run)
    sp = sub.add_parser("demo", help="init (if needed) and train the tiny sort model until it sorts")
    sp.add_argument("--run", default="demo")
    sp.add_argument("--iterations", type=int, default=40, help="at most this many (default 40)")
    sp.add_argument("--target", type=float, default=0.9, help="stop at this held-out exact match (default 0.9)")
    with_config(sp)
    sp.set_defaults(fn=cmd_demo)
    sp = sub.add_parser("status", help="iterations x stages of a run")
    sp.add_argument("--run", required=True)
    sp.add_argument("--verify", action="store_true", help="re-hash the newest attempts: 'corrupt' if they changed")
    sp.set_defaults(fn=cmd_status)
    sp = sub.add_parser("gc", help="list (or --delete) failed and superseded attempts and temporary files")
    sp.add_argument("--run", required=True)
    sp.add_argument("--delete", action="store_true", help="remove them (default: only list)")
    sp.add_argument(
        "--older-than-s",
        type=float,
        default=3600.0,
        help="leave anything written, superseded or heartbeating more recently (a stage may be running): default 3600",
    )
    sp.add_argument(
        "--retention",
        action="store_true",
        help="also the weights and optimizer state of older learns that the run's retention settings "
        "(retention.keep_last, retention.keep_every; the best eval is kept) do not keep; never tables",
    )
    sp.set_defaults(fn=cmd_gc)
    sp = sub.add_parser("fork", help="a new run from another's committed iterations, by reference, with new settings")
    sp.add_argument("--from", dest="parent", required=True, help="the run to fork")
    sp.add_argument(
        "--at", type=int, required=True, help="the first iteration of the fork's own (before it: the parent's)"
    )
    sp.add_argument("--run", required=True, help="the new run's id")
    sp.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    sp.set_defaults(fn=cmd_fork)
    sp = sub.add_parser("rescore", help="score a run's committed rollouts again with another reward, in a fork")
    sp.add_argument("--run", required=True)
    sp.add_argument(
        "--iterations", type=_iterations_range, help="A:B, both included, or K (default: every finished iteration)"
    )
    sp.add_argument("--set", action="append", default=[], metavar="reward.FIELD=VALUE")
    sp.add_argument("--as", dest="as_run", help="the fork's run id (default RUN-rescore-A-B-<hash of --set>)")
    sp.set_defaults(fn=cmd_rescore)
    sp = sub.add_parser("delete", help="remove a run that no other run (a fork) references")
    sp.add_argument("--run", required=True)
    sp.add_argument("--yes", action="store_true", help="delete it (default: only say what it holds)")
    sp.set_defaults(fn=cmd_delete)
    sp = sub.add_parser("export", help="write a policy as a self-contained HF folder (LoRA adapters merged)")
    sp.add_argument("--run", required=True)
    sp.add_argument(
        "dir",
        nargs="?",
        help="a new local folder or fsspec URL (or --out DIR); default: exports/iter-000k in the run's folder",
    )
    sp.add_argument("--out", help="the same as DIR")
    which = sp.add_mutually_exclusive_group()
    which.add_argument("--iteration", type=int, help="the policy the learn of this iteration committed")
    which.add_argument("--best", action="store_true", help="the best iteration's policy by eval.metric")
    which.add_argument("--latest", action="store_true", help="the newest committed policy (the default)")
    sp.set_defaults(fn=cmd_export)
    sp = sub.add_parser("report", help="plot a run's progress: report.png and report.md in its folder")
    sp.add_argument("--run", required=True)
    sp.add_argument(
        "--compare",
        nargs="+",
        metavar="RUN",
        help="overlay these runs' curves on the run's (a parent and its forks): compare.png and compare.md",
    )
    sp.set_defaults(fn=cmd_report)
    sp = sub.add_parser(
        "timeline", help="each iteration's stages against time (timeline.png): where sampling and learning overlap"
    )
    sp.add_argument("--run", required=True)
    sp.set_defaults(fn=cmd_timeline)
    sp = sub.add_parser("k8s", help="Kubernetes: see the Jobs the deploy/kubernetes work pools create")
    k8s = sp.add_subparsers(dest="k8s_command", required=True)
    sp = k8s.add_parser(
        "render",
        help="print each stage's Kubernetes Job as YAML (offline: no cluster, no Prefect server)",
        description="The Job a kubernetes worker creates for a flow run of deploy/kubernetes' deployments, rendered "
        "by prefect-kubernetes' own code; by default each stage's, as grpo/k8s-placed places it. Placeholder flow "
        "run ids: to read and diff, not to apply.",
    )
    sp.add_argument("--stage", action="append", choices=STAGES, help="only this stage (repeatable; default: all six)")
    sp.add_argument("--deployment", help="instead, a deployment's flow run: grpo/k8s-gpu, grpo/k8s-placed, ...")
    sp.add_argument("--run", default="k1", help="the run id the flow run is named after (default k1)")
    sp.add_argument("--iteration", type=int, default=0, help="the iteration it is named after (default 0)")
    sp.add_argument("--prefect-file", default=str(PREFECT_FILE), help="the deployments (default: this checkout's)")
    sp.set_defaults(fn=cmd_k8s_render)
    sp = sub.add_parser(
        "query",
        help="DuckDB SQL over the committed tables of a run",
        description="views: rollouts, rewards, advantages, logprobs, learn_metrics, eval "
        "(newest committed attempt of each iteration; see grpo/query.py), and io (bytes and seconds each "
        "committed stage moved through storage, from its manifest)",
    )
    sp.add_argument(
        "--run",
        required=True,
        action="append",
        help="the run; again for more runs: their views as <run>.<view>, all of them as runs.<view> (a run column)",
    )
    sp.add_argument("sql", help='e.g. "SELECT iteration, avg(reward) FROM rewards GROUP BY 1 ORDER BY 1"')
    sp.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the files read")
    sp.set_defaults(fn=cmd_query)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(message)s")
    for handler in logging.getLogger().handlers:  # the stages log at INFO; shown with -v
        handler.setLevel(level)
    quiet_libraries(args.verbose)
    logging.getLogger("grpo").setLevel(logging.INFO)
    if not args.verbose:  # -v prints the progress records as log lines
        show_in_terminal()
    try:
        if args.threads:
            os.environ[threads.ENV] = args.threads
        threads.apply_threads()
        args.fn(args, open_storage(args.storage))
    except BrokenPipeError:  # `grpo query ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0
    except (ConfigError, StageError, ArtifactError, SchemaError) as e:
        print(f"grpo: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # storage, network, OS, parsing: one line; -v or GRPO_DEBUG=1 shows the traceback
        if args.verbose or os.environ.get("GRPO_DEBUG"):
            raise
        print(
            f"grpo: error: {describe(e, args.storage or os.environ.get('GRPO_STORAGE', ''))} (-v for the traceback)",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
