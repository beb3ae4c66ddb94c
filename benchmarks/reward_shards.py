"""Sharded rewards on a CPU work pool: one worker scoring a large batch vs two workers scoring a shard each.

    .venv/bin/python benchmarks/reward_shards.py [--prompts 512] [--cost-ms 5] [--repeats 1] [--dir DIR]

A Prefect server on 127.0.0.1 with the process work pool "cpu" (deploy/placement/prefect.yaml's
grpo-stage/cpu). Every way scores the same committed rollouts (the sort task, `--prompts` x 8 samples) with
a reward function costing about `--cost-ms` of CPU a sample (a stand-in for a math-verify or unit-test
reward; this file writes it), one reward process per worker (reward.workers=1):

(a) in-process: `grpo stage rewards` in this process, no Prefect (the floor: scoring alone);
(b) pool, 1 worker, reward.shards=1: the flow dispatches the stage as one flow run (a cold hop);
(c) pool, 2 workers, reward.shards=2: two flow runs, one per shard, taken by the two workers at once,
    then the shards merged by the orchestrating flow.

(b) and (c) go through the product's own dispatch (flows.placement.Placement); the seconds are the orchestrating
flow's, from dispatch to the committed stage. Run it on a quiet machine: two workers need two idle cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

REWARD = '''
def reward(response, ground_truth, prompt, **row):
    """The sort task's exact match, after about {cost_ms} ms of CPU (calibrated where it was written)."""
    x = 0
    for i in range({loops}):
        x += i * i
    return float(response.strip() == ground_truth.strip())
'''


def calibrate(cost_ms: float) -> int:
    """Loop count of REWARD's busy loop that takes about cost_ms here."""
    loops = 200_000
    t0 = time.perf_counter()
    x = 0
    for i in range(loops):
        x += i * i
    return max(1, int(loops * cost_ms / 1000 / (time.perf_counter() - t0)))


def make_runs(url: str, root: Path, names: dict[str, int], prompts: int, cost_ms: float) -> None:
    """Runs `names` ({run id: reward.shards}) with the same config and their rollouts of iteration 0."""
    from grpo.config import load_config
    from grpo.record.storage import open_storage
    from stages import stage_function
    from stages.init import init_run

    fn = root / "heavy_reward.py"
    fn.write_text(REWARD.format(cost_ms=cost_ms, loops=calibrate(cost_ms)))
    storage = open_storage(url)
    for run_id, shards in names.items():
        settings = [
            "rollout.backend=hf",
            f"rollout.prompts_per_iteration={prompts}",
            "reward.workers=1",
            f"reward.functions=[{fn}:reward]",
            f"reward.shards={shards}",
            "reward.timeout_s=60",
        ]
        init_run(storage, run_id, load_config(None, settings))
        for stage in ("snapshot", "rollouts"):
            stage_function(stage)(storage, run_id, 0)


def orchestrate(url: str, run_id: str, shards: int) -> float:
    """The rewards stage of iteration 0 placed on pool "cpu" from a flow run here; its seconds."""
    from prefect import flow

    from flows.placement import Placement
    from grpo.record.layout import stage_dir
    from grpo.record.storage import latest_committed, open_storage
    from stages.common import load_run

    @flow(name="rewards-on-pool")
    def rewards_on_pool() -> float:
        storage = open_storage(url)
        upstream = latest_committed(storage, stage_dir(storage, run_id, 0, "rollouts")).uri
        at = Placement({"rewards": "cpu"}, storage, run_id, 0, load_run(storage, run_id))
        t0 = time.perf_counter()
        at("rewards", upstream)
        return time.perf_counter() - t0

    return rewards_on_pool()


def in_process(url: str, run_id: str) -> float:
    from grpo.record.storage import open_storage
    from stages.rewards import rewards

    t0 = time.perf_counter()
    rewards(open_storage(url), run_id, 0)
    return time.perf_counter() - t0


def on_pool(server, url: str, run_id: str, shards: int, workers: int, root: Path) -> float:
    from tools.prefect_server import process_worker

    homes = [root / f"worker-{run_id}-{i}" for i in range(workers)]
    with contextlib.ExitStack() as stack:
        for home in homes:
            home.mkdir()
            stack.enter_context(process_worker(server, "cpu", cwd=home, env={"GRPO_CACHE": str(home / "cache")}))
        out = subprocess.run(
            [sys.executable, __file__, "--orchestrate", url, run_id, str(shards)],
            cwd=REPO,
            env=server.env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
    if out.returncode:
        raise RuntimeError(f"orchestrating {run_id} exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--cost-ms", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--dir", type=Path)
    p.add_argument("--orchestrate", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.orchestrate:
        url, run_id, shards = args.orchestrate
        print(orchestrate(url, run_id, int(shards)))
        return
    from tools.prefect_server import prefect_server

    root = args.dir or Path(tempfile.mkdtemp(prefix="reward-shards-"))
    root.mkdir(parents=True, exist_ok=True)
    url = (root / "store").as_uri()
    ways = [("in-process", 1, 1), ("pool, 1 worker", 1, 1), ("pool, 2 workers", 2, 2)]  # (way, workers, shards)
    runs = {f"{w.split(',')[0].replace(' ', '')}{n}-{r}": s for r in range(args.repeats) for w, n, s in ways}
    make_runs(url, root, runs, args.prompts, args.cost_ms)
    seconds = {way: [] for way, _, _ in ways}
    with prefect_server(root / "prefect") as server:
        for pool in ("cpu", "gpu"):  # the deployments name both
            server.cli("work-pool", "create", pool, "--type", "process", "--overwrite")
        server.cli("--no-prompt", "deploy", "--all", "--prefect-file", "deploy/placement/prefect.yaml", cwd=REPO)
        for r in range(args.repeats):  # the ways side by side, repeat after repeat
            for way, workers, shards in ways:
                run_id = f"{way.split(',')[0].replace(' ', '')}{workers}-{r}"
                if way == "in-process":
                    seconds[way].append(in_process(url, run_id))
                else:
                    seconds[way].append(on_pool(server, url, run_id, shards, workers, root))
                print(f"{way}: {seconds[way][-1]:.1f} s", flush=True)
    samples = args.prompts * 8
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores; {samples} samples, ~{args.cost_ms} ms each")
    print("| way | workers | reward.shards | seconds (median) | vs 1 worker |\n|---|---|---|---|---|")
    one = sorted(seconds["pool, 1 worker"])[len(seconds["pool, 1 worker"]) // 2]
    for way, workers, shards in ways:
        med = sorted(seconds[way])[len(seconds[way]) // 2]
        print(f"| {way} | {workers} | {shards} | {med:.1f} | {one / med:.2f}x |")
    print(json.dumps(seconds))


if __name__ == "__main__":
    main()
