"""docs/scaling.md's long-tail model (issue 42 item 5): rollouts time of one iteration with and without a token
budget (rollout.segment_tokens B), at 7B and 70B, from docs/scaling.md's roofline and an assumed length distribution.
Arithmetic, not measurement: nothing here runs a model.

    .venv/bin/python benchmarks/tail_model.py [--median 2000] [--p99 16384] [--cap 16384] [--budget 2048]

Lengths: log-normal with the given median and 99th percentile, cut at the cap (rollout.max_tokens): a reasoning
model's (docs/scaling.md, "A long tail"). An engine decodes its sequences by continuous batching, at most 256 in
flight (A4); a step costs t(b, c) = max((W + b c kv) / BW, 2 N b / F) per GPU (docs/scaling.md, "Sampling tokens/s"),
b the sequences in flight and c their mean context. Without a budget an engine's iteration is every response of its
share sampled to its end. With a budget B, in the steady state an iteration samples, for each response of its share
of new prompts, the B-token segments of all responses then in flight: as many segments, of the same lengths, as the
B-token pieces of one iteration's responses (each piece of a response in the iteration of its age), each continued
from its context so far.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random

# (N, W per engine GPU, kv per token per GPU, GPUs an engine): docs/scaling.md's three shapes at TP=1 and TP=8
SHAPES = {"7B": (7.616e9, 15.2e9, 57_344, 1), "70B": (70.55e9, 141.1e9 / 8, 327_680 / 8, 8)}
F, BW, SEQS, PROMPT = 396e12, 2.4e12, 256, 256


def lengths(n: int, median: float, p99: float, cap: int, rng: random.Random) -> list[int]:
    s = math.log(p99 / median) / 2.326
    return [max(1, min(cap, round(rng.lognormvariate(math.log(median), s)))) for _ in range(n)]


def engine_seconds(jobs: list[tuple[int, int]], shape: str) -> float:
    """Seconds for one engine to decode `jobs` (context before, tokens to sample), continuous batching: each step
    advances every sequence in flight by a token; a finished one makes room for the next queued."""
    n, w, kv, tp = SHAPES[shape]
    queue, flight, t, step = list(jobs), [], 0.0, 0  # flight: (step it ends, its context at start, start step)
    while queue or flight:
        while queue and len(flight) < SEQS:
            before, k = queue.pop()
            heapq.heappush(flight, (step + k, before, step))
        ends = flight[0][0]  # advance to the next end in one go: b constant meanwhile
        b, ctx = len(flight), sum(c + (step - s0) for _, c, s0 in flight) / len(flight)
        mid = ctx + (ends - step) / 2  # mean context over those steps
        t += (ends - step) * max((w + b * mid * kv) / BW, 2 * n / tp * b / F)
        step = ends
        while flight and flight[0][0] == step:
            heapq.heappop(flight)
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--median", type=float, default=2000)
    p.add_argument("--p99", type=float, default=16384)
    p.add_argument("--cap", type=int, default=16384)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--samples", type=int, default=4096, help="an iteration's responses (512 prompts x 8)")
    args = p.parse_args()
    rng = random.Random(0)
    ls = lengths(args.samples, args.median, args.p99, args.cap, rng)
    q = sorted(ls)
    mean = sum(ls) / len(ls)
    print(f"lengths: median {q[len(q) // 2]}, p99 {q[int(0.99 * len(q))]}, mean {mean:.0f}, "
          f"at the cap {sum(x >= args.cap for x in ls) / len(ls):.1%}, tokens {sum(ls):,}")  # fmt: skip
    b = args.budget
    segments = [(PROMPT + a, min(b, x - a)) for x in ls for a in range(0, x, b)]
    print(f"budget {b}: {len(segments):,} segments an iteration (steady state), oldest token "
          f"{math.ceil(args.cap / b) - 1} iterations older than its release")  # fmt: skip
    learn_tokens = sum(ls) + args.samples // 8 * PROMPT
    print("| | GPUs | rollouts on all, no budget / B | learn on all | taking turns: r + l, no budget / B | two pools, "
          "S = 1, each its best split (sampling + learning GPUs): max(r, l), no budget / B |")  # fmt: skip
    for shape in ("7B", "70B"):
        tp = SHAPES[shape][3]
        gpus = 8 * tp
        r = {e: rollouts(ls, segments, e, shape) for e in range(1, 9)}
        learn = {g: 10 * SHAPES[shape][0] * learn_tokens / (F * g) for g in range(tp, gpus + 1, tp)}
        turns = [x + learn[gpus] for x in r[8]]
        best = [min((max(r[e][i], learn[gpus - e * tp]), e) for e in range(1, 8)) for i in (0, 1)]
        split = [f"{t:.0f} s ({e * tp} + {gpus - e * tp})" for t, e in best]
        print(f"| {shape} | {gpus} | {r[8][0]:.0f} / {r[8][1]:.0f} s | {learn[gpus]:.0f} s | {turns[0]:.0f} / "
              f"{turns[1]:.0f} s ({turns[0] / turns[1]:.2f}x) | {split[0]} / {split[1]} "
              f"({best[0][0] / best[1][0]:.2f}x) |")  # fmt: skip


def rollouts(ls: list[int], segments: list[tuple[int, int]], engines: int, shape: str) -> tuple[float, float]:
    """(without a budget, with it): the slowest of `engines` engines, each a 1/engines share of the responses."""
    plain = max(engine_seconds([(PROMPT, x) for x in ls[i::engines]], shape) for i in range(engines))
    return plain, max(engine_seconds(segments[i::engines], shape) for i in range(engines))


if __name__ == "__main__":
    main()
