"""`grpo init | stage | run | demo`: make a run, then run one stage or whole iterations of it."""

from __future__ import annotations

import datetime as dt
import time

from flows.commands.hints import newest_policy, next_steps
from grpo.config import deciding_settings, load_config_file
from grpo.record.layout import SHARDED
from grpo.record.lineage import next_iteration, resume_problem
from stages import StageError, stage_function
from stages.iteration import run_warm


def cmd_init(args, storage):
    from stages.init import init_run, run_config

    cfg = run_config(storage, args.run, args.config, args.set)
    init_run(storage, args.run, cfg)
    print(f"run {args.run}: {storage.uri(storage.path('runs', args.run))}\nsettings: {deciding_settings(cfg)}")


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
    if iterations > 0:  # the warm start the config sets (sft), made where none is committed, and its gate: first
        from stages.sft import warm_start

        warm_start(storage, run_id)
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


def cmd_run(args, storage):
    from stages.common import load_run

    load_run(storage, args.run)  # no such run: its one line, before the table's header
    start = next_iteration(storage, args.run) if args.start == "next" else args.start
    if problem := resume_problem(storage, args.run, start):  # its learn could not be rerun: before any stage
        raise StageError(problem)
    train(storage, args.run, start, args.iterations)
    if newest := newest_policy(storage, args.run, args.storage):  # none after --iterations 0 on a new run
        print(newest)


def cmd_sft(args, storage):
    from stages.sft import gate_problem, sft

    started = dt.datetime.now(dt.timezone.utc)
    committed = sft(storage, args.run, force=args.force)
    if dt.datetime.fromisoformat(committed.manifest.committed_at) < started:  # found with the same identity
        print(f"sft: already committed ({committed.uri}): nothing to do; --force for a new attempt")
    else:
        print(f"sft: committed {committed.uri}\n{summary_lines(committed.manifest.summary)}")
    from stages.common import load_run

    if problem := gate_problem(load_run(storage, args.run), committed):
        raise StageError(problem.replace("RUN", args.run))


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
    none did. Reads the evals' manifests alone: a rerun of a finished demo answers at once."""
    from grpo.query import iterations
    from grpo.record.layout import stage_dir
    from grpo.record.storage import NotCommittedError, latest_committed

    for k in iterations(storage, run_id):
        try:
            found = latest_committed(storage, stage_dir(storage, run_id, k, "eval"), verify=False)
        except NotCommittedError:
            continue
        if (exact := found.manifest.summary.get("exact_match")) is not None and exact >= target:
            return k, exact
    return None
