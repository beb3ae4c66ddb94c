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


def test_a_carried_episode_is_re_created_by_replay_in_another_worker(walk):
    """rollout.segment_tokens: the next iteration's stage re-creates a carried episode's server session in a fresh
    worker by reset with its seed and its answered turns again: the session answers as it did (position 1, not 0)."""
    from grpo.episodes.workers import Item, Workers
    from grpo.runtime.pool import RewardPool

    source = Source(kind="openenv", environment=walk.url, timeout_s=30.0)
    row, turns = {"goal": 3}, [("", [ToolCall("step", {"steps": 2})], 1), ("", [ToolCall("step", {"steps": "x"})], 2)]
    with RewardPool(1) as pool:
        workers = Workers(pool, source, None)
        [key] = workers.keys(1)
        [reset] = workers.run("reset", [Item(key, 5, (row, 5))])
        recorded = []
        for text, calls, seed in turns:
            [out] = workers.run("respond", [Item(key, seed, (text, calls))])
            recorded.append((out.value.done, out.value.messages, out.value.errors))
        workers.run("close", [Item(key, 0)])
    with RewardPool(1) as pool:  # another process, as the next iteration's stage
        workers = Workers(pool, source, None)
        [key] = workers.keys(1)
        [replayed] = workers.run("replay", [Item(key, 5, (row, 5, turns))])
        [out] = workers.run("respond", [Item(key, 3, ("", [ToolCall("step", {"steps": -1})]))])
        workers.run("close", [Item(key, 0)])
    assert replayed.value == (reset.value[0], reset.value[1], recorded) and len(recorded[1][2]) == 1
    assert out.value.messages[0]["content"] == '{"position": 1, "goal": 3}'  # the session went on from position 2


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


def test_a_server_that_stops_answering_says_what_timed_out(tmp_path):
    """A server stopped (SIGSTOP) mid-episode: the step runs past rollout.tool_timeout_s, and the one line says so (it
    said "TimeoutError: " and nothing more)."""
    with openenv_server("openenv_envs:guess_app", tmp_path, app_dir="tests") as server:
        ep = factory(Source(kind="openenv", environment=server.url, timeout_s=1.0))()
        ep.reset({"target": 4}, seed=0)
        os.killpg(server.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(EnvironmentFailure) as failure:
                ep.respond("4", [])
        finally:
            os.killpg(server.proc.pid, signal.SIGCONT)
        ep.close()
    assert str(failure.value) == (
        f"OpenEnv server {server.url}: step: TimeoutError: no answer within 1s (rollout.tool_timeout_s)"
    )


def test_no_server_at_the_url_fails_naming_it():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EnvironmentFailure, match=f"rollout.environment '{url}': no OpenEnv server answers there"):
        factory(Source(kind="openenv", environment=url))


# ---------------------------------------------------------------- through the rollouts and rewards stages

WON = '''
def won(response, ground_truth, prompt, environment):
    """The server's reward for the episode, as its steps gave it (OpenEnv's reward, recorded by the adapter)."""
    return environment.reward
'''


@pytest.fixture(scope="module")
def guess_world(tmp_path_factory):
    """A Qwen2 chat model with random weights (any text is a guess) and questions whose rows carry the target."""
    import pandas as pd

    from grpo.tiny_model import TOOLS_CHAT_TEMPLATE, build_chat_model

    root = tmp_path_factory.mktemp("guess-world")
    texts = [f"Guess the number. {n} Higher. Lower. Correct! Say a number." for n in range(1, 21)]
    build_chat_model(str(root / "model"), texts, vocab_size=300, chat_template=TOOLS_CHAT_TEMPLATE)
    rows = [{"question": f"Game {i}.", "answer": str(t), "target": t} for i, t in enumerate((3, 9, 14, 20, 7, 12))]
    pd.DataFrame(rows).to_parquet(root / "games.parquet")
    (root / "rewards.py").write_text(WON)
    return root


def run_config(root, url: str) -> list[str]:
    return [
        f"model.base_model={root / 'model'}",
        "task.name=math",
        f"task.dataset={root / 'games.parquet'}",
        "task.prompt_column=question",
        "task.answer_column=answer",
        f"rollout.environment={url}",
        f"reward.functions=[{root / 'rewards.py'}:won]",
        "rollout.backend=hf",
        "rollout.prompts_per_iteration=4",
        "rollout.group_size=2",
        "rollout.max_tokens=60",
        "rollout.stop=[' ']",  # random weights: a turn is a word or so
        "rollout.max_turns=3",
        "rollout.tool_workers=2",
        "learn.minibatch_size=8",
        "learn.microbatch_size=8",
        "eval.split_fraction=0.3",  # 2 of the 6 games held out, 4 sampled
        "eval.n_prompts=2",
        "reward.workers=1",
    ]


@pytest.mark.e2e
def test_an_openenv_server_s_episodes_go_through_the_stages(guess_world, tmp_path):
    """Rollouts against the server: each turn's text was a guess, each observation the server's answer as a user
    message (mask 0 between the turns), the reset's prompt joined to the question; the episodes table holds the
    steps' rewards, and the rewards stage scores them."""
    import json

    import pandas as pd

    from grpo.config import load_config
    from grpo.record.storage import open_storage
    from stages.init import init_run
    from stages.rewards import rewards
    from stages.rollouts import rollouts
    from stages.snapshot import snapshot

    storage = open_storage((tmp_path / "store").as_uri())
    with openenv_server("openenv_envs:guess_app", tmp_path, app_dir="tests") as server:
        init_run(storage, "g", load_config(None, run_config(guess_world, server.url)))
        snapshot(storage, "g", 0)
        ro = rollouts(storage, "g", 0)
        rw = rewards(storage, "g", 0)
    t = {n: pd.read_parquet(storage.uri(ro.path(f"{n}.parquet"))) for n in ("rollouts", "turns", "episodes")}
    assert len(t["rollouts"]) == len(t["episodes"]) == 8
    hints = {"Higher.", "Lower.", "Correct!", "Say a number."}
    for row, ep in zip(t["rollouts"].itertuples(), t["episodes"].itertuples()):
        assert "Guess a number from 1 to 20." in row.prompt  # the reset's observation, joined to the question
        state, conversation = json.loads(ep.environment), json.loads(ep.messages)
        said = [m["content"] for m in conversation if m["role"] == "user"]
        assert set(said) <= hints and len(said) == ep.turns - 1  # each answer but the last (no turn reads it)
        assert len(state["rewards"]) == ep.turns and state["url"] == server.url  # every turn was a step
        assert (ep.ended_by == "done") <= state["done"] and state["done"] <= (ep.ended_by in ("done", "budget"))
        assert state["reward"] == float(state["observation"]["prompt"] == "Correct!")
        turns = t["turns"][(t["turns"].prompt_id == row.prompt_id) & (t["turns"].sample_index == row.sample_index)]
        mask = list(row.loss_mask)
        for turn in turns.itertuples():  # sampled ids trained on, the server's answers between them not
            assert mask[turn.token_start : turn.token_end] == [1] * (turn.token_end - turn.token_start)
            assert mask[turn.token_end : turn.token_end + turn.observation_tokens] == [0] * turn.observation_tokens
    scored = pd.read_parquet(storage.uri(rw.path("rewards.parquet")))
    states = {(e.prompt_id, e.sample_index): json.loads(e.environment) for e in t["episodes"].itertuples()}
    for s in scored.itertuples():
        assert s.reward == states[(s.prompt_id, s.sample_index)]["reward"]


@pytest.mark.e2e
def test_a_server_gone_before_the_rollouts_fails_the_stage_in_one_line(guess_world, tmp_path):
    from grpo.config import load_config
    from grpo.errors import StageError
    from grpo.record.storage import open_storage
    from stages.init import init_run
    from stages.rollouts import rollouts
    from stages.snapshot import snapshot

    storage = open_storage((tmp_path / "store").as_uri())
    with openenv_server("openenv_envs:guess_app", tmp_path, app_dir="tests") as server:
        init_run(storage, "g", load_config(None, run_config(guess_world, server.url)))
        snapshot(storage, "g", 0)
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        with pytest.raises(Exception) as failure:
            rollouts(storage, "g", 0)
    message = str(failure.value)
    assert isinstance(failure.value, StageError) and "\n" not in message, message
    assert message == (
        f"rollout.environment {server.url!r}: EnvironmentFailure: rollout.environment {server.url!r}: no OpenEnv "
        "server answers there (ConnectionError); start it first"
    )
    assert not storage.fs.exists(storage.root + "/runs/g/iterations/0/rollouts/_manifest.json")  # nothing committed
