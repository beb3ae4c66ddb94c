"""Stages across machines: what a placed stage costs per iteration. The same iterations of one recipe
run three ways, side by side, on one Prefect server on 127.0.0.1:

    .venv/bin/python benchmarks/placement_overhead.py [--recipe sort|chat25m] [--iterations 3]
        [--set rollout.backend=hf ...] [--dir DIR]

(a) single: flow `grpo` with `iterations=N` in one process, no placement (what grpo/train runs);
(b) cold: every stage on a process work pool ("gpu": rollouts, learn, eval, one at a time; "cpu": the
    rest), a worker each in its own folder (deploy/placement/prefect.yaml), one `grpo/placed` flow run
    per iteration: each stage is a new flow-run process (interpreter, imports, model load);
(c) warm: every stage placed on "warm", two `python -m flows.stage_worker` processes (rollouts, learn,
    eval / snapshot, rewards, advantages) that keep their engine, learner and reward pool, and flow
    `grpo` with `iterations=N` orchestrating.

Each way is its own run id with the same config, in one local file:// folder (no S3: the three pay the
same storage either way). An iteration's time is from the previous iteration's eval commit to its own
(the manifests' `committed_at`), iterations 1.. (iteration 0 creates the run and starts everything).
Per stage, from the manifests: *before* = previous commit to this stage's `started_at` (the hop: task
run, or flow run, process start and imports), *inside* = `started_at` to `committed_at` (model loads
and engine starts included). For (b) the hop is split further with the stage flow runs' server times.

Recipes: `sort` is the config defaults (the sort task, 0.1M-parameter model, transformers sampler) at 64
prompts x 8; `chat25m` is learner_memory.py's 25.2M-parameter Qwen2 chat model with a BPE tokenizer on
GSM8K-style word problems (chat template, the response-length reward: random weights need a reward with
spread), 8 prompts x 4, responses up to 16 tokens, vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
from datetime import datetime
from pathlib import Path

from timing import committed_at, machine, manifests

from grpo.runtime.procs import stop_group, tail
from stages import STAGES

REPO = Path(__file__).resolve().parent.parent
WAYS = ("single", "cold", "warm")
COLD = {"snapshot": "cpu", "rollouts": "gpu", "rewards": "cpu", "advantages": "cpu", "learn": "gpu", "eval": "gpu"}
WARM_SERVES = (["rollouts", "learn", "eval"], ["snapshot", "rewards", "advantages"])  # "gpu", "cpu" machine
FLOW = "import json, sys; from flows.grpo import grpo; print(json.dumps(grpo(**json.loads(sys.argv[1]))))"


# ---------------------------------------------------------------- recipes: the runs' config overrides


def sort_recipe(root: Path) -> list[str]:
    """The config defaults (the sort task), fewer prompts an iteration to keep it quick."""
    return ["rollout.prompts_per_iteration=64"]


def chat25m_recipe(root: Path) -> list[str]:
    """learner_memory.py's 25.2M Qwen2 chat model and problems, made here; sampled with vLLM. A small batch
    (8 prompts x 4, 16 tokens: one AdamW step): at 32 x 4 x 32 one iteration took 161 s on 2 busy cores,
    the learner 110 s of it, and the hops under measure do not grow with the batch."""
    from learner_memory import make_world

    world = make_world(root, "float32", microbatch=16)
    sizes = ["rollout.prompts_per_iteration=8", "rollout.max_tokens=16", "eval.n_prompts=8"]
    return world + ["rollout.backend=vllm", *sizes]


RECIPES = {"sort": sort_recipe, "chat25m": chat25m_recipe}


def describe(overrides: list[str]) -> str:
    """The settings that size an iteration, as the run will resolve them."""
    from grpo.config import load_config

    c = load_config(None, overrides)
    m, r, lc = c.model, c.rollout, c.learn
    model = m.base_model or f"tiny {m.arch}: hidden {m.hidden_size}, {m.num_layers} layers, MLP {m.intermediate_size}"
    return (
        f"task {c.task.name}; model {model}; rollout backend {r.backend}, {r.prompts_per_iteration} prompts x "
        f"{r.group_size}, max_tokens {r.max_tokens}; learn minibatch {lc.minibatch_size}, microbatch "
        f"{lc.microbatch_size}, {lc.epochs} epoch(s); eval {c.eval.n_prompts} prompts; "
        f"reward workers {c.reward.workers}"
    )


# ---------------------------------------------------------------- the three ways


def flow_process(env: dict, params: dict, log: Path, timeout: float) -> None:
    """Flow `grpo` called with `params` in a new process (its own session, stopped with its children)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", FLOW, json.dumps(params)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        stop_group(proc)
    if rc:
        raise RuntimeError(f"flow grpo {params['run_id']} exited {rc}:\n{tail(log, 40)}")


def run_single(server, tmp: Path, base: dict, n: int, timeout: float) -> None:
    """(a) one process, N iterations, every stage in it."""
    env = {**server.env, "GRPO_CACHE": str(tmp / "single-cache")}
    flow_process(env, {**base, "iterations": n}, tmp / "single.log", timeout)


def run_cold(server, tmp: Path, base: dict, n: int, timeout: float) -> None:
    """(b) one grpo/placed flow run per iteration, each stage a flow run on its pool's worker."""
    from tools.prefect_server import process_worker

    deployment = server.api("GET", "/deployments/name/grpo/placed")["id"]
    homes = {pool: tmp / f"machine-{pool}" for pool in ("gpu", "cpu")}  # each worker its own folder and cache
    for home in homes.values():
        home.mkdir(exist_ok=True)
    env = lambda pool: {"GRPO_CACHE": str(homes[pool] / "cache")}  # noqa: E731
    with process_worker(server, "gpu", cwd=homes["gpu"], env=env("gpu")):
        with process_worker(server, "cpu", cwd=homes["cpu"], env=env("cpu")):
            for _ in range(n):  # the next iteration is created as soon as the last one finished
                params = {"placement": COLD, **base}  # the deployment's default, spelled out, unless base names one
                run = create_flow_run(server, deployment, params)
                done = finished(server, run["id"], timeout)
                if done["state"]["type"] != "COMPLETED":
                    raise RuntimeError(f"grpo/placed {done['name']}: {done['state']}\n{server.log_tails(40)}")


def create_flow_run(server, deployment: str, parameters: dict, tries: int = 5) -> dict:
    """A flow run of `deployment`, asked again after a 503 (the server's SQLite busy on 2 loaded cores)."""
    for attempt in range(tries):
        try:
            return server.api("POST", f"/deployments/{deployment}/create_flow_run", {"parameters": parameters})
        except urllib.error.HTTPError as e:
            if e.code != 503 or attempt == tries - 1:
                raise
            time.sleep(5)
    raise AssertionError("unreachable")


def finished(server, flow_run_id: str, timeout: float) -> dict:
    """The flow run once final, polled every 0.2 s; a busy server's error answer (503) is polled again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            run = server.flow_run(flow_run_id)
        except OSError:  # urllib's HTTPError and URLError
            run = {"state": None}
        if run["state"] and run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run
        time.sleep(0.2)
    raise TimeoutError(f"flow run {flow_run_id} not finished after {timeout:.0f} s")


def run_warm(server, tmp: Path, base: dict, n: int, timeout: float) -> None:
    """(c) two long-lived stage workers, the flow orchestrating N iterations."""
    workers = []
    try:
        for machine, stages in zip(("gpu", "cpu"), WARM_SERVES):
            env = {**server.env, "GRPO_CACHE": str(tmp / f"warm-{machine}-cache")}
            with open(tmp / f"stage-worker-{machine}.log", "wb") as out:
                workers.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "flows.stage_worker", *stages],
                        cwd=REPO,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        params = {**base, "iterations": n, "placement": dict.fromkeys(STAGES, "warm")}
        try:
            flow_process(server.env, params, tmp / "warm.log", timeout)
        except RuntimeError as e:
            logs = "\n".join(tail(tmp / f"stage-worker-{m}.log", 20) for m in ("gpu", "cpu"))
            raise RuntimeError(f"{e}\n{logs}") from None
    finally:
        for w in workers:
            stop_group(w)


RUNNERS = {"single": run_single, "cold": run_cold, "warm": run_warm}


# ---------------------------------------------------------------- reading the manifests


def ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def iteration_seconds(url: str, run_id: str, n: int, launched: float) -> list[float]:
    """Per iteration: previous eval commit (iteration 0: the launch) to this eval commit."""
    ends = [committed_at(manifests(url, run_id, k)["eval"]) for k in range(n)]
    return [end - start for start, end in zip([launched, *ends], ends)]


def stage_split(url: str, run_id: str, iterations: range) -> dict[str, tuple[float, float]]:
    """Per stage, mean seconds (before, inside) over `iterations`: previous commit -> started_at ->
    committed_at."""
    sums = {s: [0.0, 0.0] for s in STAGES}
    prev = manifests(url, run_id, iterations[0] - 1)["eval"]
    for k in iterations:
        m = manifests(url, run_id, k)
        for s in STAGES:
            sums[s][0] += ts(m[s].started_at) - committed_at(prev)
            sums[s][1] += committed_at(m[s]) - ts(m[s].started_at)
            prev = m[s]
    return {s: (b / len(iterations), i / len(iterations)) for s, (b, i) in sums.items()}


def cold_hops(server, url: str, run_id: str, iterations: range) -> dict[str, list[float]]:
    """(b)'s hop per stage from its flow run's server times and its manifest, mean seconds:
    [created -> Running (worker poll, process start, imports), Running -> stage start (flow and task run,
    inputs), commit -> flow run end (task and process end), end -> next flow run created (the
    orchestrator's poll of 2 s, the next iteration's orchestrator start after eval)]."""
    runs = server.api("POST", "/flow_runs/filter", {"flow_runs": {"name": {"like_": f"{run_id} "}}, "limit": 200})
    by_name = {r["name"]: r for r in runs}
    parts: dict[str, list[list[float]]] = {s: [[], [], [], []] for s in STAGES}
    for k in iterations:
        m = manifests(url, run_id, k)
        for i, s in enumerate(STAGES):
            r = by_name[f"{run_id} {s} {k}"]
            nxt = by_name.get(f"{run_id} {STAGES[i + 1]} {k}" if i + 1 < len(STAGES) else f"{run_id} snapshot {k + 1}")
            parts[s][0].append(ts(r["start_time"]) - ts(r["created"]))
            parts[s][1].append(ts(m[s].started_at) - ts(r["start_time"]))
            parts[s][2].append(ts(r["end_time"]) - committed_at(m[s]))
            if nxt:  # none after the last eval
                parts[s][3].append(ts(nxt["created"]) - ts(r["end_time"]))
    return {s: [sum(x) / len(x) if x else float("nan") for x in v] for s, v in parts.items()}


# ---------------------------------------------------------------- output


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def print_table(results: dict) -> None:
    single = results["single"]["steady"]
    print(
        "\n| way | s / iteration (1..) | overhead vs (a) | ratio | iterations 1.. | iteration 0 from launch | "
        "wall, launch to end | load avg before -> after |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    names = {"single": "(a) single process", "cold": "(b) cold per-stage flow runs", "warm": "(c) warm stage workers"}
    for way, r in results.items():
        s = r["steady"]
        print(
            f"| {names[way]} | {s:.2f} | {s - single:+.2f} s | {s / single:.2f}x | "
            f"{' / '.join(f'{x:.2f}' for x in r['seconds'][1:])} | {r['seconds'][0]:.1f} | {r['wall']:.1f} | "
            f"{r['load'][0]} -> {r['load'][1]} |"
        )


def print_split(results: dict) -> None:
    print("\nper stage, mean seconds of iterations 1..: before (previous commit -> start) / inside (start -> commit)")
    print("| stage | " + " | ".join(WAYS) + " |\n| --- |" + " --- |" * len(WAYS))
    for s in STAGES:
        cells = [f"{b:.2f} / {i:.2f}" for b, i in (results[w]["split"][s] for w in WAYS)]
        print(f"| {s} | " + " | ".join(cells) + " |")
    totals = [sum(b for b, _ in results[w]["split"].values()) for w in WAYS]
    insides = [sum(i for _, i in results[w]["split"].values()) for w in WAYS]
    print("| total | " + " | ".join(f"{b:.2f} / {i:.2f}" for b, i in zip(totals, insides)) + " |")


def print_hops(hops: dict[str, list[float]]) -> None:
    print(
        "\n(b) cold: each stage's hop, mean seconds of iterations 1..\n"
        "| stage | created -> Running | Running -> stage start | commit -> flow run end | end -> next dispatch |\n"
        "| --- | --- | --- | --- | --- |"
    )
    for s, parts in hops.items():
        print(f"| {s} | " + " | ".join(f"{x:.2f}" for x in parts) + " |")


# ---------------------------------------------------------------- main


def setup_pools(server) -> None:
    """deploy/placement/prefect.yaml's two process pools (gpu: one stage at a time) and deployments."""
    for pool in ("gpu", "cpu"):
        server.cli("work-pool", "create", pool, "--type", "process", "--overwrite")
    server.cli("work-pool", "set-concurrency-limit", "gpu", "1")
    server.cli("--no-prompt", "deploy", "--all", "--prefect-file", "deploy/placement/prefect.yaml", cwd=REPO)


def measure(server, tmp: Path, url: str, way: str, overrides: list[str], n: int, timeout: float, tries: int) -> dict:
    """Run one way of the recipe (a failed try is retried under a new run id) and read its iterations back."""
    for attempt in range(1, tries + 1):
        run_id = f"{way}-{attempt}"
        base = {"run_id": run_id, "overrides": overrides, "storage_url": url}
        before, start = load(), time.time()
        try:
            RUNNERS[way](server, tmp, base, n, timeout)
            break
        except Exception as e:  # reported, then retried or raised
            print(f"  {way}: try {attempt} failed after {time.time() - start:.0f} s: {str(e).splitlines()[0]}")
            if attempt == tries:
                raise
    wall = time.time() - start
    seconds = iteration_seconds(url, run_id, n, start)
    out = {"seconds": seconds, "steady": sum(seconds[1:]) / (n - 1), "wall": wall, "load": (before, load())}
    out["split"] = stage_split(url, run_id, range(1, n))
    if way == "cold":
        out["hops"] = cold_hops(server, url, run_id, range(1, n))
    print(f"  {way}: {' '.join(f'{x:.2f}' for x in seconds)} s per iteration; {wall:.0f} s in all", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", choices=sorted(RECIPES), default="sort")
    p.add_argument("--iterations", type=int, default=3, help="per way; iteration 0 is not counted (>= 2)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="more overrides")
    p.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS), help="a subset (single included)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per way")
    p.add_argument("--tries", type=int, default=2, help="tries per way (a failed one is reported)")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    args = p.parse_args()
    if args.iterations < 2:
        p.error("--iterations must be >= 2: iteration 0 is not counted")
    if "single" not in args.ways:
        p.error("--ways needs single: the overheads are against it")

    from tools.prefect_server import prefect_server

    t0 = time.time()
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="grpo-placement-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    url = (tmp / "store").as_uri()
    print(f"machine: {machine()}; load average {load()}\nfolder: {tmp}; storage {url} (local folder)", flush=True)
    overrides = RECIPES[args.recipe](tmp) + args.set
    print(f"recipe {args.recipe}: {describe(overrides)}\n  overrides: {' '.join(overrides)}", flush=True)
    print(f"{args.iterations} iterations per way, ways {' '.join(args.ways)}", flush=True)
    results = {}
    with prefect_server(tmp / "prefect") as server:
        if "cold" in args.ways:
            setup_pools(server)
        for way in args.ways:
            results[way] = measure(server, tmp, url, way, overrides, args.iterations, args.timeout, args.tries)
    print_table(results)
    if set(results) == set(WAYS):
        print_split(results)
    if "cold" in results:
        print_hops(results["cold"]["hops"])
    print(f"\n{time.time() - t0:.0f} s in all; load average now {load()}")


if __name__ == "__main__":
    main()
