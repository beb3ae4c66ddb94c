"""GRPO on a small chat model and GSM8K-style word problems, the real path at toy size; prints
held-out accuracy before GRPO and after each iteration.

    .venv/bin/python benchmarks/chat_math.py [--iterations 50] [--sft-steps 600] [--seed 0] [--set learn.lr=1e-3]
        [--out run.csv] [--warm-model WORK/warm-model]
    .venv/bin/python benchmarks/chat_math.py --seed 1 --warm-model WORK/warm-model --run-seed 11  # another trajectory

1. Word problems in GSM8K's format (`question`; `answer` = worked solution ending `#### N`),
   sums and differences of numbers up to --top (9) in a few phrasings; a seeded fifth is held out
   (eval.split_fraction).
2. A Qwen2 model (grouped-query attention) with a byte-level BPE tokenizer trained on those
   texts and Qwen's chat template, made on the spot; then a short supervised warm start (`grpo sft`, the
   run's sft section: a `messages` dataset of the training problems, the assistant's turn trained) on the
   answer format ("a + b = c. The answer is c."): 600 steps learn the format and some of the sums.
   `--answer-noise 0.5` makes half the warm-start solutions state a wrong final number after the right
   working (a model that works sums out but reports them unreliably, as weak SFT models do: only the
   verifiable reward tells the two apart).
3. GRPO with the `math` task (math-verify) through the real stages: prompts rendered with the
   chat template, every eos id stopping, the held-out set scored greedily each iteration. With
   `--set rollout.staleness=S` iteration k samples learn k-1-S's policy (checked on every rollout row's
   `policy_version`); each line shows the sampler-to-learner k3 KL and the behaviour weights pi_prox /
   pi_sampler of `learn.behavior_correction` (their mean, max and clipped or masked share). `--out` writes
   every line to a CSV, iteration -1 being the warm start before GRPO. `--run-seed R` sets the run's
   config `seed` (prompt order, sampling, the learner's shuffling) and nothing else: the problems, the
   held-out split (`eval.seed`) and the warm start stay --seed's, so runs of one --seed and several
   --run-seed measure the trajectory-to-trajectory noise at one warm start (default: --seed).
"""

from __future__ import annotations

import argparse
import csv
import random
import shutil
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from timing import machine

from grpo.config import load_config
from grpo.progress import show_in_terminal
from grpo.record.lineage import policy_version
from grpo.record.storage import open_storage
from grpo.runtime.quiet import quiet_libraries
from grpo.runtime.threads import apply_threads
from grpo.sampling.base import SamplingSpec, decode_responses, stop_token_ids
from grpo.sampling.hf import HFGenerator
from grpo.tasks.math import math_reward
from grpo.tiny_model import build_chat_model
from schemas import read_parquet, table_file
from stages.init import init_run
from stages.iteration import run_warm
from stages.prompts import eval_prompts, held_out_split
from stages.sft import warm_start

NAMES = ["Tom", "Ana", "Lee", "Mia", "Sam", "Zoe"]
THINGS = ["apples", "books", "coins", "cards", "shells"]
SYSTEM = "Solve the problem. End with: The answer is N."


def problem(rng: random.Random, top: int) -> dict:
    """One word problem: a sum or a difference of numbers 1..top, in GSM8K's answer format."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(1, top), rng.randint(1, top)
    if rng.random() < 0.5:
        q = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
        work, c = f"{a} + {b} = {a + b}", a + b
    else:
        a, b = max(a, b), min(a, b)
        q = f"{name} has {a} {thing} and gives away {b}. How many {thing} does {name} have left?"
        work, c = f"{a} - {b} = {a - b}", a - b
    return {"question": q, "answer": f"{name} has {work} {thing}.\n#### {c}", "work": work, "result": c}


def solution(row: dict, stated: int | None = None) -> str:
    """The worked answer; `stated` puts another number in its final sentence (a noisy warm start)."""
    return f"{row['work']}. The answer is {row['result'] if stated is None else stated}."


SHAPE = dict(vocab_size=600, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384)
"""The recipe's model (RESULTS.md): Qwen2, 4 layers, hidden 128, 4 query and 2 key/value heads, a BPE of 600."""


def world(work: Path, seed: int, n: int, top: int = 9) -> tuple[list[dict], list[str]]:
    """The recipe's distinct problems (`n` drawn from `seed`), written to work/problems.parquet, and the texts a
    model's tokenizer is trained on (build_chat_model)."""
    rng = random.Random(seed)
    rows = list({r["question"]: r for r in (problem(rng, top) for _ in range(n))}.values())  # distinct
    pd.DataFrame(rows)[["question", "answer"]].to_parquet(work / "problems.parquet")
    return rows, [f"{SYSTEM} {r['question']} {r['answer']} {solution(r)}" for r in rows]


def recipe_settings(model: str, work: Path, iterations: int) -> list[str]:
    """The GRPO recipe RESULTS.md measures on `model`: 64 prompts x 8, 24 tokens, 2 epochs of 64, lr 3e-4 decayed."""
    return [
        *math_task(model, work / "problems.parquet"),
        "eval.split_fraction=0.2",
        "eval.n_prompts=200",
        "rollout.backend=hf",
        "rollout.prompts_per_iteration=64",
        "rollout.group_size=8",
        "rollout.max_tokens=24",
        "learn.minibatch_size=64",
        "learn.microbatch_size=64",
        "learn.lr=3e-4",
        "learn.epochs=2",
        "reward.truncated_reward=0",  # as measured in RESULTS.md (the default scores cut-off answers)
        "learn.mixed_precision=no",  # float32, as measured in RESULTS.md (`auto` is bf16 on a GPU)
        f"learn.lr_decay_steps={16 * iterations}",  # 16 AdamW steps an iteration, decayed to 0 at the end
    ]


def math_task(model, problems) -> list[str]:
    """The settings of these recipes' task: `model` answers the math task's problems (a Parquet file of `question`
    and `answer` columns, GSM8K's format) as chat prompts after SYSTEM."""
    return [
        f"model.base_model={model}",
        "task.name=math",
        f"task.dataset={problems}",
        "task.prompt_column=question",
        "task.answer_column=answer",
        "task.prompt_format=chat",
        f"task.system_prompt={SYSTEM}",
    ]


def warm_start_rows(rows: list[dict], seed: int, noise: float = 0.0) -> list[dict]:
    """The warm start's conversations (a `messages` dataset for `grpo sft`): SYSTEM, the problem, the formatted
    solution; a `noise` share of the solutions state a wrong final answer after the right working."""
    rng = random.Random(seed)
    out = []
    for r in rows:
        wrong = rng.choice([n for n in range(0, 19) if n != r["result"]]) if rng.random() < noise else None
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["question"]}]
        out.append({"messages": messages + [{"role": "assistant", "content": solution(r, wrong)}]})
    return out


def warm_start_settings(dataset: Path, steps: int, lr: float) -> list[str]:
    """The run's sft section: `grpo sft` on `dataset` (warm_start_rows), batches of 32, constant lr, before GRPO."""
    return [f"sft.dataset={dataset}", f"sft.steps={steps}", f"sft.lr={lr}", "sft.minibatch_size=32",
            "sft.microbatch_size=32"]  # fmt: skip


def accuracy(model_dir: str, cfg) -> float:
    """Greedy held-out accuracy of a checkpoint folder, scored like the eval stage."""
    from grpo.episodes import templates

    gen = HFGenerator(model_dir)
    examples = eval_prompts(cfg)
    _, ids = templates.tokenize_prompts(gen.tokenizer, examples, cfg.task.prompt_format, cfg.task.system_prompt)
    out = gen.generate(ids, SamplingSpec(n=1, temperature=0.0, max_tokens=cfg.rollout.max_tokens))
    texts = decode_responses(gen.tokenizer, [g[0].response_ids for g in out], stop_token_ids(gen.tokenizer, model_dir))
    return sum(math_reward(t, e.ground_truth)["correct"] for t, e in zip(texts, examples)) / len(examples)


BEHAVIOR = ["sampler_kl", "behavior_weight_mean", "behavior_weight_max", "behavior_clipped_frac"]


def sampled_by(storage, rollouts, iteration: int, staleness: int) -> int:
    """The policy version every rollout row of `iteration` records, checked against learn k-1-S's (lineage)."""
    rows = read_parquet(storage.fs, rollouts.read_path(table_file("rollouts")), "rollouts", columns=["policy_version"])
    versions, expected = set(rows.column("policy_version").to_pylist()), policy_version(iteration, staleness)
    if versions != {expected}:
        raise SystemExit(f"iteration {iteration}: rows sampled by {versions}; staleness {staleness} names {expected}")
    return expected


def write_csv(path: str, lines: list[dict]) -> None:
    """The lines so far, a row each (the first, iteration -1, has the accuracy before GRPO only)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(lines[-1]))
        writer.writeheader()
        writer.writerows(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--problems", type=int, default=2000)
    p.add_argument("--top", type=int, default=9, help="largest number in a problem")
    p.add_argument("--sft-steps", type=int, default=600)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument(
        "--answer-noise",
        type=float,
        default=0.0,
        help="share of warm-start solutions whose final sentence states a wrong number",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--run-seed",
        type=int,
        default=None,
        help="the run config's seed (prompt order, sampling, the learner's shuffling); problems, held-out split "
        "and warm start stay --seed's (default: --seed)",
    )
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    p.add_argument(
        "--warm-model",
        default=None,
        help="the warm-started model folder (WORK/warm-model) of an earlier run of the same --seed, --sft-* and "
        "--answer-noise: copied instead of made and warm-started again",
    )
    p.add_argument("--out", default=None, help="CSV of every iteration's line (iteration -1: before GRPO)")
    args = p.parse_args()
    quiet_libraries()  # no progress bars between the table's lines
    show_in_terminal()  # in a terminal, where each stage is (rollouts 3: 32/64 prompts) on one line of stderr
    apply_threads()  # GRPO_THREADS, else torch's one thread a core
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"machine: {machine()}; {gpu}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    work = Path(args.dir or tempfile.mkdtemp(prefix="grpo-chat-math-"))
    work.mkdir(parents=True, exist_ok=True)
    rows, texts = world(work, args.seed, args.problems, args.top)
    t0 = time.time()
    if args.warm_model:
        model = str(shutil.copytree(args.warm_model, work / "model"))
    else:
        model = build_chat_model(str(work / "model"), texts, max_position_embeddings=160, seed=args.seed, **SHAPE)
    cfg = load_config(
        None,
        [
            *recipe_settings(model, work, args.iterations),
            f"seed={args.seed if args.run_seed is None else args.run_seed}",
            *([] if args.warm_model else warm_start_settings(work / "warm_start.jsonl", args.sft_steps, args.sft_lr)),
            *args.set,
        ],
    )
    train, _ = held_out_split(cfg)
    held = {e.ground_truth for e in eval_prompts(cfg)}
    trained = {e.prompt for e in train}  # the warm start sees training problems only
    storage, policy = open_storage(str(work / "storage")), model
    if not args.warm_model:  # `grpo sft` on the training problems: the run's warm start, before iteration 0
        train_rows = warm_start_rows([r for r in rows if r["question"] in trained], args.seed, args.answer_noise)
        pd.DataFrame(train_rows).to_json(work / "warm_start.jsonl", orient="records", lines=True)
    init_run(storage, "chat-math", cfg)
    if not args.warm_model:  # its policy kept as a model folder of its own: --warm-model for another run
        made = Path(warm_start(storage, "chat-math").attempt_dir, "policy")
        policy = str(shutil.copytree(made, work / "warm-model", dirs_exist_ok=True))
    before = accuracy(policy, cfg)
    print(
        f"{len(train)} training and {len(held)} held-out problems; model "
        f"{'copied from ' + args.warm_model if args.warm_model else 'made and warm-started by grpo sft'} "
        f"({args.sft_steps} steps) in {time.time() - t0:.0f} s; held-out greedy accuracy before GRPO: {before:.3f}"
    )
    staleness = cfg.rollout.staleness
    print(f"seed={cfg.seed}, rollout.staleness={staleness}, learn.behavior_correction={cfg.learn.behavior_correction}")
    print(
        f"{'iter':>4} {'policy':>6} {'reward':>7} {'accuracy':>8} {'seconds':>8} {'tokens':>8} {'steps':>6} "
        f"{'rounds':>6} {'kl':>8} {'w mean':>6} {'w max':>6} {'clipped':>7} {'min left':>8}"
    )
    lines = [{"iteration": -1, "policy_version": -1, "accuracy": before}]
    start = t = time.time()
    tokens = steps = 0  # sampled response tokens and AdamW steps so far: compare variants at equal cost
    for k, out in run_warm(storage, "chat-math", 0, args.iterations):
        rollouts, learn = out["rollouts"].manifest.summary, out["learn"].manifest.summary
        tokens, steps = tokens + rollouts["response_tokens"], steps + learn["steps"]
        line = {
            "iteration": k,
            "policy_version": sampled_by(storage, out["rollouts"], k, staleness),
            "reward": out["advantages"].manifest.summary["reward_mean"],
            "accuracy": out["eval"].manifest.summary["exact_match"],
            "seconds": time.time() - t,
            "tokens": tokens,
            "steps": steps,
            "rounds": rollouts.get("rounds", 1),
            **{name: learn[name] for name in BEHAVIOR},
            "old_logprobs": learn["old_logprobs"]["source"],
        }
        lines.append(line)
        if args.out:  # again after every iteration: a stopped run leaves what it measured
            write_csv(args.out, lines)
        print(
            f"{k:>4} {line['policy_version']:>6} {line['reward']:>7.3f} {line['accuracy']:>8.3f} "
            f"{line['seconds']:>8.1f} {tokens:>8} {steps:>6} {line['rounds']:>6} {line['sampler_kl']:>8.5f} "
            f"{line['behavior_weight_mean']:>6.3f} {line['behavior_weight_max']:>6.2f} "
            f"{line['behavior_clipped_frac']:>7.4f} "
            f"{(time.time() - start) / (k + 1) * (args.iterations - k - 1) / 60:>8.1f}",  # at the pace so far
            flush=True,
        )
        t = time.time()
    print(
        f"accuracy {before:.3f} -> {out['eval'].manifest.summary['exact_match']:.3f} after {args.iterations} "
        f"iterations, {time.time() - start:.0f} s of GRPO; storage {storage.url}"
    )


if __name__ == "__main__":
    main()
