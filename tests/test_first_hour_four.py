"""The first hour, round four (issue 54): defaults that fit the user's model, and a stale chain never offered as
the newest policy."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_stages import TINY, make_run

import stages.rewards
from flows.cli import main
from grpo.config import OWN_MODEL_DEFAULTS, LearnConfig, load_config
from grpo.record.layout import stage_dir
from grpo.record.storage import committed_attempts, open_storage
from grpo.tiny_model import build_for_task
from stages.iteration import run_warm

OWN = [s for s in TINY if not s.startswith(("learn.lr=", "model."))]  # the tiny run's sizes, no lr, no tiny model


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


@pytest.fixture(scope="module")
def folder_model(tmp_path_factory):
    """A model of the user's own: a folder as `grpo export` or the hub leaves it."""
    return build_for_task(str(tmp_path_factory.mktemp("own") / "model"), "sort", hidden_size=64, num_heads=2)


def cli(storage, capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["--storage", storage.url, *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---------------------------------------------------------------- 1. defaults that fit the model


def test_a_model_of_your_own_gets_trls_lr_unless_set_and_the_tiny_model_its_recipe():
    own = load_config(None, ["model.base_model=/some/folder"])
    assert own.learn.lr == OWN_MODEL_DEFAULTS["learn", "lr"] == 1e-6
    assert load_config(None, ["model.base_model=/some/folder", "learn.lr=1e-5"]).learn.lr == 1e-5
    assert load_config({"model": {"base_model": "m"}, "learn": {"lr": 2e-5}}).learn.lr == 2e-5
    assert load_config(None).learn.lr == LearnConfig().lr == 1.5e-3  # the built tiny model: the sort recipe
    assert load_config(own.to_dict()).learn.lr == 1e-6  # run.json as written reads back the same


def test_init_prints_the_lr_and_the_settings_that_decide_a_run(storage, capsys, folder_model):
    rc, out, err = cli(storage, capsys, "init", "--run", "own", *[a for s in OWN for a in ("--set", s)],
                       "--set", f"model.base_model={folder_model}")  # fmt: skip
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.startswith("settings: "))
    assert "learn.lr=1e-06 (TRL's default for a model of your own)" in line
    assert "rollout.max_tokens=16" in line and "rollout.group_size=4" in line, line
    rc, out, _ = cli(storage, capsys, "init", "--run", "tiny")
    assert rc == 0 and "learn.lr=0.0015 (the tiny model's recipe)" in out, out


def test_the_python_api_takes_trls_lr_for_a_model_named_beside_a_yaml_file(tmp_path, folder_model):
    """A YAML file without a model, the model as train()'s argument: the file's unset lr follows the model."""
    from flows.api import run_config

    (tmp_path / "my.yaml").write_text("rollout: {max_tokens: 16}\n")
    where = open_storage((tmp_path / "store").as_uri())
    cfg = run_config(where, folder_model, None, (), tmp_path / "my.yaml", None)
    assert cfg.learn.lr == 1e-6 and cfg.rollout.max_tokens == 16
    (tmp_path / "lr.yaml").write_text("learn: {lr: 3.0e-5}\n")
    assert run_config(where, folder_model, None, (), tmp_path / "lr.yaml", None).learn.lr == 3e-5


# ---------------------------------------------------------------- 5. stale means stale everywhere


def test_a_stale_chain_is_never_offered_as_the_newest_policy(storage, capsys, tmp_path):
    make_run(storage, "r")
    for _ in run_warm(storage, "r", 0, 2):
        pass
    stages.rewards.rewards(storage, "r", 1, force=True)  # learn 1 (the newest) is stale now
    rc, out, err = cli(storage, capsys, "status", "--run", "r")
    assert rc == 0, err
    assert "newest policy: iteration 1" not in out
    assert re.search(r"newest current policy: iteration 0, \S+/iter-0000/learn/", out), out
    assert "export --run r --iteration 0" in out and "run --run r --start 1`" in out, out

    rc, _, err = cli(storage, capsys, "export", "--run", "r", "--out", str(tmp_path / "newest"))
    assert rc != 0 and err.count("\n") == 1, err
    assert "iteration 1, is stale" in err and "--start 1" in err and "`--iteration 1`" in err, err
    assert "`--iteration 0`, the newest current one" in err and not (tmp_path / "newest").exists()

    asked = tmp_path / "asked"  # asked for by number: exported as it is
    assert cli(storage, capsys, "export", "--run", "r", "--iteration", "1", "--out", str(asked))[0] == 0
    assert (asked / "config.json").exists()


def test_a_stale_first_learn_leaves_no_policy_to_offer(storage, capsys):
    make_run(storage, "r")
    for _ in run_warm(storage, "r", 0, 1):
        pass
    stages.rewards.rewards(storage, "r", 0, force=True)
    rc, out, _ = cli(storage, capsys, "status", "--run", "r")
    assert rc == 0 and "newest" not in out and "rebuild them with `" in out and "--start 0`" in out, out
    rc, _, err = cli(storage, capsys, "export", "--run", "r")
    assert rc != 0 and "iteration 0, is stale" in err and "newest current" not in err, err
    assert len(committed_attempts(storage, stage_dir(storage, "r", 0, "learn"))) == 1


# ---------------------------------------------------------------- 6. the docs match what runs; quiet by default


def test_the_docs_name_the_turns_tables_columns_as_they_are():
    from schemas.tables import TURNS
    from tests.doc_pages import page

    said = re.search(r"the `turns` table one row per assistant turn, [^(]*\(([^)]*)\)", page("tools.md"), re.S)
    assert said, "docs/tools.md's What is stored lost its turns table"
    named = re.findall(r"`(\w+)`", said.group(1))
    assert named == [n for n in TURNS.names if n != "run_id"], named


@pytest.mark.parametrize("correction, shown", [("none", False), ("tis", True)])
def test_report_md_shows_behaviour_columns_only_with_a_correction(storage, correction, shown):
    from grpo.report import write_report

    make_run(storage, "r", extra=[f"learn.behavior_correction={correction}"])
    for _ in run_warm(storage, "r", 0, 1):
        pass
    write_report(storage, "r")
    md = storage.read_bytes(storage.path("runs", "r", "report.md")).decode()
    header = next(line for line in md.splitlines() if line.startswith("| iteration"))
    assert ("behavior_weight_mean" in header) == shown and ("sampler_kl" in header) == shown, header
    assert "reward_mean" in header


def test_the_python_api_prints_no_loading_bars_after_datasets_was_imported(tmp_path):
    """A user's script imports datasets (and so huggingface_hub) before grpo: train's lines, no tqdm bars."""
    script = textwrap.dedent(f"""
        import datasets, yaml
        from grpo import train
        train(config={{k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in {TINY!r})}}, iterations=1,
              storage={(tmp_path / "store").as_uri()!r})
    """)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}  # as a user's shell has it
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "it/s]" not in done.stderr and "Loading weights" not in done.stderr, done.stderr[-2000:]
    assert re.search(r"^\s+0\s+\d", done.stdout, re.M), done.stdout  # iteration 0's line


def test_setup_says_each_step_before_it_and_leaves_pip_its_progress(tmp_path):
    """setup.sh in a copy of the repo whose .venv python records what it is asked (pip never runs: no network):
    a line per step before its command, and pip asked without -q, so its own download progress shows."""
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "setup.sh").write_bytes((root / "setup.sh").read_bytes())
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "python $*"\n')
    python.chmod(0o755)
    done = subprocess.run(["bash", str(tmp_path / "setup.sh")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    steps = [i for i, line in enumerate(lines) if line.startswith("setup [")]
    assert len(steps) == 6 and steps[0] == 0, lines
    installs = [i for i, line in enumerate(lines) if line.startswith("python -m pip") and " install " in line]
    assert len(installs) == 3 and all(" -q" not in lines[i] for i in installs), lines
    assert all(any(s < i for s in steps) for i in installs), lines  # each install said before it runs
    assert [lines[s + 1].split(" install ")[1] for s in steps[1:3]] == ["torch==2.13.0", "-e .[cpu,dev]"], lines
    assert lines[-1].startswith("setup done in"), lines
