"""Peak memory of the rollouts stage against the number of samples; streaming should keep it flat.

    .venv/bin/python benchmarks/rollout_memory.py [--prompts 1250 12500] [--group-size 8] [--max-tokens 4]
        [--backend vllm] [--chunk-prompts 512] [--storage DIR]

Each size is a new run (init + snapshot here), then the real rollouts stage of iteration 0 in a fresh
subprocess. Columns: the subprocess's peak RSS (its own ru_maxrss), the peak RSS of its whole process
tree (polled, counts a separate vLLM engine process), its RSS after the first and after the last chunk
(growth_MiB, their difference: memory kept from chunk to chunk), and the Parquet file's size and row
groups. Last, the peak RSS of the smallest and the largest run and their ratio: streaming keeps it ~1.
"""

import argparse
import json
import logging
import resource
import subprocess
import sys
import tempfile
import time

import psutil
import pyarrow.parquet as pq

from grpo.config import load_config
from grpo.record.storage import open_storage
from stages.init import init_run
from stages.snapshot import snapshot


def run_rollouts(storage_url: str, run_id: str) -> dict:
    """Child: the rollouts stage, with this process's RSS recorded at each chunk's progress line."""
    from stages.rollouts import rollouts

    rss_mib = []

    class ChunkRSS(logging.Handler):
        def emit(self, record):
            if record.getMessage().endswith(" prompts"):  # the stage's progress line after each chunk
                rss_mib.append(psutil.Process().memory_info().rss / 2**20)

    log = logging.getLogger("grpo.progress")
    log.setLevel(logging.INFO)
    log.addHandler(ChunkRSS())
    t = time.perf_counter()
    out = rollouts(open_storage(storage_url), run_id, 0)
    path = out.path("rollouts.parquet")
    meta = pq.ParquetFile(out.storage.fs.open(path, "rb")).metadata
    return {
        "seconds": time.perf_counter() - t,
        "samples": meta.num_rows,
        "row_groups": meta.num_row_groups,
        "parquet_mib": out.storage.fs.size(path) / 2**20,
        "chunk_rss_mib": rss_mib,
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
    }  # linux: KiB


def peak_tree_rss(proc: subprocess.Popen, every_s: float = 0.05) -> float:
    """Poll the RSS of `proc` and its descendants until it exits; the peak sum, in MiB."""
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [root] + root.children(recursive=True)
            peak = max(peak, sum(p.memory_info().rss for p in tree))
        except psutil.NoSuchProcess:
            pass
        time.sleep(every_s)
    return peak / 2**20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, nargs="+", default=[1250, 12500], help="prompts per run, one run each")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    p.add_argument("--chunk-prompts", type=int, default=None, help="default: rollout.chunk_prompts of the config")
    p.add_argument("--storage", default=None, help="default: a temporary folder")
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)  # STORAGE_URL RUN_ID
    args = p.parse_args()
    if args.child:
        print(json.dumps(run_rollouts(*args.child)))
        return
    storage = open_storage(args.storage or tempfile.mkdtemp(prefix="grpo-bench-"))
    print(
        f"storage {storage.url}\n{'samples':>8} {'prompts':>7} {'seconds':>8} {'maxrss_MiB':>10} {'tree_MiB':>8} "
        f"{'rss_1st_chunk':>13} {'rss_last_chunk':>14} {'growth_MiB':>10} {'parquet_MiB':>11} {'row_groups':>10}"
    )
    peaks = {}  # samples -> (maxrss, tree) in MiB
    for n in args.prompts:
        run_id = f"mem-{n}"
        overrides = [
            f"rollout.backend={args.backend}",
            f"rollout.prompts_per_iteration={n}",
            f"rollout.group_size={args.group_size}",
            f"rollout.max_tokens={args.max_tokens}",
            # the learner does not run here, but the batch must split into its minibatches
            f"learn.minibatch_size={args.group_size}",
            f"learn.microbatch_size={args.group_size}",
        ]
        if args.chunk_prompts:
            overrides.append(f"rollout.chunk_prompts={args.chunk_prompts}")
        init_run(storage, run_id, load_config(None, overrides))
        snapshot(storage, run_id, 0)
        child = subprocess.Popen(
            [sys.executable, __file__, "--child", storage.url, run_id], stdout=subprocess.PIPE, text=True
        )
        tree = peak_tree_rss(child)
        out, _ = child.communicate()
        if child.returncode:
            sys.exit(f"rollouts of {run_id} failed (exit {child.returncode})")
        r = json.loads(out.strip().splitlines()[-1])
        first, last = r["chunk_rss_mib"][0], r["chunk_rss_mib"][-1]
        peaks[r["samples"]] = r["maxrss_mib"], tree
        print(
            f"{r['samples']:>8} {n:>7} {r['seconds']:>8.1f} {r['maxrss_mib']:>10.0f} {tree:>8.0f} "
            f"{first:>13.0f} {last:>14.0f} {last - first:>+10.0f} {r['parquet_mib']:>11.2f} "
            f"{r['row_groups']:>10}",
            flush=True,
        )
    if len(peaks) > 1:
        (lo, (lo_rss, lo_tree)), (hi, (hi_rss, hi_tree)) = min(peaks.items()), max(peaks.items())
        print(f"\npeak RSS {'':>8} {lo:>8} samples {hi:>8} samples  ratio (target ~1)")
        print(f"{'process':>17} {lo_rss:>8.0f} MiB {hi_rss:>12.0f} MiB  {hi_rss / lo_rss:>5.2f}")
        print(f"{'process tree':>17} {lo_tree:>8.0f} MiB {hi_tree:>12.0f} MiB  {hi_tree / lo_tree:>5.2f}")


if __name__ == "__main__":
    main()
