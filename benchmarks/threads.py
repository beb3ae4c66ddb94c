"""The learner's update on a shared CPU machine: the same forced learn at each torch thread count, alone and
beside busy processes (what GRPO_THREADS is for; docs/setup.md, "A machine other processes share").

    .venv/bin/python benchmarks/threads.py [--threads default 1 2] [--busy 0 2] [--repeats 2] [--set ...]

One run of the defaults (the demo's recipe) gets iteration 0's stages up to advantages; then, for each
number of busy processes (each a Python loop spinning on one core, as another stage process or a pytest
worker would) and each thread setting (`default`: torch's own, one per core), `grpo stage learn --force`
runs in a fresh process with GRPO_THREADS set, and the learn manifest's `update_s`, `threads` and
`cpu_busy_others` are printed, one row per learn.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import machine

from grpo.config import load_config
from grpo.record.layout import stage_dir
from grpo.record.storage import latest_committed, open_storage
from grpo.runtime.quiet import quiet_libraries
from stages import stage_function
from stages.init import init_run

REPO = Path(__file__).resolve().parent.parent
SPIN = "while True: pass"


def forced_learn(url: str, threads: str) -> dict:
    """`grpo stage learn --force` of iteration 0 in a new process; the new attempt's summary."""
    env = {k: v for k, v in os.environ.items() if k not in ("GRPO_THREADS", "OMP_NUM_THREADS")}
    if threads != "default":
        env["GRPO_THREADS"] = threads
    cmd = [sys.executable, "-m", "flows.cli", "--storage", url, "stage", "learn", "--run", "t", "--iteration", "0"]
    subprocess.run([*cmd, "--force"], env=env, cwd=REPO, check=True, capture_output=True)
    storage = open_storage(url)
    return latest_committed(storage, stage_dir(storage, "t", 0, "learn"), verify=False).manifest.summary


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", nargs="+", default=["default", "1", "2"], help="GRPO_THREADS values; default: torch's")
    p.add_argument("--busy", nargs="+", type=int, default=[0, 2], help="busy processes beside the learner")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args()
    quiet_libraries()
    print(f"machine: {machine()}; load average now {os.getloadavg()[0]:.1f}", flush=True)
    url = Path(tempfile.mkdtemp(prefix="grpo-threads-")).as_uri()
    storage = open_storage(url)
    init_run(storage, "t", load_config(None, args.set))
    for stage in ("snapshot", "rollouts", "rewards", "advantages", "learn"):
        stage_function(stage)(storage, "t", 0)
    print(f"{'busy':>4} {'GRPO_THREADS':>12} {'threads':>7} {'update_s':>8} {'others':>6}", flush=True)
    for busy in args.busy:
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
        try:
            for threads in args.threads:
                for _ in range(args.repeats):
                    s = forced_learn(url, threads)
                    print(
                        f"{busy:>4} {threads:>12} {s['threads']:>7} {s['update_s']:>8.2f} {s['cpu_busy_others']:>6.2f}",
                        flush=True,
                    )
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
    print(json.dumps({"storage": url}))


if __name__ == "__main__":
    main()
