"""A small chat model learns to use a calculator: grpo-flow's episodes and TRL's GRPOTrainer side by side.

    .venv/bin/python benchmarks/agent_calculator.py [--iterations 8] [--seed 0] [--only trl|grpo-flow]
        [--warm-model DIR/model]   # an earlier run's warm start, not made again

1. Word problems (grpo/tasks/calculator.py): a one-digit number times a four-digit one, or their sum, numbers in
   words, which a model of this size cannot work out in its head; a seeded set is held out.
2. A Qwen2 model built here (byte-level BPE, Qwen2.5's own chat template with tools), warm-started by `grpo sft` on
   transcripts (a `messages` dataset, the assistant's turns trained): `--tool-share` of them call `calculate` in
   Qwen's `<tool_call>{json}</tool_call>` format (`--op-noise` of those with an operation drawn at random, not the
   sentence's) and say the calculator's "The answer is N." again; the rest state the result straight away (which
   the model can only guess). By default every transcript calls the tool with a random operation: the warm start
   calls it and picks the operation by chance, and GRPO has to learn which operation each sentence asks for.
3. GRPO on both sides with the same model, environment class (`Calculator`, TRL's `environment_factory`
   contract, unchanged), reward (`correct_answer` + 0.5 x `correct_tool_use`), episodes per iteration,
   optimizer steps and learning rate; after every iteration the held-out problems are played greedily,
   calculator in hand, by one function (`held_out`) for both sides: accuracy, the share that pressed the
   right operation and the share that copied the calculator's result (whichever operation). Prints both
   curves and each side's wall time (training and its evals, from the start of its trainer or run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import machine  # noqa: E402
from trl_grpo import grpo_config, grpo_trainer  # noqa: E402

from grpo.tasks.calculator import (  # noqa: E402
    OPERATIONS,
    SYSTEM,
    TOOL_USE_WEIGHT,
    Calculator,
    correct_answer,
    correct_tool_use,
    final_answer,
    problem,
)
from grpo.tiny_model import TOOLS_CHAT_TEMPLATE, build_chat_model  # noqa: E402

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
BETAS = (0.9, 0.99)  # AdamW's, both sides
SHAPE = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384)


def tools_of(env) -> list:
    """The environment's tools as TRL finds them: its public methods but reset."""
    return [getattr(env, n) for n in dir(type(env)) if not n.startswith("_") and n != "reset"]


def prompt_of(row: dict) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["question"]}]


def call_text(row: dict) -> str:
    """The tool call as Qwen2.5's template renders it (an assistant turn with no text)."""
    call = {"name": "calculate", "arguments": {"operation": row["operation"]}}
    return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"


def observation_ids(tok, name: str, result: str) -> list[int]:
    """The ids the template puts between an assistant turn's end (eos) and the next turn: the tool's
    result as a message and the assistant header, found by rendering with and without it."""
    call = [{"type": "function", "function": {"name": name, "arguments": {}}}]
    head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": call}]
    before = tok.apply_chat_template(head, tokenize=False)
    after = tok.apply_chat_template(
        head + [{"role": "tool", "name": name, "content": result}], tokenize=False, add_generation_prompt=True
    )
    before = before[: before.rindex(tok.eos_token) + len(tok.eos_token)]
    return tok(after[len(before) :], add_special_tokens=False)["input_ids"]


def make_world(root: Path, n: int, held: int, seed: int, vocab: int) -> tuple[str, list[dict], list[dict]]:
    """The model folder (random weights), training problems, held-out problems (distinct questions)."""
    rng = random.Random(seed)
    rows = list({r["question"]: r for r in (problem(rng) for _ in range(n + held))}.values())
    train, test = rows[held:], rows[:held]
    from transformers import AutoTokenizer

    texts = []
    probe = build_chat_model(str(root / "probe"), ["x"], vocab_size=260, chat_template=TOOLS_CHAT_TEMPLATE)
    tok, tools = AutoTokenizer.from_pretrained(probe), tools_of(Calculator())
    for r in train[:500]:
        p = tok.apply_chat_template(prompt_of(r), tools=tools, tokenize=False, add_generation_prompt=True)
        texts.append(
            p + call_text(r) + f"<tool_response>\nThe answer is {r['answer']}.\n</tool_response>The answer is 1."
        )
    model = build_chat_model(
        str(root / "model"), texts, vocab_size=vocab, max_position_embeddings=512, seed=seed,
        chat_template=TOOLS_CHAT_TEMPLATE, split_digits=True, **SHAPE,
    )  # fmt: skip
    return model, train, test


def conversation(row: dict, operation: str | None) -> list[dict]:
    """A warm-start transcript as chat messages (TRL's `messages` shape): the prompt, then with an `operation` its call
    and the calculator's answer, and "The answer is N." (the calculator's N, right or wrong; without a call the
    problem's, which the model can only guess)."""
    said = f"The answer is {row['answer']}."
    turns = prompt_of(row)
    if operation is not None:
        env = Calculator()
        env.reset(**row)
        said = env.calculate(operation)
        call = {"type": "function", "function": {"name": "calculate", "arguments": {"operation": operation}}}
        turns += [{"role": "assistant", "content": "", "tool_calls": [call]}]
        turns += [{"role": "tool", "name": "calculate", "content": said}]
    return turns + [{"role": "assistant", "content": said}]


def transcript(tok, tools, row: dict, operation: str | None) -> tuple[list[int], list[int]]:
    """A warm-start transcript's ids and loss mask (1 on the assistant's tokens) as `grpo sft` makes them
    (grpo.episodes.transcripts: turn by turn, as the episode loop appends them)."""
    from grpo.episodes.transcripts import conversation_episode

    e = conversation_episode(tok, conversation(row, operation), tools, [tok.eos_token])
    return e.prompt_ids + e.response_ids, [0] * len(e.prompt_ids) + e.loss_mask


def warm_start(root: Path, model_dir: str, train: list[dict], test: list[dict], args) -> None:
    """`grpo sft` on --sft-problems transcripts, `--tool-share` of them calling the calculator (`--op-noise` of those
    with an operation drawn at random, not the sentence's), loss on the assistant's tokens only, batches of 16: a
    scratch run of the recipe's config whose warm-started policy replaces the model in `model_dir`, which both
    sides start from."""
    import pandas as pd
    from transformers.utils import get_json_schema

    from grpo.config import load_config
    from grpo.record.storage import open_storage
    from stages.init import init_run
    from stages.sft import sft

    rng, tools = random.Random(args.seed), [get_json_schema(f) for f in tools_of(Calculator())]
    rows = []
    for r in train[: args.sft_problems]:
        operation = rng.choice(sorted(OPERATIONS)) if rng.random() < args.op_noise else r["operation"]
        rows.append(
            {"messages": conversation(r, operation if rng.random() < args.tool_share else None), "tools": tools}
        )
    pd.DataFrame(rows).to_json(root / "transcripts.jsonl", orient="records", lines=True)
    warm = [f"sft.dataset={root / 'transcripts.jsonl'}", f"sft.steps={args.sft_steps}", f"sft.lr={args.sft_lr}"]
    warm += ["sft.minibatch_size=16", "sft.microbatch_size=16"]
    storage = open_storage((root / "warm-start").as_uri())
    init_run(storage, "warm-start", load_config(None, ours_config(root, model_dir, train, test, args) + warm))
    made = sft(storage, "warm-start")
    print(f"warm start: {args.sft_steps} steps, loss {made.manifest.summary['loss']:.3f}", flush=True)
    for f in Path(made.attempt_dir, "policy").iterdir():  # the weights it made (the tokenizer is the model's)
        if f.suffix in (".safetensors", ".json") and not f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, Path(model_dir, f.name))


@torch.no_grad()
def held_out(model, tok, rows: list[dict], max_turns: int = 3, max_tokens: int = 40) -> dict:
    """Greedy episodes of the held-out problems with a Calculator each, played in batches turn by turn
    (the observation's ids appended to the sampled ones, never re-tokenized): the share answered right, the
    share whose episode pressed the operation the problem needs, and of the episodes that pressed, the share whose
    answer is the last result they were told (the warm start's copy, right operation or wrong)."""
    was_training = model.training
    model.eval()
    envs = [Calculator() for _ in rows]
    tools = tools_of(envs[0])
    seqs, texts = [], [[] for _ in rows]
    for env, r in zip(envs, rows):
        env.reset(**r)
        seqs.append(tok.apply_chat_template(prompt_of(r), tools=tools, add_generation_prompt=True, return_dict=False))
    live = list(range(len(rows)))
    eos = {tok.eos_token_id, tok.pad_token_id}
    for _ in range(max_turns):
        if not live:
            break
        width = max(len(seqs[i]) for i in live)
        ids = torch.tensor([[tok.pad_token_id] * (width - len(seqs[i])) + seqs[i] for i in live])
        attention = torch.tensor([[0] * (width - len(seqs[i])) + [1] * len(seqs[i]) for i in live])
        out = model.generate(
            input_ids=ids, attention_mask=attention, max_new_tokens=max_tokens, do_sample=False,
            eos_token_id=list(eos), pad_token_id=tok.pad_token_id,
        )  # fmt: skip
        going = []
        for i, row in zip(live, out[:, width:].tolist()):
            turn = row[: next((k + 1 for k, t in enumerate(row) if t in eos), len(row))]
            seqs[i] = seqs[i] + turn
            text = tok.decode(turn, skip_special_tokens=True)
            texts[i].append(text)
            call = TOOL_CALL.search(text)
            if call is None or turn[-1] not in eos:
                continue
            try:
                call = json.loads(call.group(1))
                name, result = call["name"], str(getattr(envs[i], call["name"])(**call["arguments"]))
            except Exception as e:  # a malformed call: its error is what the model sees, as TRL shows it
                name, result = "calculate", str({"error": str(e)})
            seqs[i] = seqs[i] + observation_ids(tok, name, result)
            going.append(i)
        live = going
    model.train(was_training)
    right = [final_answer(t[-1]) == int(r["answer"]) for t, r in zip(texts, rows)]
    used = [any(result == int(r["answer"]) for _, result in env.calls) for env, r in zip(envs, rows)]
    copied = [final_answer(t[-1]) == env.calls[-1][1] for t, env in zip(texts, envs) if env.calls]
    n = len(rows)  # copy: of the episodes that pressed, the share whose answer is the last result they were told
    return {"accuracy": sum(right) / n, "tool_use": sum(used) / n, "copy": sum(copied) / max(1, len(copied))}


def reward_total(completions, environments, answer, **_) -> list[float]:
    """The recipe's reward: correct_answer + 0.5 x correct_tool_use (one function, as both sides log it)."""
    right = correct_answer(completions, answer)
    used = correct_tool_use(completions, environments, answer)
    return [r + TOOL_USE_WEIGHT * u for r, u in zip(right, used)]


def trl_side(root: Path, model_dir: str, train: list[dict], test: list[dict], args) -> dict:
    """TRL's GRPOTrainer(environment_factory=Calculator): the held-out curve after each iteration and the
    wall time from the trainer's construction to the last eval."""
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback

    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = args.prompts * args.group // args.steps  # samples an optimizer step
    curve: list[dict] = []

    class Eval(TrainerCallback):
        """After each iteration's steps (TRL logs once an iteration): the held-out episodes, and the iteration's
        mean reward and tool calls an episode as TRL logged them."""

        def on_log(self, a, state, control, logs=None, model=None, **kw):
            if "reward" not in (logs or {}):
                return  # the summary at the end of training
            curve.append({**held_out(model, tok, test), "seconds": time.perf_counter() - start})
            calls = float(logs.get("tools/call_frequency", 0))
            trained = f"reward {float(logs['reward']):.3f}, tool calls an episode {calls:.2f}"
            print(f"TRL iteration {len(curve) - 1}: {trained}; {fmt(curve[-1])}", flush=True)

    dataset = Dataset.from_list(
        [{"prompt": prompt_of(r), "answer": r["answer"], "a": r["a"], "b": r["b"]} for r in train]
    )
    config = grpo_config(
        root / "trl",
        batch=batch,
        steps=args.steps,
        group=args.group,
        epochs=args.epochs,  # passes over an iteration's episodes: learn.epochs
        max_tokens=args.max_tokens,
        lr=args.lr,
        schedule=args.schedule,  # linear: to 0 over max_steps
        max_steps=args.steps * args.epochs * args.iterations,
        seed=args.seed,
        max_tool_calling_iterations=2,
        loss_type="grpo",  # grpo-flow's default aggregation (each sequence's token mean, then the mean)
        adam_beta2=BETAS[1],  # TRL's default 0.999, grpo-flow's 0.99: the same on both sides
    )
    start = time.perf_counter()
    trainer = grpo_trainer(config, model_dir, tok, reward_total, dataset, [Eval()], environment_factory=Calculator)
    trainer.remove_callback(PrinterCallback)  # its log dicts between the curve's lines
    trainer.train()
    return {"curve": curve, "seconds": time.perf_counter() - start}


def ours_config(root: Path, model_dir: str, train: list[dict], test: list[dict], args) -> list[str]:
    """grpo-flow's settings for the recipe: the same model, class, reward, episodes an iteration, optimizer steps,
    learning rate and token budget as TRL's side; the held-out problems a dataset of their own (scored by `held_out`
    after every iteration, as TRL's are; the eval stage runs once, at the end)."""
    import pandas as pd

    for name, rows in (("train", train), ("held_out", test)):
        pd.DataFrame(rows)[["question", "answer", "a", "b"]].to_parquet(root / f"{name}.parquet")
    batch = args.prompts * args.group // args.steps
    return [
        f"model.base_model={model_dir}",
        "task.name=math",
        f"task.dataset={root / 'train.parquet'}",
        "task.prompt_column=question",
        "task.answer_column=answer",
        "task.prompt_format=chat",
        f"task.system_prompt={SYSTEM}",
        "rollout.environment=grpo.tasks.calculator:Calculator",  # TRL's environment_factory class, unchanged
        "reward.functions=[grpo.tasks.calculator:reward]",
        "rollout.max_turns=3",  # TRL: max_tool_calling_iterations=2, so at most 3 turns
        f"rollout.max_tokens={args.max_tokens}",  # an episode's tokens after the prompt, as max_completion_length
        "rollout.backend=hf",
        f"rollout.prompts_per_iteration={args.prompts}",
        f"rollout.group_size={args.group}",
        f"learn.minibatch_size={batch}",
        f"learn.microbatch_size={batch}",
        f"learn.epochs={args.epochs}",
        "learn.kl_coef=0",
        f"learn.lr={args.lr}",
        f"learn.betas={list(BETAS)}",
        f"learn.lr_decay_steps={args.steps * args.epochs * args.iterations * (args.schedule == 'linear')}",  # as TRL
        "learn.mixed_precision=no",
        f"eval.dataset={root / 'held_out.parquet'}",
        f"eval.n_prompts={len(test)}",
        f"eval.every={10**6}",
        f"seed={args.seed}",
        *args.set,
    ]


def ours_side(root: Path, model_dir: str, train: list[dict], test: list[dict], args) -> dict:
    """grpo-flow's iterations in this process (warm), the held-out curve after each and the wall time from the
    run's init to the last eval."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.config import load_config
    from grpo.record.checkpoint import local_checkpoint
    from grpo.record.storage import open_storage
    from stages.init import init_run
    from stages.iteration import run_warm

    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = load_config(None, ours_config(root, model_dir, train, test, args))
    storage = open_storage((root / "storage").as_uri())
    curve: list[dict] = []
    start = time.perf_counter()
    init_run(storage, "calculator", cfg)
    for k, out in run_warm(storage, "calculator", 0, args.iterations):
        policy = AutoModelForCausalLM.from_pretrained(local_checkpoint(out["learn"]), dtype="float32")
        curve.append({**held_out(policy, tok, test), "seconds": time.perf_counter() - start})
        calls = out["rollouts"].manifest.summary["tool_calls"] / (args.prompts * args.group)
        trained = f"reward {out['advantages'].manifest.summary['reward_mean']:.3f}, tool calls an episode {calls:.2f}"
        print(f"grpo-flow iteration {k}: {trained}; {fmt(curve[-1])}", flush=True)
    return {"curve": curve, "seconds": time.perf_counter() - start, "storage": storage.url}


def fmt(point: dict) -> str:
    return (
        f"held-out accuracy {point['accuracy']:.3f}, correct tool use {point['tool_use']:.3f}, "
        f"answer copies the result {point['copy']:.3f}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--prompts", type=int, default=16, help="prompts an iteration")
    p.add_argument("--group", type=int, default=8, help="episodes a prompt")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps an epoch (1: all episodes a step)")
    p.add_argument("--epochs", type=int, default=8, help="passes over an iteration's episodes")
    p.add_argument("--max-tokens", type=int, default=96, help="an episode's sampled and observed tokens")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--schedule", choices=["linear", "constant"], default="linear", help="lr: linear to 0 over the run")
    p.add_argument("--problems", type=int, default=2000)
    p.add_argument("--held-out", type=int, default=200)
    p.add_argument("--vocab", type=int, default=600)
    p.add_argument("--sft-steps", type=int, default=600)
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--sft-problems", type=int, default=400, help="warm-start transcripts")
    p.add_argument("--tool-share", type=float, default=1.0, help="share of warm-start transcripts calling the tool")
    p.add_argument("--op-noise", type=float, default=1.0, help="share of warm-start calls pressing a random operation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=["trl", "grpo-flow"])
    p.add_argument("--set", action="append", default=[], help="grpo-flow settings on top of the recipe")
    p.add_argument("--warm-model", default=None, help="the model folder (DIR/model) of an earlier run: its warm start")
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    from grpo.runtime.quiet import quiet_libraries
    from grpo.runtime.threads import apply_threads

    quiet_libraries()
    apply_threads()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory's "experimental" warning
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")  # TRL samples with transformers here
    root = Path(args.dir or tempfile.mkdtemp(prefix="agent-calculator-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads; folder {root}")
    t0 = time.perf_counter()
    model_dir, train, test = make_world(root, args.problems, args.held_out, args.seed, args.vocab)
    if args.warm_model:  # an earlier run's warm start (same --seed, --problems, --held-out, --vocab)
        shutil.rmtree(model_dir)
        model_dir = str(shutil.copytree(args.warm_model, model_dir))
    else:
        warm_start(root, model_dir, train, test, args)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    before = held_out(AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32"), tok, test)
    print(f"warm start ({time.perf_counter() - t0:.0f} s): {fmt(before)}", flush=True)
    results = {}
    if args.only != "trl":
        results["grpo-flow"] = ours_side(root, model_dir, train, test, args)
    if args.only != "grpo-flow":
        import trl

        results[f"TRL {trl.__version__}"] = trl_side(root, model_dir, train, test, args)
    print(f"\n{'':>16} {'by iteration, the warm start first':>40} {'wall s':>8}")
    for name, r in results.items():
        for key in ("accuracy", "tool_use", "copy"):
            curve = " ".join(f"{c[key]:.2f}" for c in [before, *r["curve"]])
            wall = f"{r['seconds']:.1f}" if key == "accuracy" else ""
            print(f"{name + ' ' + key:>16} {curve:>40} {wall:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
