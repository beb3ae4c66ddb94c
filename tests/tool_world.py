"""A world for the episode tests (grpo/episodes): a tiny Qwen2 chat model with Qwen2.5's own tool template,
warm-started by `grpo sft` on a few calculator transcripts so that it calls the tool (and, sampled at temperature 1,
sometimes botches the call, answers at once or calls on), a dataset of multiplication questions, tools as plain
functions (TRL's `tools=`), an environment class written for TRL's `environment_factory`, and reward functions.

`world(root)` copies it into `root`, built once per test run (tests/once.py): 100 steps of `grpo sft`, 10-20 s on a busy
CPU.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pandas as pd
from once import copy_of

from grpo.tiny_model import TOOLS_CHAT_TEMPLATE, build_chat_model

TOOLS = '''"""Tools as a TRL user passes them to GRPOTrainer(tools=[...])."""
import os
import time


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    if os.environ.get("TOOL_LOG"):  # the tests count the calls that ran
        with open(os.environ["TOOL_LOG"], "a") as f:
            f.write(f"{a} {b}\\n")
    if a == 13 or b == 13:
        time.sleep(30)  # past rollout.tool_timeout_s: the call is interrupted
    if a * b > 300:
        raise ValueError("too large for this calculator")
    return a * b


def secret() -> str:
    """Read a credential the workers must not have."""
    return os.environ.get("AWS_SECRET_ACCESS_KEY", "none")
'''

ENVIRONMENT = '''"""A calculator environment, written for TRL's GRPOTrainer(environment_factory=Calculator)."""


class Calculator:
    def __init__(self):
        self.products = []
        self.answer = None

    def reset(self, **kwargs) -> str | None:
        self.products = []
        self.answer = int(kwargs["answer"])
        return " Use the calculator."  # tool_world.HINT

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        if a * b > 300:
            raise ValueError("too large for this calculator")
        self.products.append(a * b)
        return a * b

    def get_reward(self) -> float:
        return float(self.answer in self.products)


def used_the_calculator(environments, **kwargs) -> list[float]:
    """A TRL reward function over the episodes' environments."""
    return [float(len(env.products) > 0) for env in environments]
'''

REWARDS = '''"""Reward functions of the episode tests, in this project's form."""


def answered(response, ground_truth, prompt, messages):
    """1 when the last assistant turn states the product."""
    last = [m for m in messages if m["role"] == "assistant"][-1]
    return float(str(ground_truth) in (last.get("content") or ""))


def tool_turns(response, ground_truth, prompt, messages):
    """How many tool results the episode read."""
    return float(sum(m["role"] == "tool" for m in messages))


def calculator(response, ground_truth, prompt, environment):
    """What the TRL class left: 1 when a product it computed is the answer."""
    return float(environment is not None and int(ground_truth) in environment.products)
'''


def multiply_schema() -> dict:
    from transformers.utils import get_json_schema

    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return a * b

    return get_json_schema(multiply)


HINT = " Use the calculator."  # what the TRL class's reset adds to the question


def question(a: int, b: int) -> str:
    return f"What is {a} times {b}?"


def transcript(a: int, b: int, rng: random.Random) -> list[dict]:
    """A conversation the warm start learns from: a call, its result, the answer; sometimes a second call first."""
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    hint = HINT if rng.random() < 0.5 else ""  # as the TRL class's reset appends it
    turns = [{"role": "user", "content": question(a, b) + hint}]
    if rng.random() < 0.3:  # a wrong first call, then the right one: episodes of three turns
        wrong = {"type": "function", "function": {"name": "multiply", "arguments": {"a": b, "b": a + 1}}}
        turns += [
            {"role": "assistant", "content": "", "tool_calls": [wrong]},
            {"role": "tool", "name": "multiply", "content": str(b * (a + 1))},
        ]
    return turns + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "multiply", "content": str(a * b)},
        {"role": "assistant", "content": f"The answer is {a * b}."},
    ]


def warm_start(root: Path, conversations: list[list[dict]], steps: int = 200) -> None:
    """The model in root/model warm-started by `grpo sft` on `conversations` (the assistant's turns trained, as
    episodes mask them), so it writes tool calls: a scratch run in root/warm whose sft policy replaces the model."""
    from grpo.config import load_config
    from grpo.record.storage import open_storage
    from stages.init import init_run
    from stages.sft import sft

    schema = multiply_schema()
    rows = [{"messages": c, "tools": [schema]} for c in conversations]
    pd.DataFrame(rows).to_json(root / "transcripts.jsonl", orient="records", lines=True)
    warm = [
        f"sft.dataset={root / 'transcripts.jsonl'}",
        f"sft.steps={steps}",
        "sft.lr=3e-3",
        "learn.mixed_precision=no",
    ]
    storage = open_storage(str(root / "warm"))
    init_run(storage, "warm", load_config(None, config(root) + warm))
    made = Path(sft(storage, "warm").attempt_dir, "policy")
    for f in ("model.safetensors", "config.json"):  # the weights the warm start made; the tokenizer is the model's
        shutil.copy(made / f, root / "model" / f)
    shutil.rmtree(root / "warm")


def world(root: Path, hidden_size: int = 64, num_layers: int = 2, steps: int = 100) -> Path:
    """The world in `root` (model/, questions.parquet, tools.py, calculator_env.py, rewards.py); the model's width and
    depth as given (head_dim 32: vLLM's CPU backend needs >= 32), warm-started `steps` steps."""
    name = f"tool-world-{hidden_size}-{num_layers}-{steps}"
    return copy_of(name, lambda folder: build(folder, hidden_size, num_layers, steps), root)


def build(root: Path, hidden_size: int, num_layers: int, steps: int) -> None:
    """Build the world in `root` (see `world`)."""
    rng = random.Random(0)
    pairs = [(a, b) for a in range(2, 16) for b in range(2, 10)]
    rng.shuffle(pairs)
    from transformers import PreTrainedTokenizerFast

    from grpo.tiny_model import build_chat_tokenizer

    shaper: PreTrainedTokenizerFast = build_chat_tokenizer(["x"], 300, TOOLS_CHAT_TEMPLATE)  # renders the texts
    schema = multiply_schema()
    conversations = [transcript(a, b, rng) for a, b in pairs]
    texts = [shaper.apply_chat_template(c, tools=[schema], tokenize=False) for c in conversations]
    texts += [shaper.apply_chat_template(transcript(a, b, rng)[:1], tokenize=False) for a, b in pairs[:8]]
    model = str(root / "model")
    heads = hidden_size // 32
    shape = {
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": heads,
        "num_kv_heads": max(1, heads // 2),
    }
    shape["intermediate_size"] = 2 * hidden_size
    build_chat_model(
        model, texts, vocab_size=600, max_position_embeddings=512, chat_template=TOOLS_CHAT_TEMPLATE, **shape
    )
    rows = [{"question": question(a, b), "answer": str(a * b), "level": a % 3} for a, b in pairs]
    pd.DataFrame(rows).to_parquet(root / "questions.parquet")
    (root / "tools.py").write_text(TOOLS)
    (root / "calculator_env.py").write_text(ENVIRONMENT)
    (root / "rewards.py").write_text(REWARDS)
    (root / "world.json").write_text(json.dumps({"pairs": pairs}))
    if steps:
        warm_start(root, conversations, steps)


def config(root: Path, *extra: str) -> list[str]:
    """A small run of episodes with the tools (override with `extra`)."""
    return [
        f"model.base_model={root / 'model'}",
        "task.name=math",
        f"task.dataset={root / 'questions.parquet'}",
        "task.prompt_column=question",
        "task.answer_column=answer",
        f"rollout.tools=[{root / 'tools.py'}:multiply]",
        f"reward.functions=[{root / 'rewards.py'}:answered]",
        "rollout.backend=hf",
        "rollout.prompts_per_iteration=4",
        "rollout.group_size=4",
        "rollout.max_tokens=120",
        "rollout.max_turns=3",
        "rollout.tool_timeout_s=1",
        "rollout.tool_workers=2",
        "learn.minibatch_size=16",
        "learn.microbatch_size=16",
        "learn.epochs=1",
        "eval.n_prompts=4",
        "eval.split_fraction=0.1",
        "reward.workers=1",
        *extra,
    ]
