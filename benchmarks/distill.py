"""On-policy distillation (the `teacher` stage) against TRL's GKDTrainer at equal samples: a small student learns
chat_math.py's word problems from a bigger teacher of the same tokenizer; prints the student's held-out greedy
accuracy and its reverse KL to the teacher per iteration, then TRL's result at the same number of sampled
completions, and both wall times.

    .venv/bin/python benchmarks/distill.py [--iterations 8] [--teacher-steps 600] [--student-steps 100] [--seed 0]

1. Problems, tokenizer and teacher as chat_math.py makes them: a Qwen2 model (hidden 128, 4 layers) with a BPE
   tokenizer trained on the problems' texts, warm-started on the answer format by `grpo sft` (a run `teacher-sft` of
   its own: --teacher-steps steps of 32 of chat_math.warm_start_rows' conversations at lr 3e-3); --teacher-model
   takes a folder made earlier instead.
2. The student: a smaller Qwen2 (hidden 64, 2 layers) with the very same tokenizer files, warm-started by the
   distillation run's own sft section for only --student-steps (the format, few sums). `grpo init` checks the two
   vocabularies agree.
3. Ours: `teacher.mode=reverse_kl` (the per-token reverse KL as the advantage, no reward), by default 64 prompts x 4
   samples an iteration, 4 AdamW steps an iteration, grpo_clip, through the real stages; --set adds settings. TRL:
   GKDTrainer with lmbda=1 (only the student's own samples) and --trl-beta (1: the reverse KL; several: a run
   each), batches of --trl-batch prompts, one completion each, for as many steps as make the same number of
   completions; --lr (or --trl-lr), temperature and max_new_tokens as ours. Both students start from the same folder
   (the warm start's committed policy).
4. Each student's held-out reverse KL, measured one way for the start, ours and TRL's (held_out_reverse_kl).

The settings RESULTS.md's last distillation section measured best (3 seeds against TRL at beta 0 and 1):

    distill.py --seed 0 --iterations 240 --prompts 32 --group-size 1 --lr 1e-3 --set learn.betas=[0.9,0.999] \
        --set teacher.top_k=20 --set teacher.gkd_coef=1 --set teacher.coef=0.01 --trl-beta 0 1
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from chat_math import SHAPE, SYSTEM, accuracy, math_task, solution, warm_start_rows, warm_start_settings, world
from timing import machine

from grpo.config import load_config
from grpo.record.storage import open_storage
from grpo.runtime.quiet import quiet_libraries
from grpo.runtime.threads import apply_threads
from grpo.sampling.base import SamplingSpec
from grpo.sampling.hf import HFGenerator
from grpo.tiny_model import build_chat_model
from stages.init import init_run
from stages.iteration import run_warm
from stages.prompts import eval_prompts, held_out_split
from stages.sft import warm_start

STUDENT = dict(vocab_size=600, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)


def held_out_reverse_kl(model_dir: str, teacher: str, cfg, n: int = 2) -> float:
    """The student's reverse KL to its teacher measured one way for any checkpoint folder (ours, TRL's, the start):
    `n` samples of each held-out prompt at temperature 1 (seed 0), the mean over their tokens of log p_student -
    log p_teacher (the teacher stage's `reverse_kl`, on prompts neither side trains on)."""
    from grpo.episodes import templates
    from grpo.scoring.teacher import load_model, scored_rows

    gen = HFGenerator(model_dir)
    _, ids = templates.tokenize_prompts(
        gen.tokenizer, eval_prompts(cfg), cfg.task.prompt_format, cfg.task.system_prompt
    )
    out = gen.generate(ids, SamplingSpec(n=n, temperature=1.0, max_tokens=cfg.rollout.max_tokens))
    samples = [(p, s) for p, group in zip(ids, out) for s in group]
    model, gaps = load_model(teacher, torch.device("cpu")), []
    for at in range(0, len(samples), 64):
        chunk = samples[at : at + 64]
        responses = [s.response_ids for _, s in chunk]
        scored = scored_rows(model, [p for p, _ in chunk], responses, [[1] * len(r) for r in responses], None, "cpu")
        gaps += [a - b for (_, s), t in zip(chunk, scored) for a, b in zip(s.logprobs, t["teacher_logprobs"])]
    return sum(gaps) / len(gaps)


def trl_gkd(student: str, teacher: str, rows: list[dict], steps: int, args, beta: float, out: str) -> float:
    """TRL's GKDTrainer (GKDConfig.beta `beta`) on `rows` (chat messages), `steps` steps from `student`, saved to
    `out`: its wall seconds."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    tok = AutoTokenizer.from_pretrained(student)
    data = Dataset.from_list([
        {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["question"]},
                      {"role": "assistant", "content": solution(r)}]}
        for r in rows
    ])  # fmt: skip
    config = GKDConfig(
        output_dir=f"{out}-trainer",
        lmbda=1.0,  # the student's own samples only, as every iteration here
        beta=beta,  # 1: the reverse KL (the default), 0: the forward KL, between: the generalized JSD
        temperature=1.0,
        max_new_tokens=args.max_tokens,
        learning_rate=args.trl_lr or args.lr,
        lr_scheduler_type="constant",
        per_device_train_batch_size=args.trl_batch,
        max_steps=steps,
        max_length=160,
        logging_steps=max(steps // 8, 1),
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
    )
    t0, cpu0 = time.time(), time.process_time()
    trainer = GKDTrainer(
        model=AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32),
        teacher_model=AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32),
        args=config,
        train_dataset=data,
        processing_class=tok,
    )
    trainer.train()
    seconds = time.time() - t0
    print(f"TRL: {seconds:.0f} s wall, {time.process_time() - cpu0:.0f} s CPU (the process's threads)", flush=True)
    trainer.model.save_pretrained(out)
    for name in Path(student).iterdir():  # the tokenizer and generation config beside the trained weights
        if name.is_file() and not name.name.startswith("model") and not (Path(out) / name.name).exists():
            shutil.copy(name, out)
    return seconds


def ours(storage, args) -> tuple[int, float, float, str]:
    """The distillation run's iterations, a line each: its sampled completions, held-out accuracy, wall seconds and
    its last policy's folder."""
    print(f"{'iter':>4} {'reverse KL':>10} {'accuracy':>8} {'seconds':>8}")
    start, cpu0, samples = time.time(), time.process_time(), 0
    for k, out in run_warm(storage, "distill", 0, args.iterations):
        kl = out["teacher"].manifest.summary["reverse_kl"]
        samples += out["rollouts"].manifest.summary["samples"]
        acc = out["eval"].manifest.summary.get("exact_match")  # None: an eval eval.every skipped
        shown = "" if acc is None else f"{acc:.3f}"
        print(f"{k:>4} {kl:>10.4f} {shown:>8} {time.time() - start:>8.1f}", flush=True)
    ours_s = time.time() - start
    print(f"{samples} sampled completions: ours ({' '.join(args.set) or 'reverse KL'}) {acc:.3f} in {ours_s:.0f} s")
    print(f"ours: {ours_s:.0f} s wall, {time.process_time() - cpu0:.0f} s CPU (the process's threads)", flush=True)
    return samples, acc, ours_s, str(Path(out["learn"].attempt_dir, "policy"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--problems", type=int, default=2000)
    p.add_argument("--teacher-steps", type=int, default=600)
    p.add_argument("--student-steps", type=int, default=100)
    p.add_argument("--teacher-model", default=None, help="a warm-started teacher folder of this --seed's tokenizer")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--trl-batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None)
    p.add_argument("--set", action="append", default=[], help="settings of our run (e.g. teacher.gkd_coef=1)")
    p.add_argument("--skip-trl", action="store_true", help="our run only (another --set against the same TRL run)")
    p.add_argument("--skip-ours", action="store_true", help="TRL's run only (its sample count is ours': iterations x "
                   "prompts x group size)")  # fmt: skip
    p.add_argument("--trl-lr", type=float, default=None, help="TRL's learning rate (default: --lr)")
    p.add_argument("--trl-beta", type=float, nargs="+", default=[1.0],
                   help="GKDConfig.beta, a TRL run each: 1 the reverse KL, 0 the forward KL")  # fmt: skip
    args = p.parse_args()
    quiet_libraries()
    apply_threads()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"machine: {machine()}; {gpu}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    work = Path(args.dir or tempfile.mkdtemp(prefix="grpo-distill-"))
    work.mkdir(parents=True, exist_ok=True)
    rows, texts = world(work, args.seed, args.problems)
    student0 = build_chat_model(str(work / "student0"), texts, max_position_embeddings=160, seed=args.seed, **STUDENT)
    settings = [
        "eval.split_fraction=0.2",
        "eval.n_prompts=200",
        "rollout.backend=hf",
        f"rollout.prompts_per_iteration={args.prompts}",
        f"rollout.group_size={args.group_size}",
        f"rollout.max_tokens={args.max_tokens}",
        f"learn.minibatch_size={args.prompts * args.group_size // 4}",
        f"learn.microbatch_size={args.prompts * args.group_size // 4}",
        f"learn.lr={args.lr}",
        "learn.epochs=1",
        "learn.lr_decay_steps=0",
        "learn.mixed_precision=no",
        f"eval.every={args.iterations}",  # the last iteration's only: the wall time is the training's, as TRL's
        f"seed={args.seed}",
        *(["advantage.mode=centered"] if args.group_size < 2 else []),  # one sample a prompt: no group std
    ]
    cfg = load_config(None, [*math_task(student0, work / "problems.parquet"), *settings])
    trained = {e.prompt for e in held_out_split(cfg)[0]}
    train_rows = [r for r in rows if r["question"] in trained]  # warm starts and TRL see training problems only
    pd.DataFrame(warm_start_rows(train_rows, args.seed)).to_json(
        work / "warm_start.jsonl", orient="records", lines=True
    )
    storage = open_storage(str(work / "storage"))
    t0 = time.time()
    if args.teacher_model:
        teacher = str(shutil.copytree(args.teacher_model, work / "teacher"))
    else:  # `grpo sft` on a run of the teacher's own (its sft section only: no iteration of it runs)
        teacher0 = build_chat_model(str(work / "teacher0"), texts, max_position_embeddings=160, seed=args.seed, **SHAPE)
        sft = warm_start_settings(work / "warm_start.jsonl", args.teacher_steps, 3e-3)
        init_run(
            storage,
            "teacher-sft",
            load_config(None, [*math_task(teacher0, work / "problems.parquet"), *settings, *sft]),
        )
        teacher = str(Path(warm_start(storage, "teacher-sft").attempt_dir, "policy"))
    teacher_s = time.time() - t0
    sft = warm_start_settings(work / "warm_start.jsonl", args.student_steps, 3e-3)
    cfg = load_config(
        None,
        [*math_task(student0, work / "problems.parquet"), *settings, *sft, f"teacher.model={teacher}", *args.set],
    )
    init_run(storage, "distill", cfg)
    t1 = time.time()
    student = str(Path(warm_start(storage, "distill").attempt_dir, "policy"))  # iteration 0's policy; TRL's start
    print(
        f"{len(train_rows)} training problems; teacher {accuracy(teacher, cfg):.3f} and student "
        f"{accuracy(student, cfg):.3f} held-out greedy accuracy after their `grpo sft` warm starts "
        f"({teacher_s:.0f} s and {time.time() - t1:.0f} s with the accuracies)",
        flush=True,
    )
    kl0 = held_out_reverse_kl(student, teacher, cfg)
    if args.skip_ours:
        samples, acc, ours_s = args.iterations * args.prompts * args.group_size, float("nan"), float("nan")
    else:
        samples, acc, ours_s, last = ours(storage, args)
        kl = held_out_reverse_kl(last, teacher, cfg)
        print(f"held-out reverse KL (2 samples a prompt): start {kl0:.3f}, ours {kl:.3f}")
    if args.skip_trl:
        return
    steps = samples // args.trl_batch
    for beta in args.trl_beta:
        out = str(work / f"student-trl-beta{beta:g}")
        trl_s = trl_gkd(student, teacher, train_rows, steps, args, beta, out)
        trl_acc, trl_kl = accuracy(out, cfg), held_out_reverse_kl(out, teacher, cfg)
        print(
            f"{samples} sampled completions each: ours ({' '.join(args.set) or 'reverse KL'}) accuracy {acc:.3f} in "
            f"{ours_s:.0f} s; TRL GKDTrainer (lmbda=1, beta={beta:g}, lr {args.trl_lr or args.lr:g}, {steps} steps "
            f"of {args.trl_batch}) accuracy {trl_acc:.3f} in {trl_s:.0f} s, held-out reverse KL {kl0:.3f} -> "
            f"{trl_kl:.3f}; work {work}",
            flush=True,
        )


if __name__ == "__main__":
    main()
