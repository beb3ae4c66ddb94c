"""Train the tiny sort model for N iterations of the six stages; print reward and greedy exact match.

    .venv/bin/python benchmarks/sort_convergence.py --iterations 30 [--config benchmarks/sort.yaml]
        [--set rollout.backend=hf] [--storage DIR]

Each line is one iteration: mean sampled reward, held-out greedy exact match and reward,
and the wall time of the iteration's stages.
"""
import argparse
import tempfile
import time

from grpo.cli import run_iteration
from grpo.config import load_config_file
from grpo.storage import open_storage
from stages.init import init_run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--config", default="benchmarks/sort.yaml")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--storage", default=None, help="default: a temporary folder")
    args = p.parse_args()
    storage = open_storage(args.storage or tempfile.mkdtemp(prefix="grpo-bench-"))
    init_run(storage, "bench", load_config_file(args.config, args.set))
    print(f"storage {storage.url}\n{'iter':>4} {'reward':>7} {'eval_exact':>10} {'eval_reward':>11} {'seconds':>8}")
    start = time.time()
    for k in range(args.iterations):
        t = time.time()
        out = run_iteration(storage, "bench", k)
        ev = out["eval"].manifest.summary
        print(f"{k:>4} {out['advantages'].manifest.summary['reward_mean']:>7.3f} {ev['exact_match']:>10.3f} "
              f"{ev['reward_mean']:>11.3f} {time.time() - t:>8.1f}", flush=True)
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
