"""Warm training (flow `grpo` with `iterations`, as deployment grpo/train runs it): time to target
on the sort task, where each iteration's time goes, learner throughput, and the cold-start cost of
one grpo/iteration run.

    .venv/bin/python benchmarks/warm_training.py [--config benchmarks/sort.yaml] [--iterations 30]
        [--target 0.95] [--seeds 0 1 2] [--set learn.lr=1e-3 ...] [--demo-iterations 8]

It starts a Prefect server on 127.0.0.1 (temporary home, SQLite), then
1. per seed, trains run `sort-s<seed>` warm from scratch and reports the wall-clock seconds from the
   flow call (run creation, model build and engine start included) until the held-out greedy exact
   match first reaches --target;
2. per iteration, from the manifests' commit times and the stages' own timers: generation
   (rollouts + eval decoding), learner compute (old/ref log-prob forwards, forward/backward/AdamW),
   and the rest, the overhead (Prefect tasks, storage, hashing, rewards, advantages, checkpoint save),
   then that overhead per stage: before it starts (task run, inputs) and inside it (its own I/O);
3. at the default (demo) config: the same overhead, learner tokens/s and the fraction of the learn
   stage outside forward/backward/optimizer, then one more iteration in a new process (a cold
   grpo/iteration run: interpreter, imports, engine start, model loads) against a warm one.
"""

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


from timing import committed_at, manifests, print_stage_overheads, stage_overheads  # noqa: E402


def iteration_times(url: str, run_id: str, iterations: range, start: float) -> list[dict]:
    """Per iteration: wall (previous eval commit -> this eval commit), generation, learner compute."""
    rows, prev = [], start
    for k in iterations:
        m = manifests(url, run_id, k)
        ro, le, ev = m["rollouts"].summary, m["learn"].summary, m["eval"].summary
        wall = committed_at(m["eval"]) - prev
        generate = ro["generate_s"] + ev["generate_s"]
        learner = le["score_s"] + le["update_s"]
        learn_wall = committed_at(m["learn"]) - committed_at(m["advantages"])
        rows.append(
            {
                "iteration": k,
                "wall": wall,
                "generate": generate,
                "learner": learner,
                "overhead": wall - generate - learner,
                "engine": ro["engine_s"] + ev["engine_s"],
                "learn_wall": learn_wall,
                "tokens": le["tokens"],
                "update_s": le["update_s"],
                "exact": ev["exact_match"],
                "reward": m["advantages"].summary["reward_mean"],
                "eval_at": committed_at(m["eval"]),
            }
        )
        prev = committed_at(m["eval"])
    return rows


def print_iterations(rows: list[dict]) -> None:
    print(
        f"{'iter':>4} {'reward':>6} {'exact':>5} {'wall_s':>6} {'gen_s':>6} {'learn_s':>7} {'other_s':>7} {'other%':>6}"
    )
    for r in rows:
        print(
            f"{r['iteration']:>4} {r['reward']:>6.3f} {r['exact']:>5.3f} {r['wall']:>6.2f} {r['generate']:>6.2f} "
            f"{r['learner']:>7.2f} {r['overhead']:>7.2f} {100 * r['overhead'] / r['wall']:>5.1f}%"
        )


def train_warm(url: str, run_id: str, iterations: int, config: str | None, overrides: list[str]) -> float:
    """Create the run and train `iterations` warm iterations in this process; returns the start time."""
    from flows.grpo import grpo

    start = time.time()
    grpo(run_id=run_id, iterations=iterations, config_path=config, overrides=overrides, storage_url=url)
    return start


def server_cpu_s(server) -> float:
    """CPU seconds the Prefect server's processes have used so far (it shares the machine's cores)."""
    import psutil

    port = server.api_url.rsplit(":", 1)[1].split("/")[0]
    total = 0.0
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "server" in cmd and "start" in cmd and port in cmd:
            for q in [p] + p.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    total += sum(q.cpu_times()[:2])
    return total


def cold_iteration(url: str, run_id: str, env: dict) -> float:
    """One grpo/iteration flow run in a new process; returns its wall seconds."""
    code = f"from flows.grpo import grpo\nif __name__ == '__main__':\n    grpo(run_id={run_id!r}, storage_url={url!r})"
    start = time.time()
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, capture_output=True)
    return time.time() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "benchmarks" / "sort.yaml"))
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--demo-iterations", type=int, default=8, help="warm iterations at the demo size")
    args = p.parse_args()

    from tools.prefect_server import prefect_server

    tmp = Path(tempfile.mkdtemp(prefix="grpo-warm-bench-"))
    url = (tmp / "store").as_uri()
    with prefect_server(tmp / "prefect") as server:
        os.environ.update({k: v for k, v in server.env.items() if k.startswith("PREFECT_")})

        hits, all_rows, cpu0 = [], [], server_cpu_s(server)
        for seed in args.seeds:
            run_id = f"sort-s{seed}"
            start = train_warm(url, run_id, args.iterations, args.config, args.set + [f"seed={seed}"])
            rows = iteration_times(url, run_id, range(args.iterations), start)
            all_rows.append(rows)
            print(f"== sort task, warm, seed {seed}, {args.config} {' '.join(args.set)}")
            print_iterations(rows)
            hit = next((r for r in rows if r["exact"] >= args.target), None)
            hits.append(hit and hit["eval_at"] - start)
            print(
                f"seed {seed}: time to greedy exact match >= {args.target}: "
                + (
                    f"{hit['eval_at'] - start:.1f} s (iteration {hit['iteration']})"
                    if hit
                    else f"not reached in {args.iterations} iterations ({rows[-1]['eval_at'] - start:.1f} s, "
                    f"best {max(r['exact'] for r in rows):.2f})"
                ),
                flush=True,
            )
        reached = sorted(h for h in hits if h is not None)
        print(
            f"time to exact match >= {args.target}: {len(reached)}/{len(hits)} seeds reached it"
            + (f", median {reached[len(reached) // 2]:.1f} s, max {reached[-1]:.1f} s" if reached else "")
        )
        server_cpu = (server_cpu_s(server) - cpu0) / sum(len(rows) for rows in all_rows)
        steady = [r for rows in all_rows for r in rows[1:]]
        print(
            f"warm iteration overhead (iterations 1.., all seeds): "
            f"{100 * sum(r['overhead'] for r in steady) / sum(r['wall'] for r in steady):.1f}% of "
            f"{sum(r['wall'] for r in steady) / len(steady):.2f} s (engine start / weight reloads: iteration 0 "
            f"{all_rows[0][0]['engine']:.2f} s, later {sum(r['engine'] for r in steady) / len(steady):.3f} s); "
            f"the Prefect server used {1000 * server_cpu:.0f} ms of CPU an iteration"
        )

        print_stage_overheads(stage_overheads(url, f"sort-s{args.seeds[0]}", range(1, args.iterations)))

        demo = train_warm(url, "demo", args.demo_iterations, None, [])
        drows = iteration_times(url, "demo", range(args.demo_iterations), demo)
        print(f"== demo size (default config), iterations 1..{args.demo_iterations - 1}")
        print_iterations(drows)
        print_stage_overheads(stage_overheads(url, "demo", range(1, args.demo_iterations)))
        drows = drows[1:]
        tokens, update = sum(r["tokens"] for r in drows), sum(r["update_s"] for r in drows)
        outside = 1 - sum(r["learner"] for r in drows) / sum(r["learn_wall"] for r in drows)
        warm_wall = sum(r["wall"] for r in drows) / len(drows)
        cold_wall = cold_iteration(url, "demo", os.environ.copy())
        print(
            f"warm iteration overhead: {100 * sum(r['overhead'] for r in drows) / sum(r['wall'] for r in drows):.1f}%"
            f" of {warm_wall:.2f} s"
        )
        print(
            f"learner: {tokens / update:.0f} response tokens/s in forward/backward/AdamW; "
            f"{100 * outside:.1f}% of the learn stage outside forward/backward/optimizer"
        )
        print(
            f"warm iteration {warm_wall:.2f} s; cold grpo/iteration in a new process {cold_wall:.2f} s: "
            f"cold start costs {cold_wall - warm_wall:.2f} s ({cold_wall / warm_wall:.1f}x the warm iteration)"
        )


if __name__ == "__main__":
    main()
