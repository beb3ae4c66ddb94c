"""The OpenEnv adapter (grpo/episodes/openenv.py) against real OpenEnv servers: openenv-core's `create_app` under
uvicorn on 127.0.0.1 (tests/openenv_envs.py), driven through openenv-core's own client, never a mock."""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("openenv.core", reason="openenv-core is in the agents and dev extras")

from grpo.episodes.adapters import Source, factory  # noqa: E402
from grpo.episodes.environment import EnvironmentFailure, ToolCall  # noqa: E402
from grpo.runtime.procs import free_port  # noqa: E402
from tools.openenv_server import openenv_server  # noqa: E402


@pytest.fixture(scope="module")
def guess(tmp_path_factory):
    with openenv_server("openenv_envs:guess_app", tmp_path_factory.mktemp("guess"), app_dir="tests") as server:
        yield server


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    with openenv_server("openenv_envs:walk_app", tmp_path_factory.mktemp("walk"), app_dir="tests") as server:
        yield server


def episode(url: str):
    return factory(Source(kind="openenv", environment=url, timeout_s=30.0))()


def test_a_text_action_is_the_turn_and_the_observation_the_next_user_message(guess):
    ep = episode(guess.url)
    try:
        assert ep.tools() == []  # the action is one string: no tool, the turn's text is the action
        assert ep.reset({"target": 7, "prompt": [{"role": "user", "content": "play"}]}, seed=3) == [
            {"role": "user", "content": "Guess a number from 1 to 20."}
        ]
        first = ep.respond("I say 5", [])
        assert (first.messages, first.done, first.errors) == ([{"role": "user", "content": "Higher."}], False, [])
        last = ep.respond("Then 7", [])
        assert (last.messages, last.done) == ([{"role": "user", "content": "Correct!"}], True)
        final = ep.final()
        assert (final["rewards"], final["reward"], final["done"]) == ([0.0, 1.0], 1.0, True)
        assert final["observation"] == {"prompt": "Correct!"} and final["url"] == guess.url
    finally:
        ep.close()


def test_the_reset_gets_the_group_seed_so_its_episodes_start_alike(guess):
    """No `target` in the row: the server draws it from the reset's seed; the episode that guesses the seed's
    number wins at once, and two episodes of one seed are one game."""
    import random

    target = random.Random(11).randint(1, 20)
    episodes = [episode(guess.url) for _ in range(2)]  # two sessions open at once, as a group's episodes are
    try:
        for ep in episodes:
            ep.reset({}, seed=11)
        replies = [ep.respond(str(target), []) for ep in episodes]
        assert [(r.messages[0]["content"], r.done) for r in replies] == [("Correct!", True)] * 2
    finally:
        for ep in episodes:
            ep.close()


def test_any_other_action_is_the_step_tool_and_the_model_s_mistakes_are_observations(walk):
    ep = episode(walk.url)
    try:
        (tool,) = ep.tools()
        assert tool["function"]["name"] == "step"
        assert tool["function"]["description"] == "Walk some steps along the line (negative: back)."
        assert tool["function"]["parameters"]["properties"]["steps"]["type"] == "integer"
        assert ep.reset({"goal": 3}, seed=0) == [{"role": "user", "content": '{"position": 0, "goal": 3}'}]
        reply = ep.respond("", [ToolCall("step", {"steps": 2})])
        assert reply.messages == [{"role": "tool", "name": "step", "content": '{"position": 2, "goal": 3}'}]
        assert not reply.done and reply.errors == []
        bad = ep.respond("", [ToolCall("step", {"steps": "far"}), ToolCall("jump", {}), ToolCall("", error="no JSON")])
        assert len(bad.errors) == 3 and not bad.done  # the server's rejection, an unknown tool, an unparsed call
        assert "VALIDATION_ERROR" in bad.messages[0]["content"] and "Tool jump not found" in bad.messages[1]["content"]
        raised = ep.respond("", [ToolCall("step", {"steps": 50})])  # the environment's step raises: its text
        assert "at most 10 steps at once" in raised.messages[0]["content"] and raised.errors
        last = ep.respond("", [ToolCall("step", {"steps": 1})])
        assert last.done and last.messages[0]["content"] == '{"position": 3, "goal": 3}'
        assert ep.final()["rewards"] == [0.0, 1.0] and ep.final()["reward"] == 1.0
        assert ep.respond("no call", []).done  # a turn without a call ends the episode
    finally:
        ep.close()


def test_a_server_that_dies_fails_in_one_line_naming_it(tmp_path):
    with openenv_server("openenv_envs:guess_app", tmp_path, app_dir="tests") as server:
        ep = episode(server.url)
        ep.reset({"target": 4}, seed=0)
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        with pytest.raises(EnvironmentFailure) as failure:
            ep.respond("4", [])
        ep.close()
    message = str(failure.value)
    assert "\n" not in message and message.startswith(f"OpenEnv server {server.url}: step")


def test_no_server_at_the_url_fails_naming_it():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EnvironmentFailure, match=f"rollout.environment '{url}': no OpenEnv server answers there"):
        factory(Source(kind="openenv", environment=url))
