"""Sampling beside learning (issue 32.6a): iterations per hour of the chat recipe at rollout.staleness S = 0 and
S = 1 on two pools pinned to one core each, against the overlap bound (r + l) / max(r, l).

    .venv/bin/python benchmarks/overlap.py [--iterations 6] [--rounds 2] [--set SECTION.FIELD=VALUE ...] [--dir DIR]

Two pools, each a warm stage worker (flows/stage_worker.py) pinned before it starts (os.sched_setaffinity, which its
children inherit: the reward pool, vLLM's engine) with one torch/OpenMP thread (GRPO_THREADS=1, OMP_NUM_THREADS=1):
"sampling" on core 0 serves snapshot, rollouts, rewards, advantages and eval, "learning" on core 1 serves learn; the
flow `grpo` places every stage on them (`warm`) and orchestrates from a process of its own, beside one Prefect server
on 127.0.0.1. The server and the orchestrator are not pinned (they take CPU from both cores; their CPU seconds are
printed). Warm workers are the case that matters for throughput: a cold stage (a flow run a stage) pays a process
start and a model load each time, ~2.5 minutes an iteration at this size (placement_overhead.py), which would bury
the overlap; warm, a stage's hop is ~0.5 s and the engine, learner and reward pool stay loaded.

Runs alternate S = 0 and S = 1 (S = 1 with learn.behavior_correction=tis), `--rounds` of each, A/B: the same config
otherwise, each a run of its own on the same two workers, so drift in the machine's load shows between rounds. The
recipe is placement_overhead.py's chat25m (a 25.2M Qwen2 chat model, vLLM, 8 prompts x 4, 16 tokens, eval 8 prompts).

Figures from the runs' manifests (started_at, committed_at), iterations 1.. (iteration 0 loads the model, starts the
engine and, at S = 1, has no learn before it to overlap):
- period: learn k-1's commit to learn k's (each learn commits the next policy); iterations per hour = 3600 / period.
  placement_overhead.py times eval to eval; that is printed too, but at S = 1 the flow's last iteration has nothing to
  sample beside its learn, so its eval-to-eval step is a synchronous one;
- r: snapshot's start to advantages' commit (the sampling side); l: learn's start to commit; e: eval's;
- the bound (r + l) / max(r, l) (issue 32's Done-when; its figures from the S = 0 runs, where the stages ran alone,
  and from the S = 1 runs), the measured speedup (S = 0's period over S = 1's) and its ratio to the bound. Eval runs
  on the sampling pool beside the next learn, so the sampling side's cycle is r + e: the bound (r + e + l) /
  max(r + e, l) is printed beside it;
- each pool's busy share between learn 0's commit and the last learn's; the orchestrator's hop from an eval's commit to
  the next snapshot's start (the sampling pool waits on it at both S); `grpo timeline` of the last S = 1 run.

Printed as markdown for benchmarks/RESULTS.md. Needs a quiet machine: the pinned cores are the whole machine here, and
another process on them slows one side only. The defaults took 12.5 minutes on 2 busy cores (load 9-13);
`--iterations 3 --rounds 1` about 5.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
from placement_overhead import RECIPES, REPO, describe, flow_process, load, ts
from timing import committed_at, machine, manifests

from grpo.runtime.procs import stop_group, tail
from stages import STAGES

POOLS = {  # pool: (its core, the stages its worker serves)
    "sampling": (0, ["snapshot", "rollouts", "rewards", "advantages", "eval"]),
    "learning": (1, ["learn"]),
}
ONE_THREAD = {"GRPO_THREADS": "1", "OMP_NUM_THREADS": "1"}
STALENESS = {0: [], 1: ["learn.behavior_correction=tis"]}  # per S: its overrides beside rollout.staleness


# ---------------------------------------------------------------- the pools


@contextmanager
def pinned_workers(server, tmp: Path):
    """One stage worker a pool, each pinned to its core before it starts, one thread; yields {pool: Popen}."""
    workers = {}
    try:
        for pool, (core, stages) in POOLS.items():
            env = {**server.env, **ONE_THREAD, "GRPO_CACHE": str(tmp / f"{pool}-cache")}
            with open(tmp / f"worker-{pool}.log", "wb") as out:
                workers[pool] = subprocess.Popen(
                    [sys.executable, "-m", "flows.stage_worker", *stages, "--threads", "1"],
                    cwd=REPO,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=lambda core=core: os.sched_setaffinity(0, {core}),
                )
        yield workers
    finally:
        for w in workers.values():  # the workers before the server (the caller's context)
            stop_group(w)


def server_pid(server) -> int:
    """The `prefect server start` process of this server (found by its port)."""
    port = server.api_url.split(":")[-1].split("/")[0]
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "server" in cmd and "start" in cmd and port in cmd:
            return p.pid
    raise RuntimeError(f"no prefect server process listens on {port}")


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (and the children they reaped)."""
    total = 0.0
    for p in tree(pid):
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def cores_used(pid: int) -> tuple[int, int, str]:
    """(processes, threads, the cores any of their threads may run on) of a process tree: the pinning, checked."""
    procs, threads, cores = 0, 0, set()
    for p in tree(pid):
        try:
            tids = [t.id for t in p.threads()]
        except psutil.NoSuchProcess:
            continue
        procs += 1
        for tid in tids:
            try:
                cores |= os.sched_getaffinity(tid)
                threads += 1
            except OSError:  # the thread ended
                pass
    return procs, threads, ",".join(map(str, sorted(cores)))


# ---------------------------------------------------------------- one run


def run_one(server, tmp: Path, url: str, workers: dict, run_id: str, overrides: list[str], n: int, timeout: float):
    """Flow `grpo` for `n` iterations of `run_id`, every stage on the pinned workers; the CPU seconds each side took."""
    before = {pool: cpu_seconds(w.pid) for pool, w in workers.items()} | {"server": cpu_seconds(server_pid(server))}
    flow_before = resource.getrusage(resource.RUSAGE_CHILDREN)  # the flow process is the only child reaped meanwhile
    params = {"run_id": run_id, "overrides": overrides, "storage_url": url, "iterations": n}
    params["placement"] = dict.fromkeys(STAGES, "warm")
    try:
        flow_process({**server.env, **ONE_THREAD}, params, tmp / f"{run_id}.log", timeout)
    except RuntimeError as e:
        logs = "\n".join(f"--- {pool}\n{tail(tmp / f'worker-{pool}.log', 20)}" for pool in workers)
        raise RuntimeError(f"{e}\n{logs}") from None
    flow_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {pool: cpu_seconds(w.pid) - before[pool] for pool, w in workers.items()}
    cpu["server"] = cpu_seconds(server_pid(server)) - before["server"]
    cpu["flow"] = sum(getattr(flow_after, f) - getattr(flow_before, f) for f in ("ru_utime", "ru_stime"))
    return cpu


def measure(server, tmp: Path, url: str, workers: dict, name: str, s: int, overrides: list[str], args) -> dict:
    """One run of the recipe at staleness `s` (a failed try is retried under a new run id), read back."""
    for attempt in range(1, args.tries + 1):
        run_id, before, start = name + (f"-try{attempt}" if attempt > 1 else ""), load(), time.time()
        try:
            cpu = run_one(server, tmp, url, workers, run_id, overrides, args.iterations, args.timeout)
            break
        except Exception as e:  # reported, then retried or raised
            print(f"  {run_id}: failed after {time.time() - start:.0f} s: {str(e).splitlines()[0]}")
            if attempt == args.tries:
                raise
    run = {"id": run_id, "S": s, "cpu": cpu, "load": (before, load()), "wall": time.time() - start}
    run["read"] = read_run(url, run_id, args.iterations)
    pins = "; ".join(
        "{}: {} processes, {} threads on core(s) {}".format(p, *cores_used(w.pid)) for p, w in workers.items()
    )
    periods = " ".join(f"{r['period']:.2f}" for r in run["read"]["rows"])
    print(f"  {run_id}: {periods} s per iteration (1..); {run['wall']:.0f} s in all", flush=True)
    print(f"    warm: {run['read']['warm']}; {pins}", flush=True)
    return run


# ---------------------------------------------------------------- reading the manifests


def span(manifest) -> float:
    return committed_at(manifest) - ts(manifest.started_at)


def read_run(url: str, run_id: str, n: int) -> dict:
    """Per iteration 1..n-1: period (learn to learn), eval to eval, r, l, e, the learner's idle before its learn;
    each pool's busy share between learn 0's commit and the last learn's; whether iterations 1.. ran warm."""
    m = [manifests(url, run_id, k) for k in range(n)]
    learn_end = [committed_at(x["learn"]) for x in m]
    eval_end = [committed_at(x["eval"]) for x in m]
    rows = [
        {
            "iteration": k,
            "period": learn_end[k] - learn_end[k - 1],
            "eval_period": eval_end[k] - eval_end[k - 1],
            "r": committed_at(m[k]["advantages"]) - ts(m[k]["snapshot"].started_at),
            "l": span(m[k]["learn"]),
            "e": span(m[k]["eval"]),
            "learner_idle": ts(m[k]["learn"].started_at) - learn_end[k - 1],
        }
        for k in range(1, n)
    ]
    window = (learn_end[0], learn_end[-1])
    busy = {pool: busy_share([x[s] for x in m for s in stages], *window) for pool, (_, stages) in POOLS.items()}
    snapshots = [ts(x["snapshot"].started_at) for x in m]
    after_eval = [min(t for t in snapshots if t > end) - end for end in eval_end if end < snapshots[-1]]
    engine_s = [x[s].summary["engine_s"] for x in m for s in ("rollouts", "eval")]
    warm = (
        f"learner kept {sum(bool(x['learn'].summary.get('warm_learner')) for x in m[1:])}/{n - 1}, "
        f"engine_s {engine_s[0]:.1f} at 0 then <= {max(engine_s[1:]):.1f}"
    )
    return {"rows": rows, "busy": busy, "after_eval": after_eval, "warm": warm}


def busy_share(stage_manifests: list, start: float, end: float) -> float:
    """The share of [start, end] during which one of these stage attempts ran (they never overlap on one pool)."""
    busy = sum(
        max(0.0, min(committed_at(x), end) - max(ts(x.started_at), start)) for x in stage_manifests
    )  # one worker runs one task at a time
    return busy / (end - start)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


# ---------------------------------------------------------------- output


def print_runs(runs: list[dict]) -> None:
    print(
        "\nper run, iterations 1..\n| run | S | s / iteration (learn to learn) | iterations per hour | "
        "eval to eval, s | r, s | l, s | e, s | learner idle before learn, s | eval commit -> next snapshot, s "
        "(mean / max) | sampling / learning pool busy | CPU s: sampling / learning / server / flow | load avg "
        "before -> after |\n|" + " --- |" * 13
    )
    for run in runs:
        rows, cpu = run["read"]["rows"], run["cpu"]
        period = mean([r["period"] for r in rows])
        cells = [
            run["id"],
            str(run["S"]),
            " / ".join(f"{r['period']:.2f}" for r in rows) + f" (mean {period:.2f})",
            f"{3600 / period:.0f}",
            " / ".join(f"{r['eval_period']:.2f}" for r in rows),
            *(f"{mean([r[key] for r in rows]):.2f}" for key in ("r", "l", "e", "learner_idle")),
            f"{mean(run['read']['after_eval']):.2f} / {max(run['read']['after_eval']):.2f}",
            f"{run['read']['busy']['sampling']:.0%} / {run['read']['busy']['learning']:.0%}",
            " / ".join(f"{cpu[k]:.0f}" for k in ("sampling", "learning", "server", "flow")),
            f"{run['load'][0]} -> {run['load'][1]}",
        ]
        print("| " + " | ".join(cells) + " |")


def print_summary(runs: list[dict]) -> None:
    by_s = {s: [row for run in runs if run["S"] == s for row in run["read"]["rows"]] for s in STALENESS}
    stat = {s: {k: mean([r[k] for r in rows]) for k in ("period", "r", "l", "e")} for s, rows in by_s.items()}
    speedup = stat[0]["period"] / stat[1]["period"]
    print("\n| | S = 0 | S = 1 |\n| --- | --- | --- |")
    print(f"| s / iteration (learn to learn, 1..) | {stat[0]['period']:.2f} | {stat[1]['period']:.2f} |")
    print(f"| iterations per hour | {3600 / stat[0]['period']:.0f} | {3600 / stat[1]['period']:.0f} |")
    for key, name in (("r", "r: snapshot start -> advantages commit"), ("l", "l: learn"), ("e", "e: eval")):
        print(f"| {name}, s | {stat[0][key]:.2f} | {stat[1][key]:.2f} |")
    print(f"\nspeedup, S = 1 over S = 0 (iterations per hour): {speedup:.3f}")
    for s in STALENESS:
        r, learn, e = stat[s]["r"], stat[s]["l"], stat[s]["e"]
        bound, with_eval = (r + learn) / max(r, learn), (r + e + learn) / max(r + e, learn)
        print(
            f"bound (r + l) / max(r, l) with the S = {s} runs' stage times: {bound:.3f}; speedup / bound "
            f"{speedup / bound:.3f} (Done-when: >= 0.9); with eval on the sampling side, (r + e + l) / max(r + e, l) "
            f"= {with_eval:.3f}, speedup / that {speedup / with_eval:.3f}"
        )
    pairs = [(a, b) for a, b in zip(runs[::2], runs[1::2])]
    per_round = [
        mean([r["period"] for r in a["read"]["rows"]]) / mean([r["period"] for r in b["read"]["rows"]])
        for a, b in pairs
    ]
    print("speedup per round (A/B pairs, in run order): " + " / ".join(f"{x:.3f}" for x in per_round))


def print_timeline(url: str, run_id: str) -> None:
    from flows.cli import main as grpo_cli

    print(f"\n`grpo timeline --run {run_id}` (seconds since its first stage started):\n```")
    sys.stdout.flush()
    grpo_cli(["--storage", url, "timeline", "--run", run_id])
    print("```")


# ---------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=6, help="per run; iteration 0 is not counted (>= 2)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each S, alternating S = 0, S = 1")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="more overrides, both S")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--tries", type=int, default=2, help="tries per run (a failed one is reported, then retried)")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    args = p.parse_args()
    if args.iterations < 2:
        p.error("--iterations must be >= 2: iteration 0 is not counted")
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        p.error("needs cores 0 and 1 (one a pool)")

    from tools.prefect_server import prefect_server

    t0 = time.time()
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="grpo-overlap-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    url = (tmp / "store").as_uri()
    print(f"machine: {machine()}; load average {load()}\nfolder: {tmp}; storage {url} (local folder)", flush=True)
    base = RECIPES["chat25m"](tmp) + args.set
    print(f"recipe chat25m: {describe(base)}\n  overrides: {' '.join(base)}", flush=True)
    pools = "; ".join(f"{pool} on core {core}: {' '.join(stages)}" for pool, (core, stages) in POOLS.items())
    print(f"pools (warm stage workers, one thread each): {pools}", flush=True)
    print(f"{args.iterations} iterations a run, {args.rounds} round(s) of S = 0 then S = 1", flush=True)
    runs = []
    with prefect_server(tmp / "prefect") as server, pinned_workers(server, tmp) as workers:
        for i in range(1, args.rounds + 1):
            for s, more in STALENESS.items():
                overrides = [*base, f"rollout.staleness={s}", *more]
                runs.append(measure(server, tmp, url, workers, f"s{s}-{i}", s, overrides, args))
        print_runs(runs)
        print_summary(runs)
        print_timeline(url, runs[-1]["id"])
    print(f"\n{time.time() - t0:.0f} s in all; load average now {load()}")


if __name__ == "__main__":
    main()
