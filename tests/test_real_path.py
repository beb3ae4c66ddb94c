"""A user's own HF chat model, GSM8K-style data and reward functions, end to end on CPU.

The checkpoint is made here the way a real one looks: a Qwen2 model (grouped-query
attention), a byte-level BPE tokenizer trained on the test's text, Qwen's special tokens
and chat template, pad distinct from eos, and two eos ids in generation_config.json.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from flows.cli import main
from grpo.config import ConfigError, load_config
from grpo.record.storage import open_storage
from grpo.sampling.base import SamplingSpec
from grpo.sampling.engines import close_generators, get_generator
from grpo.sampling.hf import HFGenerator
from grpo.tiny_model import build_chat_model
from stages.init import init_run
from stages.iteration import run_iteration
from stages.prompts import eval_prompts, held_out_split, iteration_prompts

ROOT = Path(__file__).resolve().parents[1]
IM_END, ENDOFTEXT = "<|im_end|>", "<|endoftext|>"
needs_vllm = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]


def problem(i: int) -> dict:
    """A GSM8K-format row: question, and a worked answer ending in `#### N`."""
    a, b = i % 7 + 1, i // 7 + 2
    return {
        "question": f"Tom has {a} apples and buys {b} more. How many apples does Tom have now?",
        "answer": f"Tom has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
        "level": i % 3,
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    rows = [problem(i) for i in range(40)]
    for i in (5, 11, 17, 23, 29):  # too long for rollout.max_prompt_tokens=60
        rows[i]["question"] = "Tom has 1 apple. " * 30 + "How many apples does Tom have now?"
    texts = [f"{r['question']} {r['answer']} The answer is 7. \\boxed{{7}}" for r in rows]
    texts += ["<|im_start|>system\nYou are a careful solver.<|im_end|>\n<|im_start|>user\n<|im_start|>assistant\n"]
    build_chat_model(str(root / "model"), texts, vocab_size=400, max_position_embeddings=128)
    pd.DataFrame(rows).to_parquet(root / "gsm8k.parquet")
    with open(root / "chat.jsonl", "w") as f:  # prompts as chat messages
        for r in rows:
            f.write(
                json.dumps({"prompt": [{"role": "user", "content": r["question"]}], "ground_truth": r["answer"]}) + "\n"
            )
    (root / "my_reward.py").write_text(
        "def graded(response, ground_truth, prompt, level):\n"
        "    return {'total': float(ground_truth.split('####')[-1].strip() in response), 'level': float(level),\n"
        "            'saw_template': float(prompt.startswith('<|im_start|>'))}\n\n"
        "def length(response, ground_truth, prompt, **row):\n"
        "    return len(response) / 100\n"
    )
    return root


def chat_config(world, *extra):
    return [
        f"model.base_model={world / 'model'}",
        "task.name=math",
        f"task.dataset={world / 'gsm8k.parquet'}",
        "task.prompt_column=question",
        "task.answer_column=answer",
        "task.prompt_format=chat",
        "task.system_prompt=You are a careful solver.",
        "rollout.backend=hf",
        "rollout.prompts_per_iteration=8",
        "rollout.group_size=4",
        "rollout.max_tokens=12",
        "rollout.max_prompt_tokens=60",
        "learn.minibatch_size=16",
        "learn.microbatch_size=8",
        "eval.n_prompts=8",
        "eval.split_fraction=0.25",
        "reward.workers=1",
        *extra,
    ]


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


def read(storage, committed, name):
    return pd.read_parquet(storage.uri(committed.path(name)))


def check_two_iterations(storage, run_id, eos_ids):
    """Two iterations commit; prompts are the rendered template; no eos text in any response."""
    outs = [run_iteration(storage, run_id, k) for k in range(2)]
    cfg = load_config(json.loads(storage.read_bytes(storage.path("runs", run_id, "run.json")))["config"])
    held = {e.ground_truth for e in held_out_split(cfg)[1]}
    stopped = 0
    for out in outs:
        ro = read(storage, out["rollouts"], "rollouts.parquet")
        assert (
            ro.prompt.str.startswith("<|im_start|>").all() and ro.prompt.str.endswith("<|im_start|>assistant\n").all()
        )
        assert not ro.response.str.contains(IM_END, regex=False).any()
        assert not ro.response.str.contains(ENDOFTEXT, regex=False).any()
        last = ro.response_ids.map(lambda ids: ids[-1])
        stopped += int(last.isin(eos_ids).sum())
        assert (ro.finish_reason == "stop").equals(last.isin(eos_ids))
        assert not set(ro.ground_truth) & held  # training never samples the held-out rows
        ev = read(storage, out["eval"], "eval.parquet")
        assert len(ev) and set(ev.ground_truth) <= held  # eval rows are the held-out ones
        policy = {f.path for f in out["learn"].manifest.files}
        assert {"policy/chat_template.jinja", "policy/tokenizer.json", "policy/generation_config.json"} <= policy
    assert stopped, "no sample stopped on an eos id: the test shows nothing about stripping it"
    return outs


def test_chat_model_gsm8k_two_iterations_hf(world, storage):
    init_run(storage, "chat", load_config(None, chat_config(world)))
    outs = check_two_iterations(storage, "chat", eos_ids=[0, 2])
    ro = read(storage, outs[0]["rollouts"], "rollouts.parquet")
    assert ro.prompt.str.contains("<|im_start|>system\nYou are a careful solver.<|im_end|>", regex=False).all()
    assert ro.prompt.str.contains("<|im_start|>user\nTom has", regex=False).all()
    # each prompt's budget is what the 128 positions leave after it, at most max_tokens
    assert (ro.response_ids.map(len) <= (128 - ro.prompt_ids.map(len)).clip(upper=12)).all()
    rw = read(storage, outs[0]["rewards"], "rewards.parquet")
    assert {"correct", "format"} <= set(dict(rw.components[0]))


def test_over_long_prompts_are_skipped_and_counted(world, storage):
    from transformers import AutoTokenizer

    from grpo.episodes import templates

    cfg = load_config(None, chat_config(world, "rollout.prompts_per_iteration=28"))  # most of an epoch
    init_run(storage, "long", cfg)
    tok = AutoTokenizer.from_pretrained(world / "model")
    drawn = iteration_prompts(cfg, 0)
    lengths = [len(ids) for ids in templates.tokenize_prompts(tok, drawn, "chat", cfg.task.system_prompt)[1]]
    assert max(lengths) > 60 >= min(lengths)
    from stages import stage_function

    stage_function("snapshot")(storage, "long", 0)
    out = stage_function("rollouts")(storage, "long", 0)
    assert out.manifest.summary["skipped_prompts"] == sum(n > 60 for n in lengths) >= 1
    ro = read(storage, out, "rollouts.parquet")
    assert ro.prompt_ids.map(len).max() <= 60 and ro.prompt_id.nunique() == sum(n <= 60 for n in lengths)


@pytest.mark.parametrize("backend", [pytest.param("vllm", marks=needs_vllm)])
def test_chat_messages_dataset_two_iterations_vllm(world, storage, backend):
    extra = [
        f"task.dataset={world / 'chat.jsonl'}",
        "task.prompt_column=prompt",
        "task.answer_column=ground_truth",
        "task.prompt_format=auto",
        f"rollout.backend={backend}",
    ]
    init_run(storage, "chat-vllm", load_config(None, chat_config(world, *extra)))
    try:
        check_two_iterations(storage, "chat-vllm", eos_ids=[0, 2])
    finally:
        close_generators()


def test_user_reward_functions_are_stored_by_name_and_every_command_works(
    world, storage, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(world)  # a relative path, as a user types it
    cfg = load_config(
        None,
        chat_config(
            world,
            "reward.functions=[my_reward.py:graded, my_reward.py:length]",
            "reward.weights=[1.0, 0.5]",
            "reward.truncated_reward=null",
        ),
    )
    init_run(storage, "mine", cfg)
    monkeypatch.chdir(tmp_path)  # the run carries its copy of the reward file
    out = run_iteration(storage, "mine", 0)
    rw = read(storage, out["rewards"], "rewards.parquet").merge(
        read(storage, out["rollouts"], "rollouts.parquet"), on=["prompt_id", "sample_index"]
    )
    assert rw.error.isna().all()
    for _, r in rw.iterrows():
        c = dict(r.components)
        assert set(c) == {"graded", "graded/level", "graded/saw_template", "length", "total"}
        assert c["graded/saw_template"] == 1.0 and c["graded/level"] == json.loads(r.row)["level"]
        assert c["length"] == pytest.approx(len(r.response) / 100)
        assert r.reward == pytest.approx(c["graded"] + 0.5 * c["length"])
    url = storage.url
    assert main(["--storage", url, "status", "--run", "mine"]) == 0
    assert (
        main(
            [
                "--storage",
                url,
                "query",
                "--run",
                "mine",
                "SELECT count(*) AS n, max(element_at(components, 'length')) AS l FROM rewards",
            ]
        )
        == 0
    )
    assert "n" in capsys.readouterr().out
    assert main(["--storage", url, "run", "--run", "mine", "--iterations", "1"]) == 0  # iteration 1, no wrapper


@pytest.mark.parametrize(
    "bad, culprit",
    [
        (["reward.functions=[nowhere.py:graded]"], r"nowhere\.py:graded.*no file"),
        (["reward.functions=[my_reward.py:absent]"], r"my_reward\.py:absent.*no function 'absent'"),
        (["reward.functions=[json:dumps]"], r"json:dumps.*signature"),
        (["task.answer_column=solution"], r"task\.dataset.*no column 'solution'"),
        (["model.base_model=/no/such/model"], r"model\.base_model /no/such/model"),
    ],
)
def test_bad_input_fails_init_naming_it_and_writes_nothing(world, storage, monkeypatch, bad, culprit):
    monkeypatch.chdir(world)
    with pytest.raises(ConfigError, match=culprit):
        init_run(storage, "bad", load_config(None, chat_config(world, *bad)))
    assert not storage.fs.exists(storage.path("runs", "bad"))


def test_chat_format_needs_a_template_and_cli_says_so(tmp_path, capsys):
    code = main(
        [
            "--storage",
            str(tmp_path / "s"),
            "init",
            "--run",
            "t",
            "--set",
            "task.prompt_format=chat",
            "--set",
            "model.hidden_size=64",
            "--set",
            "model.num_heads=2",
        ]
    )
    assert code == 2 and "no chat template" in capsys.readouterr().err
    assert not (tmp_path / "s" / "runs" / "t").exists()


def test_hub_id_resolves_from_the_cache_offline(world, tmp_path):
    """A hub id goes through huggingface_hub's cache (HF_HUB_OFFLINE=1: nothing is downloaded)."""
    repo = tmp_path / "hub" / "models--acme--tiny-chat"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(world / "model", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}

    def init(run, model):
        return subprocess.run(
            [sys.executable, "-m", "flows.cli", "--storage", str(tmp_path / "s"), "init", "--run", run]
            + [a for kv in chat_config(world, f"model.base_model={model}") for a in ("--set", kv)],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )

    ok = init("hub", "acme/tiny-chat")
    assert ok.returncode == 0, ok.stderr
    base = next((tmp_path / "s" / "runs" / "hub" / "base").glob("attempt-*"))
    assert (base / "policy" / "chat_template.jinja").read_bytes() == (
        world / "model" / "chat_template.jinja"
    ).read_bytes()
    missing = init("nohub", "acme/absent-model")
    assert missing.returncode == 2 and "model.base_model acme/absent-model" in missing.stderr
    assert "HF_HUB_OFFLINE" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "s" / "runs" / "nohub").exists()


def test_eval_pass_at_k_and_avg_at_k(world, storage):
    init_run(storage, "k", load_config(None, chat_config(world, "eval.samples_per_prompt=3")))
    out = run_iteration(storage, "k", 0)["eval"]
    ev = read(storage, out, "eval.parquet")
    assert ev.avg_at_k.between(0, 1).all() and (ev.pass_at_k >= ev.avg_at_k).all()
    assert set((ev.avg_at_k * 3).round(6)) <= {0.0, 1.0, 2.0, 3.0}
    assert out.manifest.summary["pass@3"] == pytest.approx(ev.pass_at_k.mean())


def test_training_draws_epoch_by_epoch_without_replacement(world):
    cfg = load_config(
        None, chat_config(world, "rollout.prompts_per_iteration=6", "learn.minibatch_size=8")
    )  # 30 rows: 5 iterations an epoch
    train, held = held_out_split(cfg)
    assert len(train) == 30 and len(held) == 10
    epoch = [e.ground_truth + e.prompt for k in range(5) for e in iteration_prompts(cfg, k)]
    assert sorted(epoch) == sorted(e.ground_truth + e.prompt for e in train)  # each row once
    assert iteration_prompts(cfg, 7) == iteration_prompts(cfg, 7)  # a resumed run draws the same
    assert [e.ground_truth for e in eval_prompts(cfg)] == [e.ground_truth for e in held[:8]]


@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=needs_vllm)])
def test_both_backends_stop_on_every_eos_id_and_keep_each_budget(world, tmp_path, backend):
    """An eos id listed only in generation_config.json stops too; each prompt keeps its own budget."""
    from transformers import AutoTokenizer

    from grpo.sampling.base import decode_responses

    model = tmp_path / "m"
    shutil.copytree(world / "model", model)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok(f"Tom has {i} apples", add_special_tokens=False)["input_ids"] for i in range(6)]
    greedy = SamplingSpec(n=1, temperature=0.0, max_tokens=12)
    first = HFGenerator(str(model)).generate(prompts[:1], greedy)[0][0].response_ids[0]  # what greedy says first
    assert first not in (0, 2)
    gen_cfg = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen_cfg, "eos_token_id": [2, first]}))
    budgets = [3, 12, 5, 12, 1, 8]
    try:
        gen = get_generator(backend, str(model))
        [[stopped]] = gen.generate(prompts[:1], greedy)
        assert (stopped.response_ids, stopped.finish_reason) == ([first], "stop")
        assert decode_responses(tok, [stopped.response_ids], (2, first)) == [""]
        out = gen.generate(prompts, SamplingSpec(n=4, temperature=1.0, max_tokens=12, seed=1), budgets)
        for group, budget in zip(out, budgets):
            for s in group:
                assert len(s.response_ids) <= budget
                ends = s.response_ids[-1] in (2, first)
                assert s.finish_reason == ("stop" if ends else "length")
                assert ends or len(s.response_ids) == budget
                assert 2 not in s.response_ids[:-1] and first not in s.response_ids[:-1]
    finally:
        close_generators()


def test_tokenizer_without_pad_token_pads_with_eos(world, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(world / "model", model)
    cfg_path = model / "tokenizer_config.json"
    tc = json.loads(cfg_path.read_text())
    tc["pad_token"] = None
    cfg_path.write_text(json.dumps(tc))
    gen = HFGenerator(str(model))
    assert gen.tokenizer.pad_token_id is None
    out = gen.generate([[1, 40, 41], [1, 40, 41, 42, 43]], SamplingSpec(n=2, max_tokens=4))
    assert [len(g) for g in out] == [2, 2]


def test_a_warm_engine_restarts_when_the_eos_ids_change(world, tmp_path):
    """Reloading weights in place keeps the old stop ids: a checkpoint with other eos ids is not 'the same'."""
    from grpo.sampling.engines import same_architecture

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(world / "model", a)
    shutil.copytree(world / "model", b)
    assert same_architecture(str(a), str(b))
    gen_cfg = json.loads((b / "generation_config.json").read_text())
    (b / "generation_config.json").write_text(json.dumps({**gen_cfg, "eos_token_id": [2]}))
    assert not same_architecture(str(a), str(b))
    try:
        assert get_generator("hf", str(a)).eos.tolist() == [2, 0]
        assert get_generator("hf", str(b)).eos.tolist() == [2]
    finally:
        close_generators()


@pytest.fixture
def s3_storage(s3, monkeypatch, tmp_path):
    """A storage of its own on the test S3 server, the AWS variables set, checkpoints cached in tmp_path."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    return open_storage(f"s3://{s3.bucket}/real-{tmp_path.name}")


@pytest.mark.s3
def test_model_and_dataset_from_s3_urls(world, s3_storage):
    storage = s3_storage
    storage.fs.put(str(world / "model") + "/", storage.path("inputs", "model") + "/", recursive=True)
    storage.fs.put_file(str(world / "gsm8k.parquet"), storage.path("inputs", "gsm8k.parquet"))
    model, data_url = storage.uri(storage.path("inputs", "model")), storage.uri(storage.path("inputs", "gsm8k.parquet"))
    base = init_run(
        storage, "s3", load_config(None, chat_config(world, f"model.base_model={model}", f"task.dataset={data_url}"))
    )
    assert "policy/chat_template.jinja" in {f.path for f in base.manifest.files}
    out = run_iteration(storage, "s3", 0)
    summary = out["eval"].manifest.summary
    assert summary["prompts"] + summary["skipped_prompts"] == 8 and summary["skipped_prompts"] <= 1


@pytest.mark.s3
def test_an_edited_download_cache_is_fetched_again(world, s3_storage):
    """A checkpoint cached from S3 is checked against its manifest before each use in a process."""
    import time

    from grpo.record.checkpoint import local_checkpoint

    base = init_run(s3_storage, "c", load_config(None, chat_config(world)))
    folder = Path(local_checkpoint(base))
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    time.sleep(0.05)  # past the hash cache's racy window
    weights.write_bytes(good[:-8] + b"\0" * 8)  # same size, other bytes
    assert Path(local_checkpoint(base)) == folder and weights.read_bytes() == good
