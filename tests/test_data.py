"""User datasets: formats, column mapping, chat prompts, held-out split and epoch draws; the math reward."""

import doctest
import json

import pandas as pd
import pytest

import flows.artifacts
import flows.commands.runs
import flows.tasks
import grpo.data
import grpo.progress
import grpo.tasks.functions
import grpo.tasks.math
import stages.shards
from grpo.data import DatasetError, draw, load_examples, split
from grpo.episodes.templates import render
from grpo.tasks.math import math_reward
from grpo.tiny_model import build_chat_tokenizer

ROWS = [
    {"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}", "level": i % 2} for i in range(12)
]


@pytest.mark.parametrize(
    "module",
    [
        grpo.data,
        grpo.tasks.math,
        grpo.tasks.functions,
        grpo.progress,
        flows.commands.runs,
        flows.tasks,
        flows.artifacts,
        stages.shards,
    ],
)
def test_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv", "save_to_disk"])
def test_every_format_loads_with_mapped_columns_and_keeps_the_other_columns(tmp_path, fmt):
    df = pd.DataFrame(ROWS)
    path = tmp_path / f"data.{fmt}"
    if fmt == "parquet":
        df.to_parquet(path)
    elif fmt == "jsonl":
        df.to_json(path, orient="records", lines=True)
    elif fmt == "csv":
        df.to_csv(path, index=False)
    else:
        import datasets

        datasets.Dataset.from_pandas(df).save_to_disk(str(path))
    rows = load_examples(str(path), "question", "answer")
    assert [e.prompt for e in rows] == df.question.tolist()
    assert [e.ground_truth for e in rows] == df.answer.tolist()
    assert [str(e.row["level"]) for e in rows] == [str(v) for v in df.level]


def test_dataset_dict_folder_names_its_splits(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_pandas(pd.DataFrame(ROWS))})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=r"dd/train"):
        load_examples(str(tmp_path / "dd"), "question", "answer")
    assert len(load_examples(str(tmp_path / "dd" / "train"), "question", "answer")) == 12


def test_bad_datasets_fail_naming_file_and_what_to_do(tmp_path):
    with pytest.raises(DatasetError, match=r"nope\.parquet: no such file"):
        load_examples(str(tmp_path / "nope.parquet"))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DatasetError, match=r"x\.txt: unknown format"):
        load_examples(str(tmp_path / "x.txt"))
    (tmp_path / "broken.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match=r"broken\.parquet: cannot be read as parquet"):
        load_examples(str(tmp_path / "broken.parquet"))
    (tmp_path / "odd.jsonl").write_text(json.dumps({"prompt": [1, 2], "ground_truth": "3"}) + "\n")
    with pytest.raises(DatasetError, match=r"odd\.jsonl row 0: a prompt must be a string or a list"):
        load_examples(str(tmp_path / "odd.jsonl"))


def test_chat_prompts_render_through_the_template_with_the_system_prompt():
    tok = build_chat_tokenizer(["What is 1 + 1?"], vocab_size=300)
    messages = [{"role": "user", "content": "What is 1 + 1?"}]
    text, templated = render(tok, messages, "auto", "Be brief.")
    assert templated and text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(tok, "What is 1 + 1?", "auto", "Be brief.") == ("What is 1 + 1?", False)  # auto: strings as is
    assert render(tok, "What is 1 + 1?", "chat", "Be brief.") == (text, True)
    with pytest.raises(DatasetError, match="list of chat messages"):
        render(tok, messages, "text", None)
    tok.chat_template = None
    with pytest.raises(DatasetError, match="no chat template"):
        render(tok, messages, "auto", None)


def test_held_out_rows_are_never_drawn_and_each_epoch_draws_every_row_once():
    rows = tuple(load_examples.__wrapped__.__globals__["Example"](f"q{i}", str(i)) for i in range(50))
    train, held = split(rows, 0.2, seed=3)
    assert len(held) == 10 and not {e.prompt for e in train} & {e.prompt for e in held}
    assert split(rows, 0.2, seed=3) == (train, held) and split(rows, 0.2, seed=4) != (train, held)
    picks = [i for k in range(8) for i in draw(len(train), 10, k, seed=7)]  # 2 epochs of 40
    assert sorted(picks[:40]) == sorted(picks[40:]) == list(range(40))
    assert picks[:40] != picks[40:]  # a new order each epoch


@pytest.mark.parametrize(
    "response, correct",
    [
        ("The answer is 7.", 1.0),
        ("#### 7", 1.0),
        (r"so \boxed{7}", 1.0),
        ("7.0", 1.0),
        ("14/2", 1.0),
        ("3 + 4 = 7", 1.0),
        ("8", 0.0),
        ("The answer is 8. Earlier I wrote 7", 0.0),
        ("", 0.0),
    ],
)
def test_math_reward_on_gsm8k_ground_truth(response, correct):
    assert math_reward(response, "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7")["correct"] == correct
    assert math_reward(response, "7.0")["correct"] == correct  # a ground truth of 7.0 matches 7
