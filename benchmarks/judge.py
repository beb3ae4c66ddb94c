"""A judge recipe (issue 51): a small judge model scores a task the run has no verifier for, and its verdicts agree
with a verifier the judge never sees, at a rate measured here.

    .venv/bin/python benchmarks/judge.py [--examples 2000] [--sft-steps 300] [--sft-lr 1e-3] [--numbers 2]
        [--iterations 6] [--held-out-only] [--reference] [--out DIR]

1. The judge: the tiny chat model (grpo/tiny_model.py's Qwen2, built from scratch) warm-started by `grpo sft` on
   conversations whose user turn is reward.judge's rubric prompt for a sort prompt and a response (correct, or one
   of the mistakes a policy makes: a pair swapped, a number dropped or changed, the prompt's order, noise) and whose
   assistant turn is `REASON correct: <the sorted numbers> vs <the response>` then `VERDICT correct: pass|fail`, about
   half of each, labelled by the sort verifier, at sft.lr 1e-3 (1e-2 taught it the format and `fail` for
   everything). A fifth of the sort prompts (held_out_prompt) never appear in it. The verifier labels the judge's
   training data; the judge never sees it when judging.
2. The judged run: the sort task on the tiny policy, its only reward function `no_verifier` (0 for every response,
   weight 0) and reward.judge the warm-started judge (weight 1): the run has no verifier, only the judge's verdicts.
3. Agreement: each judged response of the run's iterations, the judge's verdict against the sort verifier's exact
   match computed here afterwards (never given to the run or the judge), with the base rate of the majority class
   and the balanced accuracy beside it, and the judge's answers that did not parse; first on 300 synthetic
   responses to the held-out prompts (fast: `--held-out-only` stops there), then on the run's responses, split
   by whether their prompt was held out of the warm start.

With `--reference` the judge is reference-guided: its template holds `{reference}` (reward.judge fills it with the
row's ground truth, the sorted numbers), in its warm start and in the run alike, so it compares the response with
the answer it is given instead of sorting the prompt itself.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = "grade {criteria} as {verdicts}\n{prompt} {response}"
REFERENCE_TEMPLATE = "grade {criteria} as {verdicts}\n{prompt} {response} ref {reference}"
CRITERIA = [{"name": "correct", "weight": 1.0, "description": "sorted"}]
VERDICTS = ["fail", "pass"]


def no_verifier(response: str, ground_truth: str, prompt: str) -> float:
    """The judged run's reward function: no verifier, 0 for every response (its weight is 0 too)."""
    return 0.0


def response_for(numbers: list[int], rng: random.Random, ascending: bool = False) -> str:
    """A response to `sort <numbers> :`: correct, or one of the mistakes a sort policy makes; with `ascending`, also
    other numbers in ascending order (the mistake a policy rewarded by the judge alone learned to make)."""
    want = sorted(numbers)
    kinds = ["correct"] * 4 + ["swap", "drop", "change", "prompt", "noise"]  # about half correct
    kind = rng.choice(kinds + ["correct", "ascending"] if ascending else kinds)
    got = list(want)
    if kind == "swap":
        i = rng.randrange(len(got) - 1)
        if got[i] == got[i + 1]:
            got[i] = (got[i] + 1) % 10
        got[i], got[i + 1] = got[i + 1], got[i]
    elif kind == "drop":
        got.pop(rng.randrange(len(got)))
    elif kind == "change":
        i = rng.randrange(len(got))
        got[i] = (got[i] + rng.randrange(1, 10)) % 10
    elif kind == "prompt":
        got = list(numbers)
    elif kind == "ascending":
        while got == want:
            got = sorted(rng.randrange(10) for _ in numbers)
    elif kind == "noise":
        got = [rng.randrange(10) for _ in range(rng.randrange(1, len(numbers) + 2))]
    return " ".join(map(str, got))


def held_out_prompt(numbers: list[int]) -> bool:
    """About a fifth of the sort prompts, which the judge's warm start never shows it (with any response)."""
    return sum(n * 7**i for i, n in enumerate(numbers)) % 5 == 0


def examples(
    n: int, n_numbers: int, seed: int, held_out: bool = False, ascending: bool = False
) -> list[tuple[str, str, str]]:
    """(prompt, response, the sorted answer) of `n` sort prompts as the task writes them, with responses: prompts
    of the held-out fifth only, or none of them."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        numbers = [rng.randrange(10) for _ in range(n_numbers)]
        if held_out_prompt(numbers) != held_out:
            continue
        out.append(
            (
                f"sort {' '.join(map(str, numbers))} :",
                response_for(numbers, rng, ascending),
                " ".join(map(str, sorted(numbers))),
            )
        )
    return out


def conversations(rows: list[tuple[str, str, str]], template: str = TEMPLATE) -> list[dict]:
    """The judge's warm-start data: {messages: [user: the judge prompt, assistant: reason then verdict]}; a
    `template` holding {reference} is given the sorted numbers there, as reward.judge gives the ground truth."""
    from grpo.scoring.judge_format import rubric_prompt

    out = []
    for prompt, response, want in rows:
        verdict = "pass" if response.split() == want.split() else "fail"
        user = rubric_prompt(template, CRITERIA, VERDICTS, prompt, response, want)
        answer = f"REASON correct: {want} vs {response}\nVERDICT correct: {verdict}"  # the comparison, then its verdict
        out.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
    return out


def held_out_agreement(storage, judge_cfg, rows: list[tuple[str, str, str]]) -> dict:
    """The judge on fresh synthetic responses (none trained on), against the verifier's exact match."""
    from grpo.scoring.judge import judged

    asked = [
        {"prompt_id": i, "sample_index": 0, "prompt": p, "response": r, "ground_truth": w}
        for i, (p, r, w) in enumerate(rows)
    ]
    answers, _ = judged(storage, judge_cfg, asked)
    exact = [r.split() == w.split() for _, r, w in rows]
    said = [a["verdicts"][0]["verdict"] == "pass" if a["verdicts"] else None for a in answers]
    parsed = [(s, e) for s, e in zip(said, exact) if s is not None]
    pos = [s for s, e in parsed if e]
    neg = [not s for s, e in parsed if not e]
    return {
        "responses": len(rows),
        "verifier_exact": sum(exact) / len(rows),
        "unparsed": len(rows) - len(parsed),
        "agreement": sum(s == e for s, e in parsed) / max(1, len(parsed)),
        "balanced_accuracy": (sum(pos) / max(1, len(pos)) + sum(neg) / max(1, len(neg))) / 2,
    }


def grpo(storage_url: str, *args: str) -> None:
    from flows.cli import main

    rc = main(["--storage", storage_url, *args])
    if rc != 0:
        raise SystemExit(f"grpo {' '.join(args)}: exit {rc}")


def agreement(storage, run_id: str) -> list[dict]:
    """Per iteration, then all, then the prompts the warm start held out and the rest: the judged responses, how many
    the verifier finds exact, the judge's agreement with it."""
    from grpo.query import query

    rows = query(
        storage,
        run_id,
        """SELECT j.iteration, ro.prompt, ro.response, ro.ground_truth, j.error,
                  CASE WHEN j.error IS NULL THEN j.verdicts[1].verdict END AS verdict
           FROM judge j JOIN rollouts ro USING (iteration, prompt_id, sample_index) ORDER BY 1""",
    )
    numbers = rows.prompt.str.extract(r"sort ((?:\d+ )+):", expand=False).fillna("")
    held = numbers.map(lambda s: bool(s) and held_out_prompt([int(n) for n in s.split()]))
    out = []
    parts = list(rows.groupby("iteration")) + [("all", rows), ("held-out", rows[held]), ("seen", rows[~held])]
    for k, part in parts:
        exact = part.response.str.split().map(tuple) == part.ground_truth.str.split().map(tuple)
        judged = part.verdict.notna()
        said_pass = part.verdict == "pass"
        agree = (said_pass == exact)[judged]
        tpr = (said_pass & exact)[judged].sum() / max(1, (exact & judged).sum())
        tnr = (~said_pass & ~exact)[judged].sum() / max(1, (~exact & judged).sum())
        out.append(
            {
                "iteration": k,
                "responses": len(part),
                "verifier_exact": float(exact.mean()),
                "unparsed": int((~judged).sum()),
                "agreement": float(agree.mean()),
                "majority_base_rate": float(max(exact[judged].mean(), 1 - exact[judged].mean())),
                "balanced_accuracy": float((tpr + tnr) / 2),
                "judge_pass": float(said_pass.mean()),  # the judge's reward (pass 1, fail and unparsed 0)
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=2000, help="the judge's warm-start conversations")
    ap.add_argument("--sft-steps", type=int, default=300, help="of 64 conversations")
    ap.add_argument("--sft-lr", default="1e-3", help="the warm start's sft.lr")
    ap.add_argument("--ascending", action="store_true", help="add other ascending numbers to the mistakes")
    ap.add_argument("--held-out-only", action="store_true", help="stop after the held-out responses (no judged run)")
    ap.add_argument("--reference", action="store_true", help="a reference-guided judge: {reference} in its template")
    ap.add_argument("--numbers", type=int, default=2, help="the sort task's n_numbers")
    ap.add_argument("--iterations", type=int, default=6, help="iterations of the judged run")
    ap.add_argument("--out", default=None, help="folder for storage and models (default: a temporary one)")
    args = ap.parse_args()
    # one torch thread unless told: torch's default 2 spin-wait against other work on a shared 2-core machine (the
    # learner 5x slower a step: benchmarks/sft_speed.py's section of RESULTS.md)
    os.environ.setdefault("GRPO_THREADS", "1")
    sys.path.insert(0, str(REPO))
    from grpo.config import load_config
    from grpo.record.checkpoint import local_checkpoint
    from grpo.record.layout import stage_dir
    from grpo.record.storage import latest_committed, open_storage
    from grpo.tiny_model import build_chat_model

    out = Path(args.out or tempfile.mkdtemp(prefix="judge-recipe-"))
    out.mkdir(parents=True, exist_ok=True)
    storage = open_storage((out / "storage").as_uri())
    t0 = time.perf_counter()

    template = REFERENCE_TEMPLATE if args.reference else TEMPLATE
    data = conversations(examples(args.examples, args.numbers, seed=0, ascending=args.ascending), template)
    with open(out / "judge_sft.jsonl", "w") as f:
        f.writelines(json.dumps(c) + "\n" for c in data)
    texts = [m["content"] for c in data[:500] for m in c["messages"]]
    base = build_chat_model(
        str(out / "judge-base"), texts, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        intermediate_size=512, max_position_embeddings=256, split_digits=True,
    )  # fmt: skip
    task = f"task.params={{n_numbers: {args.numbers}, max_value: 9, credit: position}}"
    grpo(
        storage.url, "init", "--run", "judge-sft",
        "--set", f"model.base_model={base}", "--set", "task.name=sort", "--set", task,
        "--set", f"sft.dataset={out / 'judge_sft.jsonl'}", "--set", f"sft.steps={args.sft_steps}",
        "--set", f"sft.lr={args.sft_lr}", "--set", "sft.minibatch_size=64", "--set", "sft.microbatch_size=64",
        "--set", "learn.lr=2e-3", "--set", "rollout.max_tokens=24", "--set", "rollout.backend=hf",
    )  # fmt: skip
    t_sft = time.perf_counter()
    grpo(storage.url, "sft", "--run", "judge-sft")
    sft_s = time.perf_counter() - t_sft
    judge_folder = local_checkpoint(latest_committed(storage, stage_dir(storage, "judge-sft", None, "sft")))

    judge = [
        f"reward.judge.model={judge_folder}", f"reward.judge.template={template}",
        "reward.judge.criteria=[{name: correct, weight: 1, description: sorted}]",
        "reward.judge.verdicts=[fail, pass]", "reward.judge.verdict_scores=[0, 1]",
        "reward.judge.max_tokens=24", "reward.judge.concurrency=64",
    ]  # fmt: skip
    held_out = held_out_agreement(
        storage,
        load_config(None, judge).reward.judge,
        examples(300, args.numbers, seed=1, held_out=True, ascending=args.ascending),
    )  # prompts the warm start never showed
    print(f"judge warm start: {args.examples} conversations, {args.sft_steps} steps at lr {args.sft_lr}, {sft_s:.0f} s")
    print(f"held-out synthetic responses: {held_out}", flush=True)
    if args.held_out_only:
        return
    grpo(
        storage.url, "init", "--run", "judged", "--config", str(REPO / "benchmarks/sort.yaml"), "--set", task,
        "--set", f"rollout.max_tokens={args.numbers}", "--set", "rollout.prompts_per_iteration=64",
        "--set", "learn.minibatch_size=128", "--set", "learn.microbatch_size=128", "--set", "eval.n_prompts=64",
        "--set", f"reward.functions=[{REPO / 'benchmarks/judge.py'}:no_verifier]", "--set", "reward.weights=[0, 1]",
        *[a for j in judge for a in ("--set", j)],
    )  # fmt: skip
    t_run = time.perf_counter()
    grpo(storage.url, "run", "--run", "judged", "--iterations", str(args.iterations))
    run_s = time.perf_counter() - t_run

    print(
        f"judged run: {args.iterations} iterations of 64 prompts x 8, {run_s:.0f} s; "
        f"all {time.perf_counter() - t0:.0f} s"
    )
    print(
        "iteration  responses  verifier_exact  judge_pass  unparsed  agreement  majority_base_rate  balanced_accuracy"
    )
    for r in agreement(storage, "judged"):
        print(
            f"{r['iteration']!s:>9}  {r['responses']:>9}  {r['verifier_exact']:>14.3f}  {r['judge_pass']:>10.3f}  "
            f"{r['unparsed']:>8}  {r['agreement']:>9.3f}  {r['majority_base_rate']:>18.3f}  "
            f"{r['balanced_accuracy']:>17.3f}"
        )
    print(f"storage: {storage.url}")


if __name__ == "__main__":
    main()
