"""OpenEnv capacity (issue 54, item 2): `grpo init` learns how many sessions the server holds and refuses a config
that opens more at once, naming both numbers and the two settings; a server at capacity during a run is named as
such; the README's example fits the server it starts. Real servers (openenv-core's create_app under uvicorn)."""

from __future__ import annotations

import shlex

import pytest
import yaml

pytest.importorskip("openenv.core", reason="openenv-core is in the agents and dev extras")

from test_openenv import guess_world, run_config  # noqa: E402, F401 (a fixture)
from test_readme import code_blocks, commands  # noqa: E402

from grpo.config import ConfigError, load_config  # noqa: E402
from grpo.episodes.adapters import Source, factory  # noqa: E402
from grpo.episodes.environment import EnvironmentFailure  # noqa: E402
from grpo.episodes.openenv import check_sessions, session_limit  # noqa: E402
from grpo.record.storage import open_storage  # noqa: E402
from stages.init import init_run  # noqa: E402
from tests.doc_pages import page  # noqa: E402
from tools.openenv_server import openenv_server  # noqa: E402

HOLDS = 16  # tests/openenv_envs.py: create_app(..., max_concurrent_envs=16)


@pytest.fixture(scope="module")
def guess(tmp_path_factory):
    with openenv_server("openenv_envs:guess_app", tmp_path_factory.mktemp("guess"), app_dir="tests") as server:
        yield server


def test_the_session_limit_is_learned_by_opening_sessions_and_they_are_closed_after(guess):
    assert session_limit(guess.url, 100) == HOLDS
    assert session_limit(guess.url, HOLDS) is None  # it held all those asked for
    assert session_limit(guess.url, 100) == HOLDS  # the probe's sessions were closed: all free again


def test_a_config_opening_more_sessions_than_the_server_holds_is_refused_naming_both(guess):
    over = load_config(None, [f"rollout.environment={guess.url}", "rollout.chunk_prompts=3", "eval.n_prompts=16"])
    with pytest.raises(ConfigError) as refused:
        check_sessions(over)
    line = str(refused.value)
    assert "\n" not in line and f"holds at most {HOLDS} sessions" in line and "opens 24" in line, line
    assert "rollout.chunk_prompts x rollout.group_size = 3 x 8" in line and "max_concurrent_envs=24" in line
    evals = load_config(None, [f"rollout.environment={guess.url}", "rollout.chunk_prompts=2"])  # eval: 128 x 1
    with pytest.raises(ConfigError, match=r"opens 128 \(eval.n_prompts x eval.samples_per_prompt = 128 x 1"):
        check_sessions(evals)
    check_sessions(load_config(None, [f"rollout.environment={guess.url}", "rollout.chunk_prompts=2",
                                      "eval.n_prompts=16"]))  # fmt: skip


def test_the_docs_example_as_written_fits_its_server(guess):
    """my.yaml (docs/own-model.md) and the guess init line's settings (docs/tools.md), none of the tests' sizes: what
    `grpo init` checks passes."""
    section = page("tools.md")
    mine = code_blocks(page("own-model.md"))
    my = yaml.safe_load(next(body for lang, body in mine if lang == "yaml" and "Instruct" in body))
    line = next(c for c in commands(section) if c.startswith(".venv/bin/grpo init --run guess"))
    settings = [s for s in shlex.split(line) if "=" in s and not s.startswith("reward.")]
    cfg = load_config(my, [s.replace("http://127.0.0.1:8000", guess.url) for s in settings])
    assert cfg.rollout.environment == guess.url
    check_sessions(cfg)


def test_init_refuses_an_over_capacity_config_before_writing_anything(guess_world, guess, tmp_path):  # noqa: F811
    storage = open_storage((tmp_path / "store").as_uri())
    cfg = load_config(None, run_config(guess_world, guess.url) + ["rollout.group_size=8"])
    with pytest.raises(ConfigError, match=rf"holds at most {HOLDS} sessions at once and the run opens 32"):
        init_run(storage, "r", cfg)
    assert not storage.exists(storage.path("runs", "r", "run.json"))


def test_a_server_at_capacity_during_a_run_is_named_as_such(guess):
    held = [factory(Source(kind="openenv", environment=guess.url, timeout_s=30.0))() for _ in range(HOLDS)]
    try:
        for i, ep in enumerate(held):
            ep.reset({"target": 3}, seed=i)
        one_more = factory(Source(kind="openenv", environment=guess.url, timeout_s=30.0))()
        with pytest.raises(EnvironmentFailure) as failure:
            one_more.reset({"target": 3}, seed=99)
        one_more.close()
    finally:
        for ep in held:
            ep.close()
    line = str(failure.value)
    assert "\n" not in line and f"the server is at capacity, {HOLDS} sessions" in line, line
    assert "rollout.chunk_prompts x rollout.group_size" in line
