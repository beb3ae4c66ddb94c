"""Train the tiny sort model for N iterations of the six stages; print reward and greedy exact match.

    .venv/bin/python benchmarks/sort_convergence.py --iterations 30 [--config benchmarks/sort.yaml]
        [--set rollout.backend=hf] [--storage DIR]

Each line is one iteration: mean sampled reward, held-out greedy exact match and reward,
the AdamW steps and samples so far, the wall time of the iteration's stages and the share of it
outside sampling and learner compute (the stages' own overhead, without Prefect). The last lines
say when exact match first reached --target and the mean overhead of iterations 1..., and
that overhead per stage (benchmarks/timing.py).
"""

import argparse
import tempfile
import time

from timing import print_stage_overheads, stage_overheads

from grpo.config import load_config_file
from grpo.record.storage import open_storage
from stages.init import init_run
from stages.iteration import run_warm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--config", default="benchmarks/sort.yaml")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--storage", default=None, help="default: a temporary folder")
    p.add_argument("--target", type=float, default=0.95)
    args = p.parse_args()
    storage = open_storage(args.storage or tempfile.mkdtemp(prefix="grpo-bench-"))
    init_run(storage, "bench", load_config_file(args.config, args.set))
    print(
        f"storage {storage.url}\n{'iter':>4} {'reward':>7} {'eval_exact':>10} {'eval_reward':>11} "
        f"{'steps':>6} {'samples':>8} {'seconds':>8} {'other%':>6}"
    )
    start, steps, samples, hit, exact, walls, others = time.time(), 0, 0, None, [], [], []
    t = time.time()
    for k, out in run_warm(storage, "bench", 0, args.iterations):  # warm, as `grpo run`
        wall = time.time() - t
        ev, le, ro = (out[s].manifest.summary for s in ("eval", "learn", "rollouts"))
        other = wall - ro["generate_s"] - ev["generate_s"] - le["score_s"] - le["update_s"]
        walls, others = walls + [wall] * (k > 0), others + [other] * (k > 0)
        steps, samples = steps + le["steps"], samples + le["samples"]
        print(
            f"{k:>4} {out['advantages'].manifest.summary['reward_mean']:>7.3f} {ev['exact_match']:>10.3f} "
            f"{ev['reward_mean']:>11.3f} {steps:>6} {samples:>8} {wall:>8.2f} {100 * other / wall:>5.1f}%",
            flush=True,
        )
        exact.append(ev["exact_match"])
        if hit is None and ev["exact_match"] >= args.target:
            hit = (k, steps, samples, time.time() - start)
        t = time.time()
    print(
        f"total {time.time() - start:.0f} s; exact match >= {args.target}: "
        + (
            f"iteration {hit[0]} ({hit[1]} AdamW steps, {hit[2]} samples, {hit[3]:.0f} s)"
            if hit
            else f"not reached in {args.iterations} iterations ({steps} AdamW steps, {samples} samples; "
            f"best {max(exact):.2f}, last {exact[-1]:.2f})"
        )
    )
    if walls:
        print(
            f"stage overhead (iterations 1..): {1000 * sum(others) / len(others):.0f} ms, "
            f"{100 * sum(others) / sum(walls):.1f}% of {sum(walls) / len(walls):.2f} s"
        )
        print_stage_overheads(stage_overheads(storage.url, "bench", range(1, len(walls) + 1)))


if __name__ == "__main__":
    main()
