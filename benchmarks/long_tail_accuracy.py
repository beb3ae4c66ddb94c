"""Held-out accuracy at equal finished samples with and without partial rollouts, over more seeds than long_tail.py's
timed rounds can afford (issue 42's Done-when: "within the run-to-run spread").

    .venv/bin/python benchmarks/long_tail_accuracy.py [--seeds 0 1 2 3 4] [--iterations 12] [--prompts 48]
        [--segment-tokens 32] [--staleness 1] [--warm-model WORK/model] [--set SECTION.FIELD=VALUE ...] [--dir DIR]

The recipe and the arms are long_tail.py's (the same world, config and warm start), run here in one process, one
iteration after the other (stages.iteration.run_iteration), not on the pinned pools: which rows a learn trains on is
fixed by the config and the seed alone, never by timing, so a run here trains on what the same run on the pools
does, and its accuracy is that run's. No timing is reported: the script is for accuracy only, and runs beside other
work. Per seed, the unsegmented run's held-out greedy accuracy after its last learn, against the segmented run's at the
iteration where its finished samples (the rows its learns took) reach as many (long_tail.at_equal_samples); then the
spread of each arm over the seeds, and of the paired differences.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from long_tail import STALENESS, at_equal_samples, make_world, probe, world_options
from placement_overhead import load
from timing import machine


def run(url: str, run_id: str, overrides: list[str], iterations: int) -> dict:
    """One arm's run, iteration after iteration in this process: per iteration the rows its learn took and the held-out
    accuracy after it."""
    from grpo.config import load_config
    from grpo.record.layout import stage_dir
    from grpo.record.storage import latest_committed, open_storage
    from stages.init import init_run
    from stages.iteration import run_iteration

    storage = open_storage(url)
    init_run(storage, run_id, load_config(None, overrides))
    released, accuracy = [], []
    for k in range(iterations):
        run_iteration(storage, run_id, k)

        def summary(stage: str, k: int = k) -> dict:
            return latest_committed(storage, stage_dir(storage, run_id, k, stage)).manifest.summary

        released.append(summary("rollouts")["samples"])
        accuracy.append(summary("eval")["exact_match"])
    return {"id": run_id, "released": released, "accuracy": accuracy}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="run seeds, a pair of runs each")
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--segment-tokens", type=int, default=32)
    p.add_argument("--staleness", type=int, default=1)
    world_options(p)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    from grpo.runtime.threads import apply_threads

    apply_threads()
    t0 = time.time()
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="grpo-long-tail-accuracy-"))
    tmp.mkdir(parents=True, exist_ok=True)
    url = (tmp / "store").as_uri()
    print(f"machine: {machine()}; load average {load()}; folder {tmp}", flush=True)
    base = make_world(tmp, args) + args.set
    print(f"world made in {time.time() - t0:.0f} s; overrides: {' '.join(base)}", flush=True)
    if not args.warm_model:
        print(f"probe, the warm model's response lengths (64 prompts x 4, temperature 1): {probe(base)}", flush=True)
    s, pairs = args.staleness, []
    for seed in args.seeds:
        arms = []
        for b in (None, args.segment_tokens):
            seg = [] if b is None else [f"rollout.segment_tokens={b}"]
            overrides = [*base, f"rollout.staleness={s}", *STALENESS[s], *seg, f"seed={seed}"]
            arms.append(run(url, f"s{s}-{'seg' if b else 'plain'}-{seed}", overrides, args.iterations))
            print(f"  {arms[-1]}", flush=True)
        pairs.append(arms)
        (tmp / "runs.json").write_text(json.dumps(pairs))
    report(pairs)
    print(f"\n{time.time() - t0:.0f} s in all; load average now {load()}")


def report(pairs: list[list[dict]]) -> None:
    print("\n| seed | finished samples | accuracy without (at as many) | with (its iteration there) | with - "
          "without |\n|" + " --- |" * 5)  # fmt: skip
    plain, seg = [], []
    for x, y in pairs:
        n, k, a, b = at_equal_samples(x, y)
        plain.append(a)
        seg.append(b)
        print(f"| {x['id'].rsplit('-', 1)[1]} | {n} | {a:.3f} | {b:.3f} ({k}) | {b - a:+.3f} |")
    diffs = [b - a for a, b in zip(plain, seg)]
    for name, xs in (("without", plain), ("with", seg), ("with - without", diffs)):
        spread = f", sd {statistics.stdev(xs):.3f}" if len(xs) > 1 else ""
        print(f"{name}: mean {statistics.mean(xs):+.3f}, min {min(xs):+.3f}, max {max(xs):+.3f}{spread}")


if __name__ == "__main__":
    sys.exit(main())
