"""Where a warm iteration's time goes, read from the committed manifests (no extra timers).

Each manifest holds when its attempt started and committed and the stage's own compute timers
(`generate_s`, `score_s`, `update_s`), so any run's storage can be analysed after the fact.
"""

import os
import platform
from datetime import datetime
from pathlib import Path

from grpo.record.layout import stage_dir
from grpo.record.storage import latest_committed, open_storage
from stages import STAGES


def manifests(url: str, run_id: str, iteration: int) -> dict:
    storage = open_storage(url)
    return {
        s: latest_committed(storage, stage_dir(storage, run_id, iteration, s), verify=False).manifest for s in STAGES
    }


def committed_at(manifest) -> float:
    return datetime.fromisoformat(manifest.committed_at).timestamp()


COMPUTE = {"rollouts": ("generate_s",), "learn": ("score_s", "update_s"), "eval": ("generate_s",)}


def stage_overheads(url: str, run_id: str, iterations: range) -> dict[str, tuple[float, float]]:
    """Per stage, mean seconds (before, inside): from the previous stage's commit to this stage's
    start (the Prefect task run, reading and verifying inputs), and from its start to its commit
    minus its sampling or learner compute (its own reads, writes, hashing, scoring, reloads)."""
    sums = {s: [0.0, 0.0] for s in STAGES}
    prev = manifests(url, run_id, iterations[0] - 1)["eval"]
    for k in iterations:
        m = manifests(url, run_id, k)
        for s in STAGES:
            started = datetime.fromisoformat(m[s].started_at).timestamp()
            compute = sum(m[s].summary[key] for key in COMPUTE.get(s, ()))
            sums[s][0] += started - committed_at(prev)
            sums[s][1] += committed_at(m[s]) - started - compute
            prev = m[s]
    return {s: (before / len(iterations), inside / len(iterations)) for s, (before, inside) in sums.items()}


def print_stage_overheads(overheads: dict[str, tuple[float, float]]) -> None:
    print(f"{'stage':>10} {'before_ms':>9} {'inside_ms':>9}   (mean overhead of a warm iteration)")
    for s, (before, inside) in overheads.items():
        print(f"{s:>10} {1000 * before:>9.1f} {1000 * inside:>9.1f}")
    print(
        f"{'total':>10} {1000 * sum(b for b, _ in overheads.values()):>9.1f} "
        f"{1000 * sum(i for _, i in overheads.values()):>9.1f}"
    )


def machine() -> str:
    """The OS, architecture, CPU model and core count: the line a benchmark's figures belong to."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor() or platform.machine(),
    )
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores"
