"""Sizes and values that used to pass `grpo init` or a stage and fail later, hang, or fail naming nothing (issue 44,
D10 and the minor cases): each is refused at once in one line naming the setting, or handled."""

import json

import pytest
from test_stages import TINY

from flows.cli import main
from stages import init


def grpo(tmp_path, capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["--storage", str(tmp_path / "store"), *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def init_with(tmp_path, capsys, *sets: str) -> tuple[int, str, str]:
    return grpo(tmp_path, capsys, "init", "--run", "t", *[f"--set={s}" for s in [*TINY, *sets]])


@pytest.mark.parametrize(
    "setting, field",
    [
        ("rollout.prompts_per_iteration=100000000000", "rollout.prompts_per_iteration"),
        ("eval.n_prompts=100000000000", "eval.n_prompts"),
    ],
)
def test_sizes_no_machine_holds_are_refused_at_init(tmp_path, capsys, setting, field):
    """An iteration of 1e11 prompts passed init, then grew ~20 MB/s without a word."""
    rc, _, err = init_with(tmp_path, capsys, setting)
    assert rc == 2 and err.count("\n") == 1 and f"lower {field}" in err, err
    assert "GiB, more than this machine's" in err and not (tmp_path / "store" / "runs" / "t").exists()


def test_the_memory_bound_leaves_real_sizes_alone():
    from grpo.config import load_config

    big = load_config(None, ["rollout.prompts_per_iteration=1024", "rollout.group_size=16", "rollout.max_tokens=4096"])
    init.check_sizes(big, memory=8 * 2**30)  # 16k samples of 4k tokens fit in 8 GiB at the bound's 32 B a token
    with pytest.raises(init.ConfigError, match="lower rollout.prompts_per_iteration"):
        init.check_sizes(big, memory=2**30)


@pytest.mark.parametrize(
    "setting, says",
    [
        ("seed=100000000000000000000000", "seed must be a 64-bit integer"),  # was "Overflow when unpacking long long"
        ("eval.seed=-100000000000000000000000", "eval.seed must be a 64-bit integer"),  # passed init, failed at eval
        ("model.hidden_size=-64", "model.hidden_size must be >= 1, got -64"),  # spoke of vLLM on the hf backend
        ("model.num_heads=0", "model.num_heads must be >= 1, got 0"),
    ],
)
def test_values_no_stage_can_use_are_refused_naming_the_setting(tmp_path, capsys, setting, says):
    rc, _, err = init_with(tmp_path, capsys, setting)
    assert rc == 2 and err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "store" / "runs" / "t").exists()


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf"])
def test_grpo_heartbeat_s_must_be_seconds_and_says_so(tmp_path, capsys, monkeypatch, value):
    """GRPO_HEARTBEAT_S=abc failed as a bare ValueError naming no variable; 0 and -5 were accepted."""
    assert init_with(tmp_path, capsys)[0] == 0
    monkeypatch.setenv("GRPO_HEARTBEAT_S", value)
    rc, _, err = grpo(tmp_path, capsys, "stage", "snapshot", "--run", "t", "--iteration", "0")
    assert rc == 2 and err.count("\n") == 1, err
    assert f"GRPO_HEARTBEAT_S='{value}': give the seconds between a running stage's heartbeats" in err


def test_a_prompt_with_a_lone_surrogate_is_refused_naming_the_row(tmp_path, capsys):
    """JSON's "\\ud800" reads as a lone surrogate: the tokenizer dropped it without a word."""
    rows = [{"prompt": "1 + 2 =", "ground_truth": "3"}] * 7 + [{"prompt": "3 + 4 \ud800=", "ground_truth": "7"}]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))  # ensure_ascii: "\ud800"
    rc, _, err = init_with(tmp_path, capsys, "task.name=arithmetic", f"task.dataset={tmp_path / 'bad.jsonl'}")
    assert rc == 2 and err.count("\n") == 1, err
    assert "row 7's prompt holds a lone surrogate (U+D800 at character 6)" in err


@pytest.mark.parametrize(
    "returned, error",
    [
        ({"total": 1.0, "format": float("nan")}, "non-finite component 'format': nan"),
        ({"total": 1.0, "length": float("-inf")}, "non-finite component 'length': -inf"),
        ({"total": 1.0, **{f"c{i}": 0.0 for i in range(20_000)}}, "returned 20001 components; return at most 256"),
    ],
)
def test_non_finite_or_countless_components_are_that_sample_s_error(returned, error):
    """Committed as they came before: a NaN beside a finite total, 20,000 columns' worth a row."""
    from grpo.scoring.score import score_one
    from grpo.tasks.functions import Scorer

    scorer = Scorer([("score", lambda response, ground_truth, prompt: returned)], [1.0])
    reward, components, message = score_one(scorer, "1", "1", "p", {}, timeout_s=5)
    assert (reward, components) == (0.0, {}) and message.endswith(error), message


def test_grpo_run_checks_learn_device_before_any_stage_commits(tmp_path, capsys):
    """learn.device names a device this machine lacks: `grpo run` refuses before the snapshot, not at learn after
    four stages committed."""
    assert init_with(tmp_path, capsys, "learn.device=cuda:7")[0] == 0  # a run made for another machine
    rc, _, err = grpo(tmp_path, capsys, "run", "--run", "t")
    assert rc == 2 and err.count("\n") == 1 and "learn.device=cuda:7: this machine has" in err, err
    assert not (tmp_path / "store" / "runs" / "t" / "iter-0000").exists()


def test_a_huge_prompt_is_skipped_without_tokenizing_it(tmp_path, monkeypatch):
    """Three 10 MB prompts took 4.8 GB to tokenize before they were skipped as over-long: a prompt surely longer
    than the limit (its characters alone say so) is skipped and counted without reaching the tokenizer."""
    from transformers import PreTrainedTokenizerFast

    from grpo.config import load_config
    from grpo.record.storage import open_storage
    from stages import stage_function
    from stages.init import init_run

    small = [{"prompt": "1 + 2 =", "ground_truth": "3"}] * 11  # with the huge one, 12 rows: each drawn once
    huge = {"prompt": "1 + " * 500_000 + "1 =", "ground_truth": "500001"}  # 2 MB
    for name, rows in (("big", small + [huge]), ("held", small)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    real, seen = PreTrainedTokenizerFast.__call__, []

    def call(self, text, *args, **kwargs):
        seen.append(max(map(len, text)) if isinstance(text, list) else len(text))
        return real(self, text, *args, **kwargs)

    storage = open_storage((tmp_path / "store").as_uri())
    extra = [
        "task.name=arithmetic",
        f"task.dataset={tmp_path / 'big.jsonl'}",
        f"eval.dataset={tmp_path / 'held.jsonl'}",
    ]
    extra += ["rollout.prompts_per_iteration=12", "learn.minibatch_size=16", "rollout.max_prompt_tokens=16"]
    init_run(storage, "big", load_config(None, TINY + extra))
    stage_function("snapshot")(storage, "big", 0)
    monkeypatch.setattr(PreTrainedTokenizerFast, "__call__", call)
    out = stage_function("rollouts")(storage, "big", 0)
    assert out.manifest.summary["skipped_prompts"] == 1 and seen and max(seen) < 1000, max(seen)
