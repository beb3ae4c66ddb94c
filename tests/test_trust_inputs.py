"""What a run trusts from its user: datasets pinned at init, rows without a ground truth, a broken base model.

Each test reproduces a way a bad input used to slip through (a dataset edited between iterations, a null
ground truth scored as "nan", a config.json that does not fit the weights) and checks that it now fails
in one line naming it, before anything is written where that matters.
"""

import json
import re
import time

import pandas as pd
import pytest
from safetensors.torch import load_file, save_file

from flows.cli import main
from grpo import data
from grpo.config import ConfigError, load_config
from grpo.record import pins
from grpo.record.checkpoint import checkpoint_problem, safetensors_shapes
from grpo.record.layout import run_json
from grpo.record.storage import open_storage
from grpo.tiny_model import build_chat_model
from stages import StageError, stage_function
from stages.init import init_run, pin_datasets
from stages.iteration import run_iteration
from stages.prompts import eval_prompts, held_out_split

TINY = [  # tests/test_stages.py's tiny run, smaller
    "rollout.backend=hf",
    "rollout.prompts_per_iteration=8",
    "rollout.group_size=2",
    "rollout.max_tokens=8",
    "learn.minibatch_size=16",
    "learn.microbatch_size=16",
    "eval.n_prompts=4",
    "model.hidden_size=64",
    "model.num_heads=2",
    "model.intermediate_size=128",
    "reward.workers=1",
]


def arithmetic(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"{i % 4} + {i % 3} * 2 =", "ground_truth": str(i % 4 + 2 * (i % 3))} for i in range(start, n)]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def config(*extra):
    return load_config(None, TINY + ["task.name=arithmetic", "task.params={max_operand: 9}", *extra])


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


# 1. the datasets are pinned at init


def test_rows_appended_after_init_are_refused_by_the_next_stage_and_by_status(storage, tmp_path, capsys):
    path = write_jsonl(tmp_path / "arith.jsonl", arithmetic(24))
    cfg = config(f"task.dataset={path}", "eval.split_fraction=0.25")
    base = init_run(storage, "r", cfg)
    pinned = base.manifest.summary["datasets"]["task.dataset"]
    assert pinned["uri"] == path and pinned["fingerprint"] == pins.fingerprint(path) and pinned["rows"] == 24
    held = [e.prompt for e in eval_prompts(cfg)]
    stage_function("snapshot")(storage, "r", 0)
    with open(path, "a") as f:  # 20 more rows: the held-out split and the eval prompts would move
        f.write("".join(json.dumps(r) + "\n" for r in arithmetic(44, start=24)))
    with pytest.raises(StageError, match=r"^task\.dataset .*arith\.jsonl changed since grpo init") as err:
        stage_function("rollouts")(storage, "r", 0)
    assert "grpo init --run NEW" in str(err.value) and "\n" not in str(err.value)
    assert main(["--storage", storage.url, "status", "--run", "r"]) == 2  # status no longer says ok
    assert "task.dataset" in capsys.readouterr().err
    with pytest.raises(StageError, match="changed since grpo init"):  # nor does init of the same run
        init_run(storage, "r", cfg)
    write_jsonl(tmp_path / "arith.jsonl", arithmetic(24))  # restored: the run goes on, the held-out set unmoved
    assert [e.prompt for e in eval_prompts(cfg)] == held
    assert run_iteration(storage, "r", 0)["eval"]
    assert main(["--storage", storage.url, "status", "--run", "r"]) == 0


def test_a_fresh_process_refuses_a_changed_dataset_too(storage, tmp_path):
    path = write_jsonl(tmp_path / "arith.jsonl", arithmetic(24))
    init_run(storage, "r", config(f"task.dataset={path}"))
    stage_function("snapshot")(storage, "r", 0)
    write_jsonl(tmp_path / "arith.jsonl", arithmetic(44))
    pins.pin(None)  # what a new process (grpo stage, a Prefect worker) starts with
    with pytest.raises(StageError, match="changed since grpo init"):
        stage_function("rollouts")(storage, "r", 0)


def test_a_run_made_before_fingerprints_were_recorded_is_not_pinned(storage, tmp_path, capsys):
    path = write_jsonl(tmp_path / "arith.jsonl", arithmetic(24))
    cfg = config(f"task.dataset={path}")
    base = init_run(storage, "old", cfg)
    manifest = f"{base.attempt_dir}/_manifest.json"  # as a base committed before this change: no "datasets"
    raw = json.loads(storage.read_bytes(manifest))
    del raw["summary"]["datasets"]
    storage.write_bytes_atomic(manifest, json.dumps(raw).encode())
    pin_datasets(storage, "old")
    write_jsonl(tmp_path / "arith.jsonl", arithmetic(30))
    assert sum(len(rows) for rows in held_out_split(cfg)) == 30  # read as it is
    assert main(["--storage", storage.url, "status", "--run", "old"]) == 0


def test_a_save_to_disk_folder_is_fingerprinted_by_its_files_and_a_file_is_hashed_once_while_unchanged(
    tmp_path, monkeypatch
):
    import datasets

    folder = str(tmp_path / "ds")
    datasets.Dataset.from_pandas(pd.DataFrame(arithmetic(8))).save_to_disk(folder)
    before = pins.fingerprint(folder)
    datasets.Dataset.from_pandas(pd.DataFrame(arithmetic(9))).save_to_disk(str(tmp_path / "ds2"))
    assert before.startswith("sha256:") and pins.fingerprint(str(tmp_path / "ds2")) != before
    path = write_jsonl(tmp_path / "a.jsonl", arithmetic(8))
    time.sleep(0.05)  # past the hash cache's racy window
    hashed = []
    real = pins.file_digest.__globals__["sha256_file"]
    monkeypatch.setitem(pins.file_digest.__globals__, "sha256_file", lambda fs, p: hashed.append(p) or real(fs, p))
    pins.pin({"task.dataset": {"uri": path, "fingerprint": pins.pinned_version(path)}})
    for _ in range(3):  # a warm run checks the pin in every stage: a stat each, one hash in all
        pins.pinned_version(path)
    assert hashed == [path]
    pins.pin(None)


@pytest.mark.s3
def test_an_object_is_fingerprinted_by_its_etag(s3_env, s3_prefix, tmp_path):
    url = f"{s3_prefix}/arith.jsonl"
    fs, key = pins.url_to_fs(url)
    fs.put_file(write_jsonl(tmp_path / "a.jsonl", arithmetic(8)), key)
    pinned = pins.fingerprint(url)
    assert pinned.startswith("etag:") and pins.fingerprint(url) == pinned
    pins.pin({"eval.dataset": {"uri": url, "fingerprint": pinned}})
    fs.put_file(write_jsonl(tmp_path / "b.jsonl", arithmetic(9)), key)
    with pytest.raises(pins.DatasetChangedError, match=r"^eval\.dataset s3://.*changed since grpo init"):
        pins.pinned_version(url)
    pins.pin(None)


# 2. rows without a prompt or a ground truth


def rows_with_blanks() -> pd.DataFrame:
    rows = arithmetic(24)
    rows[3]["ground_truth"] = None
    rows[7]["ground_truth"] = float("nan")
    rows[11]["ground_truth"] = ""
    rows[15]["prompt"] = "  "
    return pd.DataFrame(rows)


def test_null_ground_truths_fail_init_naming_the_column_and_count(storage, tmp_path):
    path = tmp_path / "blank.parquet"
    rows_with_blanks().to_parquet(path)
    with pytest.raises(
        ConfigError,
        match=r"task\.dataset: dataset .*blank\.parquet: 1 row with no 'prompt', 3 rows with no 'ground_truth'",
    ) as err:
        init_run(storage, "b", config(f"task.dataset={path}"))
    assert "task.skip_invalid_rows=true" in str(err.value)
    assert not storage.fs.exists(storage.path("runs", "b"))


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_missing_and_empty_cells_are_blank_in_every_format(tmp_path, fmt):
    path = tmp_path / f"blank.{fmt}"
    if fmt == "jsonl":  # a missing key reads as NaN
        path.write_text('{"prompt": "1 + 1 =", "ground_truth": "2"}\n{"prompt": "2 + 2 ="}\n')
    else:  # an empty cell reads as ""
        path.write_text('prompt,ground_truth\n1 + 1 =,2\n2 + 2 =,""\n')
    with pytest.raises(data.DatasetError, match="1 row with no 'ground_truth'"):
        data.load_examples(str(path))
    assert [e.ground_truth for e in data.load_examples(str(path), skip_invalid=True)] == ["2"]


def test_skip_invalid_rows_leaves_them_out_counted_and_splits_what_is_left(storage, tmp_path):
    path = tmp_path / "blank.parquet"
    df = rows_with_blanks()
    df.to_parquet(path)
    df.drop(index=[3, 7, 11, 15]).to_parquet(tmp_path / "clean.parquet")
    cfg = config(f"task.dataset={path}", "task.skip_invalid_rows=true", "eval.split_fraction=0.25")
    base = init_run(storage, "s", cfg)
    assert base.manifest.summary["datasets"]["task.dataset"] | {"fingerprint": ""} == {
        "uri": str(path),
        "fingerprint": "",
        "rows": 20,
        "skipped_rows": 4,
    }
    clean = config(f"task.dataset={tmp_path / 'clean.parquet'}", "eval.split_fraction=0.25")
    assert held_out_split(cfg) == held_out_split(clean)  # the split is of the rows left
    out = run_iteration(storage, "s", 0)
    for stage, table in (("rollouts", "rollouts.parquet"), ("eval", "eval.parquet")):
        gt = pd.read_parquet(storage.uri(out[stage].path(table))).ground_truth
        assert not gt.isin(["nan", "None", ""]).any()


# 6. a broken base model fails init in one line, leaving the run id free


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model") / "chat"
    build_chat_model(str(folder), ["What is 1 + 1 ? 2", "What is 2 + 2 ? 4"], vocab_size=300)
    return folder


def broken_copy(chat_model, tmp_path, **config_changes):
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(chat_model, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **config_changes}))
    return folder


def init_with(storage, model) -> None:
    init_run(storage, "m", load_config(None, TINY + [f"model.base_model={model}"]))


def test_a_config_json_with_wrong_sizes_fails_init_in_one_line_and_the_run_id_stays_free(storage, chat_model, tmp_path):
    vocab = json.loads((chat_model / "config.json").read_text())["vocab_size"]
    bad = broken_copy(chat_model, tmp_path, hidden_size=96, head_dim=48)
    with pytest.raises(ConfigError) as err:
        init_with(storage, bad)
    assert str(err.value) == (
        f"model.base_model {bad}: tensor model.embed_tokens.weight in model.safetensors has shape [{vocab}, 64]; "
        f"config.json makes it [{vocab}, 96]"
    )
    assert not storage.exists(run_json(storage, "m"))
    init_with(storage, chat_model)  # the same run id, with the good model


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"model_type": "no-such-arch"}, r"config.json's model_type 'no-such-arch' is none that transformers"),
        ({"model_type": "gpt2"}, r"tensor \S+ is not in model.safetensors \(config.json's model_type is 'gpt2'\)"),
        ({"num_hidden_layers": 3}, r"no causal LM .*`num_hidden_layers` \(3\) must be equal to the number of"),
        (
            {"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3},
            r"^tensor model.layers.2.\S+ is not in model.safetensors",
        ),
        ({"vocab_size": 1000}, r"tensor model.embed_tokens.weight in model.safetensors has shape \[\d+, 64\]"),
    ],
)
def test_config_and_weights_that_do_not_fit_are_named(chat_model, tmp_path, changes, says):
    assert checkpoint_problem(chat_model) is None
    problem = checkpoint_problem(broken_copy(chat_model, tmp_path, **changes))
    assert problem is not None and "\n" not in problem
    assert re.search(says, problem), problem


def test_a_tied_lm_head_may_be_absent_and_an_untied_one_may_not(chat_model, tmp_path):
    tied = json.loads((chat_model / "config.json").read_text()).get("tie_word_embeddings")
    assert tied and "lm_head.weight" not in safetensors_shapes(chat_model)  # passes above: absent, tied
    untied = broken_copy(chat_model, tmp_path, tie_word_embeddings=False)
    assert checkpoint_problem(untied) == (
        "tensor lm_head.weight is not in model.safetensors (config.json's model_type is 'qwen2')"
    )
    weights = load_file(untied / "model.safetensors")
    save_file({**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()}, untied / "model.safetensors")
    assert checkpoint_problem(untied) is None


def test_a_folder_without_tokenizer_files_fails_init_in_one_line(storage, chat_model, tmp_path, capsys):
    bad = broken_copy(chat_model, tmp_path)
    (bad / "tokenizer.json").unlink()
    code = main(["--storage", storage.url, "init", "--run", "m", "--set", f"model.base_model={bad}"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"model.base_model {bad}: no tokenizer files" in err
    assert not storage.exists(run_json(storage, "m"))
