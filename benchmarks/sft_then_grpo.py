"""A warm start then GRPO, on chat_math.py's problems and model: `grpo sft` then `grpo run` on one run against TRL's
SFTTrainer then GRPOTrainer on the same data, model, steps and learning rates; held-out greedy accuracy after each
phase (one scorer for both: chat_math.accuracy) and each side's wall time.

    .venv/bin/python benchmarks/sft_then_grpo.py [--sft-steps 300] [--iterations 10] [--seed 0] [--only trl|grpo-flow]

1. chat_math.py's world: sums and differences in GSM8K's format, a seeded fifth held out, a Qwen2 model (4 layers,
   hidden 128) with a BPE trained on them, made here; the warm start's conversations the training problems' (SYSTEM,
   the problem, "a + b = c. The answer is c."), written once as a `messages` dataset.
2. The warm start: --sft-steps AdamW steps of 32 conversations at --sft-lr, constant, the assistant's tokens only.
   grpo-flow: the run's sft section (`grpo sft`); TRL: SFTTrainer on the same conversations as conversational
   prompt-completion rows (its completion-only loss), per_device_train_batch_size 32, max_steps --sft-steps.
3. GRPO, chat_math's recipe: 64 prompts x 8 samples an iteration, up to 24 tokens at temperature 1, the math task's
   reward (math-verify), no KL, 2 epochs of 64-sample minibatches, lr 3e-4 decayed linearly to 0 over the run,
   float32, transformers sampling on both sides. grpo-flow from its warm start's policy; TRL's GRPOTrainer from
   its SFTTrainer's model.
AdamW betas (0.9, 0.99) in both phases on both sides (the recipe's learn.betas, which `grpo sft` trains with).
Wall time: each phase from its start to its last step (grpo-flow's warm start includes its run's identity checks, its
GRPO the one eval the run commits at its end; TRL has none).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chat_math import (  # noqa: E402
    SHAPE,
    SYSTEM,
    accuracy,
    recipe_settings,
    warm_start_rows,
    warm_start_settings,
    world,
)
from timing import machine  # noqa: E402
from trl_grpo import grpo_config, grpo_trainer  # noqa: E402


def settings(model: str, work: Path, args) -> list[str]:
    """chat_math.py's GRPO recipe, every eval skipped but the last (the accuracy is taken after each phase)."""
    return [
        *recipe_settings(model, work, args.iterations),
        f"eval.every={10**6}",
        f"seed={args.seed}",
        *warm_start_settings(work / "warm_start.jsonl", args.sft_steps, args.sft_lr),
    ]


def ours(work: Path, cfg, iterations: int) -> dict:
    from grpo.record.storage import open_storage
    from stages.init import init_run
    from stages.iteration import run_warm
    from stages.sft import warm_start

    storage = open_storage(str(work / "storage"))
    init_run(storage, "sft-grpo", cfg)
    t0 = time.perf_counter()
    made = warm_start(storage, "sft-grpo")
    sft_s = time.perf_counter() - t0
    after_sft = accuracy(str(Path(made.attempt_dir, "policy")), cfg)
    t1 = time.perf_counter()
    for k, out in run_warm(storage, "sft-grpo", 0, iterations):
        print(f"grpo-flow iteration {k}: reward {out['advantages'].manifest.summary['reward_mean']:.3f}", flush=True)
    grpo_s = time.perf_counter() - t1
    from grpo.record.checkpoint import local_checkpoint

    return {
        "sft_s": sft_s,
        "grpo_s": grpo_s,
        "after_sft": after_sft,
        "after": accuracy(local_checkpoint(out["learn"]), cfg),
    }


def trl(work: Path, model: str, cfg, train_rows: list[dict], args) -> dict:
    """SFTTrainer then GRPOTrainer, the same data and settings; the models saved and scored as grpo-flow's."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from grpo.sampling.base import decode_responses
    from grpo.tasks import get_task
    from stages.prompts import held_out_split

    tok = AutoTokenizer.from_pretrained(model)
    pairs = Dataset.from_list([{"prompt": r["messages"][:2], "completion": r["messages"][2:]} for r in train_rows])
    t0 = time.perf_counter()
    sft_args = SFTConfig(
        output_dir=str(work / "trl-sft"), per_device_train_batch_size=32, max_steps=args.sft_steps,
        learning_rate=args.sft_lr, lr_scheduler_type="constant", use_cpu=True, save_strategy="no", report_to="none",
        logging_steps=max(1, args.sft_steps // 5), seed=args.seed, disable_tqdm=True, adam_beta2=0.99,
    )  # fmt: skip
    sft = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(model, dtype="float32"), args=sft_args, train_dataset=pairs,
        processing_class=tok,
    )  # fmt: skip
    sft.train()
    sft.save_model(str(work / "trl-sft-model"))
    tok.save_pretrained(str(work / "trl-sft-model"))
    sft_s = time.perf_counter() - t0
    after_sft = accuracy(str(work / "trl-sft-model"), cfg)
    task = get_task("math")

    def reward(prompts, completion_ids, ground_truth, **_) -> list[float]:
        texts = decode_responses(tok, completion_ids)
        return [task.reward(t, g, "")["total"] for t, g in zip(texts, ground_truth)]

    train, _ = held_out_split(cfg)
    rng = random.Random(args.seed)
    drawn = [train[rng.randrange(len(train))] for _ in range(64 * args.iterations)]
    prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": e.prompt}] for e in drawn]
    dataset = Dataset.from_dict({"prompt": prompts, "ground_truth": [e.ground_truth for e in drawn]})
    config = grpo_config(
        work / "trl-grpo", batch=64, steps=8, group=8, epochs=2, max_tokens=24, lr=3e-4, schedule="linear",
        max_steps=16 * args.iterations, seed=args.seed, loss_type="grpo", adam_beta2=0.99,
    )  # fmt: skip
    t1 = time.perf_counter()
    grpo = grpo_trainer(config, str(work / "trl-sft-model"), tok, reward, dataset, [])
    grpo.train()
    grpo_s = time.perf_counter() - t1
    grpo.save_model(str(work / "trl-grpo-model"))
    tok.save_pretrained(str(work / "trl-grpo-model"))
    return {
        "sft_s": sft_s,
        "grpo_s": grpo_s,
        "after_sft": after_sft,
        "after": accuracy(str(work / "trl-grpo-model"), cfg),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--problems", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=["trl", "grpo-flow"])
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    import torch

    from grpo.config import load_config
    from grpo.runtime.quiet import quiet_libraries
    from grpo.runtime.threads import apply_threads
    from grpo.tiny_model import build_chat_model
    from stages.prompts import held_out_split

    quiet_libraries()
    apply_threads()
    print(f"machine: {machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    work = Path(args.dir or tempfile.mkdtemp(prefix="sft-then-grpo-"))
    work.mkdir(parents=True, exist_ok=True)
    rows, texts = world(work, args.seed, args.problems)
    model = build_chat_model(str(work / "model"), texts, max_position_embeddings=160, seed=args.seed, **SHAPE)
    cfg = load_config(None, settings(model, work, args))
    train, _ = held_out_split(cfg)
    trained = {e.prompt for e in train}
    train_rows = warm_start_rows([r for r in rows if r["question"] in trained], args.seed)
    pd.DataFrame(train_rows).to_json(work / "warm_start.jsonl", orient="records", lines=True)
    before = accuracy(model, cfg)
    print(f"{len(train)} training problems; held-out greedy accuracy of the model before anything: {before:.3f}")
    results = {}
    if args.only != "trl":
        results["grpo-flow"] = ours(work, cfg, args.iterations)
        print(f"grpo-flow: {results['grpo-flow']}", flush=True)
    if args.only != "grpo-flow":
        import trl as trl_package

        results[f"TRL {trl_package.__version__}"] = trl(work, model, cfg, train_rows, args)
    print(f"\n{'':>12} {'after sft':>9} {'after GRPO':>10} {'sft s':>7} {'GRPO s':>7} {'wall s':>7}")
    for name, r in results.items():
        wall = r["sft_s"] + r["grpo_s"]
        print(
            f"{name:>12} {r['after_sft']:>9.3f} {r['after']:>10.3f} {r['sft_s']:>7.1f} {r['grpo_s']:>7.1f} {wall:>7.1f}"
        )
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
