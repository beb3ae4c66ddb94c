"""One GRPO iteration of a 26M-parameter chat model, TRL's GRPOTrainer and grpo-flow side by side, in one
invocation on this machine; no downloads.

    pip install -e ".[bench]"                       # TRL, outside the core install
    .venv/bin/python benchmarks/vs_trl.py [--iterations 3] [--only trl|grpo-flow] [--device cuda] [--bf16]
    .venv/bin/python benchmarks/vs_trl.py --recipe sort [--seed 0] [--iterations 30]   # time to 0.95, through the flow

1. A Qwen2-architecture model built here, random weights: 8 layers, width 512, grouped-query attention
   (8 query heads, 2 KV heads), a byte-level BPE with Qwen's chat template, the embedding padded to
   8,192 rows (26.4M parameters); GSM8K-style word problems as chat prompts with a system prompt
   (~48 prompt tokens; benchmarks/chat_math.py's problems).
2. The same recipe on both sides, float32: 64 prompts x 8 samples, up to 64 new tokens at temperature
   1, the math task's reward (math-verify), no KL, one pass of 8 AdamW steps of 64 samples over each
   iteration's 512 samples, lr 1e-5. TRL samples with transformers' generate (its default), grpo-flow
   with its `auto` backend (vLLM at this size) unless `--set rollout.backend=hf`. `--bf16`: bf16
   autocast in both learners (TRL's bf16=True, grpo-flow's learn.mixed_precision=bf16), weights float32.
   `--device` places TRL (cpu by default); grpo-flow takes the GPU whenever there is one (Accelerate's
   learner and the hf sampler), so on a GPU machine run with `--device cuda`.
3. Prints each iteration's seconds for both, the steady-state ratio (the median of iterations 1..,
   iteration 0 pays engine starts and first-call costs on both sides), and grpo-flow's split by stage.
   grpo-flow's iteration is snapshot start to learn commit: its eval (held-out greedy decoding, which TRL
   does not do in this recipe) is left out. Run it on a quiet machine: a second process slows torch's
   threads several-fold. With a GPU, also the peak GPU memory of TRL and of grpo-flow's GPU stages (torch's
   allocator, from the stages' manifests): a stage that did not use the GPU shows ~0.

`--recipe sort` compares time to target on the sort task instead (benchmarks/sort.yaml: the demo's tiny model
from scratch, 256 prompts x 8, 2 epochs of minibatches of 256, lr 1.5e-3 decayed to 0 over 500 steps, float32,
transformers sampling on both sides): grpo-flow through the Prefect flow `grpo` on a local server
(benchmarks/warm_training.py's measure: from the flow call to the held-out greedy exact match first >= 0.95),
TRL's GRPOTrainer with the same model, recipe and reward from its construction, its held-out greedy exact
match taken after each iteration's steps by a callback (counted, as grpo-flow's eval stage is).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chat_math import SYSTEM, math_task, problem  # noqa: E402
from timing import machine, manifests  # noqa: E402
from trl_grpo import grpo_config, grpo_trainer  # noqa: E402


@dataclass(frozen=True)
class Recipe:
    prompts: int = 64
    group: int = 8
    max_tokens: int = 64
    steps: int = 8  # optimizer steps an iteration, each over prompts * group / steps samples
    lr: float = 1e-5
    shape: dict = field(
        default_factory=lambda: dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1376)
    )
    vocab: int = 8192  # the embedding's rows (the tokenizer's vocabulary is smaller, padded as Qwen's is)


RECIPES = {
    "chat": Recipe(),
    "tiny": Recipe(  # a check that both sides run, in a minute
        prompts=8,
        group=4,
        max_tokens=16,
        steps=2,
        shape=dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128),
        vocab=2048,
    ),
}


def make_world(root: Path, r: Recipe, seed: int) -> tuple[str, Path, list[dict]]:
    """The model folder, the problems' Parquet file and the problems."""
    import pandas as pd

    from grpo.tiny_model import build_chat_model

    rng = random.Random(seed)
    rows = list({r["question"]: r for r in (problem(rng, 99) for _ in range(4000))}.values())
    pd.DataFrame(rows)[["question", "answer"]].to_parquet(root / "problems.parquet")
    texts = [f"{SYSTEM} {r['question']} {r['answer']}" for r in rows]
    model = build_chat_model(
        str(root / "model"), texts, vocab_size=2000, model_vocab_size=r.vocab, max_position_embeddings=512, **r.shape
    )
    return model, root / "problems.parquet", rows


def grpo_flow(
    root: Path, r: Recipe, model: str, data: Path, iterations: int, extra: list[str]
) -> tuple[list, dict, dict]:
    """Seconds of each iteration (snapshot start to learn commit); the steady iterations' mean seconds per
    stage and of the compute inside rollouts and learn (sampling; old-log-prob scoring, update); per GPU
    stage, its peak GPU GiB over the iterations (empty without a GPU)."""
    from grpo.config import load_config
    from grpo.record.storage import open_storage
    from stages.init import init_run
    from stages.iteration import run_warm

    cfg = load_config(
        None,
        [
            *math_task(model, data),
            f"rollout.prompts_per_iteration={r.prompts}",
            f"rollout.group_size={r.group}",
            f"rollout.max_tokens={r.max_tokens}",
            f"learn.minibatch_size={r.prompts * r.group // r.steps}",
            f"learn.microbatch_size={r.prompts * r.group // r.steps}",
            "learn.epochs=1",
            "learn.kl_coef=0",
            f"learn.lr={r.lr}",
            "eval.n_prompts=8",
            *extra,
        ],
    )
    storage = open_storage((root / "storage").as_uri())
    init_run(storage, "bench", cfg)
    for _ in run_warm(storage, "bench", 0, iterations):
        pass
    seconds, split, peaks = [], {}, {}
    for k in range(iterations):
        m = manifests(storage.url, "bench", k)
        at = {s: (stamp(m[s].started_at), stamp(m[s].committed_at)) for s in m}
        seconds.append(at["learn"][1] - at["snapshot"][0])
        for s, (start, end) in at.items():
            if k > 0 or iterations == 1:
                split.setdefault(s, []).append(end - start)
        for s, key in (("rollouts", "generate_s"), ("learn", "score_s"), ("learn", "update_s")):
            if k > 0 or iterations == 1:
                split.setdefault(f"{s} {key}", []).append(m[s].summary[key])
        for s in ("rollouts", "learn", "eval"):
            if "gpu_peak_gib" in m[s].summary:
                peaks[s] = max(peaks.get(s, 0.0), m[s].summary["gpu_peak_gib"])
    return seconds, {s: statistics.mean(v) for s, v in split.items()}, peaks


def stamp(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def trl(
    root: Path, r: Recipe, model: str, rows: list[dict], iterations: int, seed: int, device: str, bf16: bool
) -> list[float]:
    """Seconds of each iteration of TRL's GRPOTrainer: one generation of prompts x group samples and the
    `steps` optimizer steps over them (steps_per_generation), timed between optimizer steps."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    from grpo.tasks.math import math_reward

    def correct(completions, answer, **_) -> list[float]:
        return [math_reward(c[-1]["content"], a)["total"] for c, a in zip(completions, answer)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.at = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs):
            self.at.append(time.perf_counter())

    prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["question"]}] for r in rows]
    dataset = Dataset.from_dict({"prompt": prompts, "answer": [r["answer"] for r in rows]})
    config = grpo_config(
        root / "trl",
        batch=r.prompts * r.group // r.steps,
        steps=r.steps,
        group=r.group,
        epochs=1,
        max_tokens=r.max_tokens,
        lr=r.lr,
        schedule="constant",
        max_steps=r.steps * iterations,
        seed=seed,
        cpu=device == "cpu",
        bf16=bf16,
    )
    clock = Clock()
    trainer = grpo_trainer(config, model, AutoTokenizer.from_pretrained(model), correct, dataset, [clock])
    clock.at = [time.perf_counter()]
    trainer.train()
    return [clock.at[r.steps * (k + 1)] - clock.at[r.steps * k] for k in range(iterations)]


SORT_YAML = Path(__file__).resolve().parent / "sort.yaml"


def sort_flow(root: Path, seed: int, iterations: int, target: float) -> tuple[float, int] | None:
    """Seconds from the flow call to held-out greedy exact match >= target, and the iteration; None if not
    reached. Flow `grpo` on a Prefect server, as benchmarks/warm_training.py measures it."""
    import os

    from warm_training import iteration_times, train_warm

    from tools.prefect_server import prefect_server

    url = (root / "sort-store").as_uri()
    with prefect_server(root / "prefect") as server:
        os.environ.update({k: v for k, v in server.env.items() if k.startswith("PREFECT_")})
        start = train_warm(url, "sort", iterations, str(SORT_YAML), [f"seed={seed}"])
        rows = iteration_times(url, "sort", range(iterations), start)
    print("grpo-flow held-out exact match by iteration: " + " ".join(f"{r['exact']:.2f}" for r in rows), flush=True)
    hit = next((r for r in rows if r["exact"] >= target), None)
    return (hit["eval_at"] - start, hit["iteration"]) if hit else None


def sort_trl(root: Path, seed: int, iterations: int, target: float) -> tuple[float, int] | None:
    """TRL's GRPOTrainer on sort.yaml's recipe (the flow's base model, the task's prompts and reward, the eval
    prompts): seconds from the trainer's construction to held-out greedy exact match >= target, and the
    iteration; None if not reached in `iterations`."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    from grpo.config import load_config_file
    from grpo.sampling.base import decode_responses
    from grpo.tasks import get_task
    from stages.eval import exact_match
    from stages.init import build_tiny_base
    from stages.prompts import eval_prompts

    cfg = load_config_file(str(SORT_YAML), [f"seed={seed}"])
    r, lc = cfg.rollout, cfg.learn
    task = get_task(cfg.task.name, **cfg.task.params)
    model_dir = build_tiny_base(str(root / "sort-model"), cfg)  # the flow's base: same shape, seed and init
    tok = AutoTokenizer.from_pretrained(model_dir)
    held = eval_prompts(cfg)
    train = task.generate(r.prompts_per_iteration * iterations, seed + 1000)
    per_iteration = lc.epochs * r.prompts_per_iteration * r.group_size // lc.minibatch_size  # AdamW steps

    def reward(prompts, completion_ids, ground_truth, **_) -> list[float]:
        texts = decode_responses(tok, completion_ids)
        return [task.reward(t, g, p)["total"] for t, g, p in zip(texts, ground_truth, prompts)]

    class Eval(TrainerCallback):
        """After each iteration's steps: greedy decoding of the held-out prompts, as grpo-flow's eval stage."""

        def __init__(self):
            self.start, self.hit, self.exact = time.perf_counter(), None, []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % per_iteration:
                return
            enc = tok([e.prompt for e in held], return_tensors="pt", padding=True, padding_side="left")
            model.eval()
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=r.max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            model.train()
            ids = [[t for t in row if t != tok.pad_token_id] for row in out[:, enc["input_ids"].shape[1] :].tolist()]
            texts = decode_responses(tok, ids)
            self.exact.append(
                sum(exact_match(task.reward(t, e.ground_truth, e.prompt)) for t, e in zip(texts, held)) / len(held)
            )
            if self.exact[-1] >= target and self.hit is None:
                self.hit = (time.perf_counter() - self.start, len(self.exact) - 1)
            if self.hit or len(self.exact) == iterations:
                control.should_training_stop = True

    config = grpo_config(
        root / "trl-sort",
        batch=lc.minibatch_size,
        steps=r.prompts_per_iteration * r.group_size // lc.minibatch_size,
        group=r.group_size,
        epochs=lc.epochs,
        max_tokens=r.max_tokens,
        lr=lc.lr,
        schedule="linear",
        max_steps=lc.lr_decay_steps,  # decayed linearly to 0 over lr_decay_steps, as grpo-flow; the callback stops
        seed=seed,
        loss_type="grpo",  # grpo-flow's default aggregation (seq_mean_token_mean) and normalized advantages
        epsilon=lc.clip_eps,
        adam_beta1=lc.betas[0],
        adam_beta2=lc.betas[1],
        weight_decay=lc.weight_decay,
        max_grad_norm=lc.max_grad_norm,
    )
    dataset = Dataset.from_dict({"prompt": [e.prompt for e in train], "ground_truth": [e.ground_truth for e in train]})
    clock = Eval()
    trainer = grpo_trainer(config, model_dir, tok, reward, dataset, [clock])
    trainer.train()
    print("TRL held-out exact match by iteration: " + " ".join(f"{e:.2f}" for e in clock.exact), flush=True)
    return clock.hit


def sort_main(args) -> int:
    """--recipe sort: seconds to --target for grpo-flow's flow and for TRL, side by side."""
    root = Path(tempfile.mkdtemp(prefix="vs-trl-sort-"))
    print(f"machine: {machine()}; folder {root}", flush=True)
    hits = {}
    if args.only != "trl":
        hits["grpo-flow (flow)"] = sort_flow(root, args.seed, args.iterations, args.target)
    if args.only != "grpo-flow":
        import trl as trl_package

        hits[f"TRL {trl_package.__version__}"] = sort_trl(root, args.seed, args.iterations, args.target)
    print(f"\n{'':>16} {'s to ' + str(args.target):>10} {'iteration':>10}")
    for name, hit in hits.items():
        print(f"{name:>16} " + (f"{hit[0]:>10.1f} {hit[1]:>10}" if hit else f"{'not reached':>21}"))
    if len(hits) == 2 and all(hits.values()):
        ours, theirs = (h[0] for h in hits.values())
        print(f"grpo-flow / TRL: {ours / theirs:.2f}x (target <= 0.4x)")
    return 0


def steady(seconds: list[float]) -> float:
    """The median iteration after the first (the first pays engine starts and first calls)."""
    return statistics.median(seconds[1:] or seconds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=None, help="default 3; with --recipe sort 30, the most tried")
    p.add_argument("--recipe", choices=[*RECIPES, "sort"], default="chat")
    p.add_argument("--target", type=float, default=0.95, help="--recipe sort: held-out greedy exact match")
    p.add_argument("--only", choices=["trl", "grpo-flow"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], help="grpo-flow settings on top of the recipe")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where TRL runs (grpo-flow: GPU if any)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast in both learners (default float32)")
    args = p.parse_args()
    from grpo.runtime.quiet import quiet_libraries

    quiet_libraries()  # no progress bars between the lines, on either side
    if args.recipe == "sort":
        args.iterations = args.iterations or 30
        return sort_main(args)
    args.iterations = args.iterations or 3
    root = Path(tempfile.mkdtemp(prefix="vs-trl-"))
    import torch

    from grpo.record.checkpoint import parameter_count

    gpu = f"; {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    print(f"machine: {machine()}{gpu}; torch {torch.__version__}, {torch.get_num_threads()} threads; folder {root}")
    r = RECIPES[args.recipe]
    model, data, rows = make_world(root, r, args.seed)
    print(f"model: {parameter_count(model) / 1e6:.1f}M parameters; {len(rows)} problems", flush=True)
    results = {}
    if args.only != "trl":
        precision = "bf16" if args.bf16 else "no"  # no: float32 even where bf16 is native (learn's `auto`)
        extra = [f"learn.mixed_precision={precision}", *args.set]
        results["grpo-flow"], split, peaks = grpo_flow(root, r, model, data, args.iterations, extra)
        print("grpo-flow s/iteration: " + " ".join(f"{s:.1f}" for s in results["grpo-flow"]), flush=True)
        print("  steady split (s): " + ", ".join(f"{s} {v:.1f}" for s, v in split.items()))
        if peaks:
            print("  peak GPU GiB by stage: " + ", ".join(f"{s} {v:.2f}" for s, v in peaks.items()), flush=True)
    if args.only != "grpo-flow":
        import trl as trl_package

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        seconds = trl(root, r, model, rows, args.iterations, args.seed, args.device, args.bf16)
        results[f"TRL {trl_package.__version__}"] = seconds
        print("TRL s/iteration: " + " ".join(f"{s:.1f}" for s in seconds), flush=True)
        if torch.cuda.is_available():
            print(f"  TRL peak GPU GiB: {torch.cuda.max_memory_allocated() / 2**30:.2f}", flush=True)
    print(f"\n{'':>12} {'s/iteration (steady)':>20}")
    for name, seconds in results.items():
        print(f"{name:>12} {steady(seconds):>20.1f}")
    if len(results) == 2:
        ours, theirs = (steady(s) for s in results.values())
        print(f"grpo-flow / TRL: {ours / theirs:.2f}x (target <= 0.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
