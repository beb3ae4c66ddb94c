"""The docs' "Tools and environments" page (docs/tools.md), walked as a new user would: its files (`my_tools.py`,
`won.py`) and commands are read from the page itself and run in a fresh folder with `my.yaml` of "Your own model,
data and reward", whose hub model is swapped for a tiny Qwen2 chat model with Qwen2.5's tool template
(tests/tool_world.py, made here: no network) and whose `train.parquet` each example writes as its text says. Tiny
settings are appended to each `grpo init` (the hf backend, a few prompts, short episodes) and `--iterations 20` runs
1."""

from __future__ import annotations

import random
import re
import shlex
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from tests.doc_pages import DOCS, page
from tests.test_readme import ENV, code_blocks, commands
from tests.tool_world import world

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SECTION = page("tools.md")
TINY = [
    "rollout.backend=hf",
    "rollout.prompts_per_iteration=4",
    "rollout.group_size=2",
    "rollout.max_tokens=80",
    "rollout.max_turns=3",
    "rollout.tool_workers=1",
    "learn.minibatch_size=8",
    "learn.microbatch_size=8",
    "eval.n_prompts=2",
    "reward.workers=1",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A user's folder: my.yaml naming the tiny tool-calling model, and the section's Python files."""
    root = world(tmp_path_factory.mktemp("world"))
    here = tmp_path_factory.mktemp("user")
    my_yaml = next(body for lang, body in code_blocks(DOCS) if lang == "yaml" and "Instruct" in body)
    config = yaml.safe_load(my_yaml)
    assert config["task"]["dataset"] == "train.parquet", "README's my.yaml names its dataset otherwise"
    config["model"]["base_model"] = str(root / "model")
    (here / "my.yaml").write_text(yaml.safe_dump(config))
    for lang, body in code_blocks(SECTION):
        named = re.match(r"# (\w+\.py)\n", body)
        if lang == "python" and named:
            (here / named.group(1)).write_text(body)
    assert (here / "my_tools.py").exists() and (here / "won.py").exists(), "the section's files moved"
    return here, root


def example(run: str) -> list[str]:
    """The section's commands for one run id, in README order."""
    return [line for line in commands(SECTION) if re.search(rf"--run {run}\b", line)]


def walk(lines: list[str], cwd, url: str | None = None) -> str:
    """Run each `.venv/bin/grpo` line in `cwd` as this checkout's CLI (storage ./storage there); the last one's
    stdout."""
    for line in lines:
        line = line.replace("--iterations 20", "--iterations 1")
        if url:
            line = line.replace("http://127.0.0.1:8000", url)
        argv = shlex.split(line)
        assert argv[0] == ".venv/bin/grpo", line
        argv = [sys.executable, "-m", "flows.cli", *argv[1:]]
        if argv[3] == "init":
            argv += [arg for s in TINY for arg in ("--set", s)]
        done = subprocess.run(argv, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_section_names_three_examples_and_each_is_walked():
    assert [bool(example(run)) for run in ("tools", "calc", "guess")] == [True, True, True]
    every = commands(SECTION)
    walked = [line for run in ("tools", "calc", "guess") for line in example(run)]
    rest = [line for line in every if line not in walked]
    assert all(re.search(r"pip install|uvicorn openenv_envs", line) for line in rest), rest


def test_plain_functions_as_tools(folder):
    here, root = folder
    pd.read_parquet(root / "questions.parquet").to_parquet(here / "train.parquet")  # question, answer
    walk(example("tools"), here)
    turns = pd.read_parquet(next(here.glob("storage/runs/tools/iter-0000/rollouts/attempt-*/turns.parquet")))
    assert "multiply" in {n for names in turns.tool_names for n in names}  # (and calls the model botched)


def test_a_trl_environment_class(folder):
    from grpo.tasks.calculator import problem

    here, _ = folder
    rng = random.Random(0)
    pd.DataFrame([problem(rng) for _ in range(12)]).to_parquet(here / "train.parquet")
    out = walk(example("calc"), here)
    assert "calls" in out and re.search(r"^\s*0\s+\d+(\.\d+)?\s*$", out, re.M), out  # iteration 0, its calls a turn


def test_an_openenv_server(folder):
    pytest.importorskip("openenv.core", reason="openenv-core is in the agents and dev extras")
    from tools.openenv_server import openenv_server

    here, _ = folder
    start = next(line for line in commands(SECTION) if "uvicorn" in line)
    app, app_dir = re.search(r"uvicorn (\S+) --app-dir (\S+)", start).groups()
    games = [{"question": f"Game {i}. Guess my number.", "answer": str(t)} for i, t in enumerate((3, 9, 14, 20, 7))]
    pd.DataFrame(games * 2).to_parquet(here / "train.parquet")
    with openenv_server(app, here / "server", app_dir=app_dir) as server:
        walk(example("guess"), here, url=server.url)
    it = here / "storage/runs/guess/iter-0000"
    assert list(it.glob("learn/attempt-*/_manifest.json"))
    rewards = pd.read_parquet(next(it.glob("rewards/attempt-*/rewards.parquet")))
    assert set(rewards.reward) <= {0.0, 1.0} and len(rewards) == 8  # won.py: the server's reward, 4 prompts x 2
