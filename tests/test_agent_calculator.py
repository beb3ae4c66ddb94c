"""The calculator recipe (grpo/tasks/calculator.py, benchmarks/agent_calculator.py): its chat template is the one TRL
parses tool calls with, its warm-start transcripts are what the chat template renders, and TRL's side runs end to end
at toy size, so the comparison cannot rot."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import agent_calculator as bench  # noqa: E402

from grpo.tasks.calculator import OPERATIONS, Calculator, problem, reward  # noqa: E402
from grpo.tiny_model import TOOLS_CHAT_TEMPLATE, build_chat_model  # noqa: E402


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    rows = [problem(random.Random(i)) for i in range(40)]
    texts = [f"{r['question']} {bench.call_text(r)} {r['answer']} The answer is {r['answer']}." for r in rows]
    folder = tmp_path_factory.mktemp("calc") / "model"
    model = build_chat_model(str(folder), texts, chat_template=TOOLS_CHAT_TEMPLATE, split_digits=True)
    return AutoTokenizer.from_pretrained(model)


def test_the_tools_template_is_qwen2_5_s_so_trl_parses_its_tool_calls(tok):
    trl_templates = pytest.importorskip("trl.chat_template_utils")

    assert TOOLS_CHAT_TEMPLATE == trl_templates.qwen2_5_chat_template
    assert trl_templates.supports_tool_calling(tok) and trl_templates.is_chat_template_prefix_preserving(tok)
    row = problem(random.Random(0))
    parsed = trl_templates.add_response_schema(tok).parse_response(bench.call_text(row) + tok.eos_token, prefix="")
    assert parsed["tool_calls"][0]["function"] == {"name": "calculate", "arguments": {"operation": row["operation"]}}


def test_a_warm_start_transcript_is_the_conversation_the_template_renders(tok):
    """Built a turn at a time, as the episode loop appends ids (the observation's ids between the turns); decoded,
    it is the whole conversation as the chat template renders it, and the loss mask covers the two turns alone."""
    row, env = problem(random.Random(1)), Calculator()
    tools = bench.tools_of(env)
    ids, mask = bench.transcript(tok, tools, row, row["operation"])
    conversation = bench.prompt_of(row) + [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "calculate", "arguments": {"operation": row["operation"]}}}]},
        {"role": "tool", "name": "calculate", "content": f"The answer is {row['answer']}."},
        {"role": "assistant", "content": f"The answer is {row['answer']}."},
    ]  # fmt: skip
    rendered = tok.apply_chat_template(conversation, tools=tools, tokenize=False)
    assert tok.decode(ids) == rendered.removesuffix("\n")  # the template's newline after the last <|im_end|>
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert trained == bench.call_text(row) + tok.eos_token + f"The answer is {row['answer']}." + tok.eos_token


def test_whichever_operation_a_warm_start_transcript_presses_its_answer_copies_the_result_at_one_offset(tok):
    """The recipe's premise (grpo/tasks/calculator.py, `problem`): the warm start teaches the copy, RL the choice of
    operation. Every result, right or wrong operation, has 4 digits, one token each, and the trained answer repeats
    them at the same distance from the observation's in every transcript, so an episode that pressed the wrong
    operation copies as surely as a right one and only the operation's token tells them apart."""
    tools, offsets = bench.tools_of(Calculator()), set()
    for i in range(40):
        row = problem(random.Random(i))
        for operation in sorted(OPERATIONS):
            ids, mask = bench.transcript(tok, tools, row, operation)
            result = str(OPERATIONS[operation](row["a"], row["b"]))
            digits = [k for k, t in enumerate(ids) if tok.decode([t]) in set("0123456789")]
            assert len(result) == 4 and [tok.decode([ids[k]]) for k in digits] == list(result + result)
            told, said = digits[:4], digits[4:]
            assert not any(mask[k] for k in told) and all(mask[k] for k in said)  # the copy alone is trained
            offsets |= {s - t for s, t in zip(said, told)}
    assert len(offsets) == 1


def test_the_recipe_s_reward_is_the_two_trl_rewards_on_one_episode():
    row, env = problem(random.Random(2)), Calculator()
    env.reset(**row)
    env.calculate(operation=row["operation"])
    said = [{"role": "assistant", "content": f"The answer is {row['answer']}."}]
    assert reward("", row["answer"], "", env, said) == {"correct": 1.0, "tool_use": 1.0, "total": 1.5}
    guessed = [{"role": "assistant", "content": "The answer is 12."}]
    assert reward("", row["answer"], "", Calculator(), guessed)["total"] == 0.0  # its calls: reset never ran


@pytest.mark.slow
def test_trl_s_side_runs_end_to_end_at_toy_size(tmp_path):
    pytest.importorskip("trl")
    args = ["--only", "trl", "--iterations", "2", "--prompts", "2", "--group", "4", "--steps", "1", "--sft-steps", "2"]
    args += ["--held-out", "4", "--problems", "60", "--sft-problems", "20", "--dir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "benchmarks/agent_calculator.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "GRPO_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] == ["TRL"]]
    curve = next(row for row in table if row[2] == "accuracy")  # TRL, its version, the key; 3 points; wall seconds
    assert len(curve) == 3 + 3 + 1 and float(curve[-1]) > 0
    assert sum(row[1] == "iteration" for row in table) == 2  # a line each iteration, its reward and tool calls
