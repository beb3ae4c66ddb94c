"""Generation's long tail (issue 42 item 5): iterations per hour of a chat recipe whose responses are mostly short
and sometimes run to rollout.max_tokens, with and without partial rollouts (rollout.segment_tokens), at S = 1 and
S = 0 on the two pinned pools of overlap.py; held-out accuracy at equal finished samples.

    .venv/bin/python benchmarks/long_tail.py [--prompts 48] [--iterations 12] [--rounds 2] [--segment-tokens 32]
        [--staleness 1 0]
        [--warm-model WORK/model] [--set SECTION.FIELD=VALUE ...] [--dir DIR]

The recipe: chat_math.py's word problems and Qwen2 chat model (4 layers, hidden 128, a BPE trained here), warm-started
on answers of two lengths so that its length distribution has a tail: most solutions are the short "a + b = c. The
answer is c." (about 15 tokens); a `--long-share` (10%) of the warm-start solutions first ramble, "Let me check." a
number of times drawn uniformly from 20..100 (about 80-400 tokens), then give the same solution. Short and long
solutions are seen in batches of their own (32 short, 8 long: a batch pads to its longest); the model learns to
start a long answer at about that share of its samples and to end the rambling at a rate, not a count, so sampled
at temperature 1 its long answers spread out and a part run to max_tokens (256): the length distribution is printed
before the runs (probe) and again from the runs' rollouts. Every response of every prompt may ramble, as a reasoning
model's length varies within a prompt's group, so a group waits for its slowest member.

Each arm is a run of its own on the same two warm stage workers (overlap.py: "sampling" pinned to core 0 serves
snapshot, rollouts, rewards, advantages and eval; "learning" pinned to core 1 serves learn; one thread each; a Prefect
server on a temporary PREFECT_HOME, stopped with the workers, workers first); the arms alternate within a round, round
r uses run seed r in every arm (so the rounds give the run-to-run spread, and the arms of a round are paired). S = 1
runs with learn.behavior_correction=tis. Figures from the manifests, iterations 1..:
- period: learn k-1's commit to learn k's; iterations per hour = 3600 / period (median over the run's iterations);
- rollouts: the rollouts stage's start to commit (sampler seconds per iteration, generate_s beside it);
- finished samples per hour: the rows the learns took (rollouts' `samples`), over the time from learn 0 to the last;
- held-out greedy accuracy (the eval stage's exact_match, every iteration) at equal finished samples: each
  segmented run's iteration where its released samples reach the unsegmented run's total of the same round and
  seed, else the nearest below.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
from chat_math import (  # noqa: F401 (NAMES, THINGS: the problems' words)
    NAMES,
    SYSTEM,
    THINGS,
    math_task,
    problem,
    solution,
)
from overlap import POOLS, STALENESS, pinned_workers, run_one
from placement_overhead import load, ts
from timing import committed_at, machine, manifests

RAMBLE = "Let me check. "


def long_solution(row: dict, rng: random.Random) -> str:
    """A rambling solution: RAMBLE a uniform 10..70 times, then the short one."""
    return RAMBLE * rng.randint(10, 70) + solution(row)


def chat_pair(tok, question: str, answer: str) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids): the chat template's system and user turns, then `answer` + <|im_end|>."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tuple(tok(text, add_special_tokens=False)["input_ids"] for text in (prompt, answer + "<|im_end|>"))


def supervised(model_dir: str, tok, steps: int, lr: float, next_batch, loss, device: str = "cpu") -> None:
    """`steps` AdamW steps at `lr` on the model in `model_dir`, saved back there: each on `next_batch()`'s (prompt
    ids, response ids) pairs, right-padded, `loss(model, ids, labels, mask)` on the responses only (this recipe's
    loss, per solution: not the token mean `grpo sft` trains with)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    t0 = shown = time.time()
    for step in range(steps):
        batch = next_batch()
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id)  # (B, T)
        labels = torch.full((len(batch), width), -100)  # (B, T): -100 but on the response
        for i, (p, a) in enumerate(batch):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
        ids, labels = ids.to(device), labels.to(device)
        mask = (labels != -100) | (ids != tok.pad_token_id)
        value = loss(model, ids, labels, mask)
        value.backward()
        opt.step()
        opt.zero_grad()
        if time.time() - shown >= 20 or step + 1 == steps:  # a line every 20 s: the estimate from the pace so far
            per_step = (time.time() - t0) / (step + 1)
            print(
                f"warm start: step {step + 1}/{steps}, loss {value.item():.3f}, {per_step:.2f} s a step, "
                f"~{per_step * (steps - step - 1) / 60:.1f} min left",
                flush=True,
            )
            shown = time.time()
    model.save_pretrained(model_dir)


def solution_nll(model, ids, labels, mask, per_example: bool):
    """The loss on the solutions (`labels` not -100; (B, T) each): a token mean over the batch, or `per_example` each
    solution's tokens summed, / 16 (a short one's length), then the mean over solutions."""
    import torch

    logits = model(input_ids=ids, attention_mask=mask).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")
    # per example, a long solution's first token weighs what a short one's does (a batch's token mean gave rambles'
    # starts ~1/4 their share)
    return nll.sum(1).mean() / 16 if per_example else nll.sum() / (labels != -100).sum()


def warm_start(model_dir: str, rows: list[dict], steps: int, lr: float, seed: int, long_share: float,
               per_example: bool) -> None:  # fmt: skip
    """Supervised steps on (chat prompt, solution + <|im_end|>) (chat_math.py's, on the CPU), loss on the response
    only; batches of 32 short or 8 long solutions, long ones drawn so that `long_share` of the solutions seen are
    long; the loss `solution_nll`'s."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    long_batches = long_share * 32 / (8 * (1 - long_share) + long_share * 32)  # share of steps that are long

    def next_batch() -> list[tuple[list[int], list[int]]]:
        long = rng.random() < long_batches
        drawn = rng.sample(rows, 8 if long else 32)
        return [chat_pair(tok, r["question"], long_solution(r, rng) if long else solution(r)) for r in drawn]

    supervised(model_dir, tok, steps, lr, next_batch, functools.partial(solution_nll, per_example=per_example))


def make_world(work: Path, args) -> list[str]:
    """Problems, the warm-started model (or a copy of --warm-model) and a reward-free config: the runs' overrides."""
    import shutil

    from grpo.tiny_model import build_chat_model

    rng = random.Random(args.seed)
    rows = list({r["question"]: r for r in (problem(rng, 9) for _ in range(2000))}.values())
    pd.DataFrame(rows)[["question", "answer"]].to_parquet(work / "problems.parquet")
    model = str(work / "model")
    overrides = [
        *math_task(model, work / "problems.parquet"),
        "eval.split_fraction=0.2",
        f"eval.n_prompts={args.eval_prompts}",
        "rollout.backend=hf",
        f"rollout.prompts_per_iteration={args.prompts}",
        "rollout.group_size=4",
        f"rollout.chunk_prompts={args.prompts}",
        f"rollout.max_tokens={args.max_tokens}",
        "learn.minibatch_size=16",  # whole minibatches of 4 groups: what a segmented iteration releases
        "learn.microbatch_size=16",
        "learn.lr=3e-4",
        "learn.epochs=1",
        "reward.truncated_reward=0",
        "learn.mixed_precision=no",
    ]
    if args.warm_model:
        shutil.copytree(args.warm_model, model)
        return overrides
    texts = [f"{SYSTEM} {r['question']} {r['answer']} {solution(r)} {RAMBLE * 3}" for r in rows]
    build_chat_model(model, texts, vocab_size=600, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=192, max_position_embeddings=512, seed=args.seed)  # fmt: skip
    from grpo.config import load_config
    from stages.prompts import held_out_split

    train, _ = held_out_split(load_config(None, overrides))
    trained = {e.prompt for e in train}
    train_rows = [r for r in rows if r["question"] in trained]
    warm_start(model, train_rows, args.sft_steps, 3e-3, args.seed, args.long_share, per_example=False)
    warm_start(model, train_rows, args.topup_steps, 1e-3, args.seed + 1, args.long_share, per_example=True)
    return overrides


def probe(overrides: list[str]) -> dict:
    """The warm model's response lengths, sampled as rollouts sample (temperature 1, max_tokens), on 64 training
    prompts x 4: median, p90, p99 and the share that reached max_tokens."""
    from grpo.config import load_config
    from grpo.episodes import templates
    from grpo.sampling.base import SamplingSpec
    from grpo.sampling.hf import HFGenerator
    from stages.prompts import held_out_split

    cfg = load_config(None, overrides)
    train, _ = held_out_split(cfg)
    gen = HFGenerator(cfg.model.base_model)
    _, ids = templates.tokenize_prompts(gen.tokenizer, train[:64], cfg.task.prompt_format, cfg.task.system_prompt)
    t0 = time.time()
    out = gen.generate(ids, SamplingSpec(n=4, temperature=1.0, max_tokens=cfg.rollout.max_tokens, seed=0))
    lengths = [len(s.response_ids) for g in out for s in g]
    return lengths_line(lengths, cfg.rollout.max_tokens) | {"seconds": time.time() - t0}


def lengths_line(lengths: list[int], cap: int) -> dict:
    q = sorted(lengths)
    at = lambda f: q[min(len(q) - 1, int(f * len(q)))]  # noqa: E731
    share = sum(x >= cap for x in q) / len(q)
    return {"n": len(q), "median": at(0.5), "p90": at(0.9), "p99": at(0.99), "at_max": share}


# ---------------------------------------------------------------- reading a run


def read_run(url: str, run_id: str, n: int) -> dict:
    """Per iteration 1..n-1 the period (learn to learn) and the rollouts' span and generate_s; per iteration 0..n-1
    the samples released and the eval's exact_match; finished samples per hour from learn 0's commit to the last."""
    m = [manifests(url, run_id, k) for k in range(n)]
    learn_end = [committed_at(x["learn"]) for x in m]
    roll = [x["rollouts"] for x in m]
    released = [r.summary["samples"] for r in roll]
    return {
        "period": [learn_end[k] - learn_end[k - 1] for k in range(1, n)],
        "rollouts": [committed_at(r) - ts(r.started_at) for r in roll[1:]],
        "generate": [r.summary["generate_s"] for r in roll[1:]],
        "learn": [committed_at(x["learn"]) - ts(x["learn"].started_at) for x in m[1:]],
        "released": released,
        "per_hour": sum(released[1:]) * 3600 / (learn_end[-1] - learn_end[0]),
        "accuracy": [x["eval"].summary.get("exact_match") for x in m],
        "carried": [r.summary.get("responses_carried", 0) for r in roll],
    }


def rollout_lengths(url: str, run_id: str, n: int) -> list[int]:
    """Every released response's length in the run (the rollouts tables)."""
    from grpo.record.layout import stage_dir
    from grpo.record.storage import latest_committed, open_storage
    from schemas import read_parquet, table_file

    storage, out = open_storage(url), []
    for k in range(n):
        c = latest_committed(storage, stage_dir(storage, run_id, k, "rollouts"))
        t = read_parquet(storage.fs, c.read_path(table_file("rollouts")), "rollouts", columns=["response_ids"])
        out += [len(x) for x in t.column("response_ids").to_pylist()]
    return out


def at_equal_samples(plain: dict, seg: dict) -> tuple[int, int, float | None, float | None]:
    """(finished samples compared, segmented run's iteration, accuracy without, accuracy with) at the plain run's
    total finished samples, or the segmented run's nearest below."""
    target, total = sum(plain["released"]), 0
    k = -1
    for i, x in enumerate(seg["released"]):
        if total + x > target:
            break
        total, k = total + x, i
    j = max(i for i in range(len(plain["released"])) if sum(plain["released"][: i + 1]) <= total)
    return total, k, plain["accuracy"][j], seg["accuracy"][k]


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


# ---------------------------------------------------------------- main


def world_options(p: argparse.ArgumentParser) -> None:
    """The options make_world reads (the recipe, its warm start), and --set: more overrides for every arm."""
    p.add_argument("--prompts", type=int, default=48, help="rollout.prompts_per_iteration (G = 4)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--eval-prompts", type=int, default=64)
    p.add_argument("--sft-steps", type=int, default=500)
    p.add_argument("--topup-steps", type=int, default=150, help="then steps of a loss per solution")
    p.add_argument("--long-share", type=float, default=0.1, help="share of warm-start solutions that ramble")
    p.add_argument("--seed", type=int, default=0, help="problems and warm start")
    p.add_argument("--warm-model", default=None, help="a model folder made by an earlier run of the same --seed")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="more overrides, all arms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=12, help="per run; iteration 0 is not counted in the periods")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs every arm once, run seed = the round")
    p.add_argument("--segment-tokens", type=int, default=32)
    p.add_argument("--staleness", type=int, nargs="+", default=[1, 0], help="S values, in this order a round")
    world_options(p)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--dir", default=None)
    p.add_argument("--report", default=None, metavar="RUNS.json", help="print the tables of an earlier run's runs.json")
    args = p.parse_args()
    if args.report:
        return report(json.loads(Path(args.report).read_text()), args)
    if not {0, 1} <= os.sched_getaffinity(0):
        p.error("needs cores 0 and 1 (one a pool)")
    from grpo.runtime.threads import apply_threads
    from tools.prefect_server import prefect_server

    apply_threads()
    t0 = time.time()
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="grpo-long-tail-"))
    tmp.mkdir(parents=True, exist_ok=True)
    url = (tmp / "store").as_uri()
    print(f"machine: {machine()}; load average {load()}; folder {tmp}", flush=True)
    base = make_world(tmp, args) + args.set
    print(f"world made in {time.time() - t0:.0f} s; overrides: {' '.join(base)}", flush=True)
    if not args.warm_model:  # the model made here: its lengths before any run (a copied one's were printed then)
        print(f"probe, the warm model's response lengths (64 prompts x 4, temperature 1): {probe(base)}", flush=True)
    pools = "; ".join(f"{pool} on core {core}: {' '.join(stages)}" for pool, (core, stages) in POOLS.items())
    print(f"pools: {pools}", flush=True)
    runs = []
    with prefect_server(tmp / "prefect") as server, pinned_workers(server, tmp) as workers:
        for s in args.staleness:  # every round of the first S before the next: S = 1 first, the Done-when's
            for rnd in range(args.rounds):
                for b in (None, args.segment_tokens) if rnd % 2 == 0 else (args.segment_tokens, None):  # alternated
                    seg = [] if b is None else [f"rollout.segment_tokens={b}"]
                    overrides = [*base, f"rollout.staleness={s}", *STALENESS[s], *seg, f"seed={rnd}"]
                    runs.append(one_run(server, tmp, url, workers, s, b, rnd, overrides, args))
                    (tmp / "runs.json").write_text(json.dumps(runs))  # what was measured, if stopped later
    report(runs, args)
    print(f"\n{time.time() - t0:.0f} s in all; load average now {load()}")


def one_run(server, tmp: Path, url: str, workers: dict, s: int, b, rnd: int, overrides: list[str], args) -> dict:
    """One arm's run on the pinned workers, read back from its manifests."""
    run_id, before, start = f"s{s}-{'seg' if b else 'plain'}-{rnd}", load(), time.time()
    cpu = run_one(server, tmp, url, workers, run_id, overrides, args.iterations, args.timeout)
    run = {"id": run_id, "S": s, "B": b, "round": rnd, "load": (before, load()), "cpu": cpu}
    run |= read_run(url, run_id, args.iterations)
    run["lengths"] = lengths_line(rollout_lengths(url, run_id, args.iterations), args.max_tokens)
    periods = " ".join(f"{x:.1f}" for x in run["period"])
    print(f"  {run_id}: {time.time() - start:.0f} s; periods {periods}; load {before} -> {run['load'][1]}", flush=True)
    return run


def report(runs: list[dict], args) -> None:
    print("\nper run, iterations 1..: medians (min-max)\n| run | s / iteration | iterations per hour | rollouts s "
          "(generate_s) | learn s | finished samples per hour | released per iteration | accuracy last | lengths "
          "released (median / p90 / p99 / at max) | load before -> after |\n|" + " --- |" * 10)  # fmt: skip
    for r in runs:
        L = r["lengths"]
        print(f"| {r['id']} | {med(r['period'])} | {3600 / statistics.median(r['period']):.0f} | {med(r['rollouts'])} "
              f"({statistics.median(r['generate']):.2f}) | {med(r['learn'])} | {r['per_hour']:.0f} | "
              f"{' '.join(map(str, r['released']))} | {r['accuracy'][-1]:.3f} | {L['median']} / {L['p90']} / "
              f"{L['p99']} / {L['at_max']:.0%} | {r['load'][0]} -> {r['load'][1]} |")  # fmt: skip
    print("\n| S | arm | iterations per hour, median of runs (min-max) | segmented / plain per round | finished "
          "samples per hour | rollouts s | accuracy at equal finished samples (plain / seg, per round) |\n|"
          + " --- |" * 7)  # fmt: skip
    for s in args.staleness:
        for b in (None, args.segment_tokens):
            mine = [r for r in runs if r["S"] == s and r["B"] == b]
            if not mine:
                continue
            iph = [3600 / statistics.median(r["period"]) for r in mine]
            ratio, acc = "", ""
            if b is not None:
                plain = [x for x in runs if x["S"] == s and x["B"] is None]
                pairs = [(x, y) for x in plain for y in mine if x["round"] == y["round"]]
                rs = [3600 / statistics.median(y["period"]) / (3600 / statistics.median(x["period"])) for x, y in pairs]
                ratio = f"{statistics.median(rs):.2f}x ({' / '.join(f'{v:.2f}' for v in rs)})"
                acc = " / ".join("{0} samples: {2:.3f} vs {3:.3f} (iteration {1})".format(*at_equal_samples(x, y))
                                 for x, y in pairs)  # fmt: skip
            print(f"| {s} | {'segment_tokens=' + str(b) if b else 'off'} | {statistics.median(iph):.0f} "
                  f"({min(iph):.0f}-{max(iph):.0f}) | {ratio} | {statistics.median([r['per_hour'] for r in mine]):.0f} "
                  f"| {med([statistics.median(r['rollouts']) for r in mine])} | {acc} |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
