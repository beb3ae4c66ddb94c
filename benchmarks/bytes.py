"""Bytes an iteration moves through object storage and through sha256, from the manifests' `io` records (issue 31),
on a local S3 server (SeaweedFS, tools/s3server.py), for the chat recipe (placement_overhead.py's chat25m: a
25.2M-parameter Qwen2 chat model sampled with vLLM, full fine-tuning, its checkpoint in --dtype):

    .venv/bin/python benchmarks/bytes.py [--iterations 3] [--dtype float32|bfloat16] [--set k=v ...] [--dir DIR]

(a) cold, through placement: flow `grpo/placed`, one flow run per iteration, every stage a new flow-run process
    on a Prefect process pool: learn on "gpu" (the learner's machine), the other five on "cpu" (the samplers'
    machine), each worker with its own GRPO_CACHE, as two machines would have; rollout.staleness 0.
(b) warm, one process: flow `grpo` with `iterations` N (what `grpo run` and grpo/train run): sampler, learner
    and caches kept from one iteration to the next.

Per iteration (1.., iteration 0 starts everything) and stage: bytes downloaded, read (downloads, tables,
manifests), hashed and uploaded, summed from every committed attempt's manifest; the learn's resume state
(`state`, committed after the policy in the background) listed on its own. On the critical path: what the
stages snapshot -> rollouts -> rewards -> advantages -> learn move (eval k and the state commit run beside
the next iteration in the flow at rollout.staleness >= 1, and the state commit at any staleness); eval listed
apart. P = the policy's bytes (policy/ of a learn), N = parameters. Each way's iteration seconds, eval commit to
eval commit (placement_overhead.iteration_seconds), follow its table: on a quiet machine they compare versions
(copy this file, placement_overhead.py, learner_memory.py and timing.py into an older checkout and run it there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from learner_memory import make_world
from placement_overhead import describe, flow_process, iteration_seconds, load, run_cold, setup_pools, ts
from timing import machine

SPLIT = {"snapshot": "cpu", "rollouts": "cpu", "rewards": "cpu", "advantages": "cpu", "learn": "gpu", "eval": "cpu"}
CRITICAL = ("snapshot", "rollouts", "rewards", "advantages", "learn")
KINDS = ("download", "read", "hash", "upload")


def cold(server, tmp: Path, base: dict, n: int, timeout: float) -> None:
    """(a): placement_overhead's cold way with learn on "gpu" and the rest on "cpu", a cache per worker."""
    setup_pools(server)
    run_cold(server, tmp, {**base, "placement": SPLIT}, n, timeout)


def warm(server, tmp: Path, base: dict, n: int, timeout: float) -> None:
    """(b): flow `grpo` with `iterations` n in one new process, its own cache."""
    env = {**server.env, "GRPO_CACHE": str(tmp / "warm-cache")}
    flow_process(env, {**base, "iterations": n}, tmp / "warm.log", timeout)


def counts(storage, run_id: str, k: int) -> dict[str, dict[str, int]]:
    """{stage: {kind: bytes}} of iteration k: every committed attempt's io (the state commit as `state`)."""
    from grpo.record import layout
    from grpo.record.storage import committed_attempts, load_manifest

    out = defaultdict(lambda: defaultdict(int))
    state = getattr(layout, "STATE_STAGE", None)  # None: the code before the learn's commit was split
    for stage in (*layout.STAGES, *[state] * bool(state)):
        for attempt in committed_attempts(storage, layout.stage_dir(storage, run_id, k, stage)):
            io = getattr(load_manifest(storage, attempt, verify=False)[0], "io", None) or {}  # None: before issue 31
            for kind in KINDS:
                out[stage][kind] += io.get(f"{kind}_bytes", 0)
    return out


def commit_seconds(storage, run_id: str, n: int) -> tuple[float, float]:
    """Means over iterations 1..n-1: a learn's start to its commit, and its commit to its state's (0 where the
    state was inside the learn's commit)."""
    from grpo.record import layout
    from grpo.record.storage import committed_attempts, load_manifest

    def times(k: int, stage: str) -> tuple[float, float] | None:
        attempts = committed_attempts(storage, layout.stage_dir(storage, run_id, k, stage))
        if not attempts:
            return None
        m = load_manifest(storage, attempts[-1], verify=False)[0]
        return ts(m.started_at), ts(m.committed_at)

    learn, behind = [], []
    for k in range(1, n):
        start, end = times(k, "learn")
        learn.append(end - start)
        held = times(k, layout.STATE_STAGE) if hasattr(layout, "STATE_STAGE") else None
        behind.append(held[1] - end if held else 0.0)
    return sum(learn) / len(learn), sum(behind) / len(behind)


def policy_bytes(storage, run_id: str) -> tuple[int, int]:
    """(P, N): bytes of learn 0's policy/ (or adapter/) and the model's parameters."""
    from grpo.record.layout import stage_dir
    from grpo.record.storage import latest_committed

    learned = latest_committed(storage, stage_dir(storage, run_id, 0, "learn"), verify=False)
    own = [f for f in learned.manifest.files if f.path.startswith(("policy/", "adapter/")) and f.uri is None]
    config = json.loads(storage.read_bytes(learned.path("policy/config.json")))
    width = {"float32": 4, "bfloat16": 2, "float16": 2}[config.get("dtype") or config.get("torch_dtype", "float32")]
    weights = sum(f.size for f in own if f.path.endswith(".safetensors"))  # the header's few kB aside
    return sum(f.size for f in own), weights // width


def report(storage, run_id: str, n: int, title: str) -> dict:
    """Print the per-stage table of iterations 1..n-1 (means) in multiples of P; returns the totals."""
    P, N = policy_bytes(storage, run_id)
    rows = [counts(storage, run_id, k) for k in range(1, n)]
    stages = sorted({s for r in rows for s in r}, key=lambda s: (s not in CRITICAL, s))
    mean = {s: {kind: sum(r[s][kind] for r in rows) / len(rows) for kind in KINDS} for s in stages}
    unit = f"P = {P / 1e6:.1f} MB" + (f" = {P / N:.2f} N bytes" if N else "")
    print(f"\n### {title}: bytes an iteration, mean of iterations 1..{n - 1}, in P ({unit})\n")
    print("| stage | downloaded | read | hashed | uploaded | on the critical path |")
    print("| --- | --- | --- | --- | --- | --- |")
    for s in stages:
        m = mean[s]
        cells = " | ".join(f"{m[kind] / P:.2f}" for kind in KINDS)
        print(f"| {s} | {cells} | {'yes' if s in CRITICAL else 'no'} |")
    total = {kind: sum(mean[s][kind] for s in stages) for kind in KINDS}
    crit = {kind: sum(mean[s][kind] for s in stages if s in CRITICAL) for kind in KINDS}
    for name, t in (("all", total), ("critical path", crit)):
        print(f"| **{name}** | " + " | ".join(f"**{t[kind] / P:.2f}**" for kind in KINDS) + " | |")
    moved = crit["download"] + crit["upload"]
    print(f"\ncritical path: {moved / P:.2f} P moved (downloaded + uploaded), {crit['hash'] / P:.2f} P hashed")
    seconds = iteration_seconds(storage.url, run_id, n, 0.0)[1:]  # eval commit to eval commit, iterations 1..
    learn, behind = commit_seconds(storage, run_id, n)
    print(f"learn: {learn:.1f} s from its start to its commit; the state committed {behind:.1f} s after it (means)")
    print(
        f"iteration seconds (eval commit to eval commit): {' '.join(f'{s:.1f}' for s in seconds)}, "
        f"mean {sum(seconds) / len(seconds):.1f}"
    )
    return {"P": P, "N": N, "total": total, "critical": crit, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=3, help="per way; iteration 0 is not counted (>= 2)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="more overrides")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the base checkpoint's")
    p.add_argument("--ways", nargs="+", choices=("cold", "warm"), default=["cold", "warm"])
    p.add_argument("--timeout", type=float, default=1200, help="seconds per way")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    args = p.parse_args()
    if args.iterations < 2:
        p.error("--iterations must be >= 2: iteration 0 is not counted")

    from grpo.record.storage import open_storage
    from tools.prefect_server import prefect_server
    from tools.s3server import s3_server

    t0 = time.time()
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="grpo-bytes-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    sizes = ["rollout.prompts_per_iteration=8", "rollout.max_tokens=16", "eval.n_prompts=8"]  # chat25m's
    overrides = make_world(tmp, args.dtype, microbatch=16) + ["rollout.backend=vllm", *sizes, *args.set]
    print(f"machine: {machine()}; load average {load()}\nfolder: {tmp}", flush=True)
    print(f"recipe chat25m: {describe(overrides)}\n  overrides: {' '.join(overrides)}", flush=True)
    out = {}
    with s3_server(tmp / "s3") as s3, prefect_server(tmp / "prefect") as server:
        server.env.update(s3.env())  # the workers and the flow processes reach the S3 server
        os.environ.update(s3.env())
        url = s3.url("bytes")
        storage = open_storage(url)
        for way in args.ways:
            base = {"run_id": way, "overrides": overrides, "storage_url": url}
            start = time.time()
            (cold if way == "cold" else warm)(server, tmp, base, args.iterations, args.timeout)
            print(f"{way}: {time.time() - start:.0f} s for {args.iterations} iterations", flush=True)
            title = "cold, through placement (learn and the samplers on two machines)" if way == "cold" else "warm"
            out[way] = report(storage, way, args.iterations, title)
    (tmp / "bytes.json").write_text(json.dumps(out, indent=2))
    print(f"\n{time.time() - t0:.0f} s in all; load average now {load()}; figures in {tmp / 'bytes.json'}")


if __name__ == "__main__":
    sys.exit(main())
