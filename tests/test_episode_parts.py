"""The parts of the episode engine (grpo/episodes) one at a time: environments in worker processes (what a tool that
raises, hangs, kills its worker or reads credentials costs), the samplers' per-episode seeds, tool calls parsed by a
tokenizer's response template, a chat template that cannot continue a conversation, and the settings refused."""

import dataclasses
import json

import pytest
import torch

from grpo.config import ConfigError, load_config
from grpo.episodes.adapters import Source
from grpo.episodes.chat import observation_tokens
from grpo.episodes.environment import Reply, ToolCall
from grpo.episodes.parsing import parse_turn
from grpo.episodes.workers import Item, Workers, probe
from grpo.errors import StageError
from grpo.runtime.pool import RewardPool
from grpo.sampling.base import SamplingSpec
from grpo.sampling.hf import HFGenerator
from grpo.tiny_model import TOOLS_CHAT_TEMPLATE, build_chat_tokenizer, build_tiny_model

ROUGH = '''
import os
import random
import signal
import time


class Rough:
    """An environment whose tools misbehave in every way a worker must survive."""

    def __init__(self):
        self.seen = []

    def reset(self, **row):
        self.row = row
        return None

    def echo(self, text: str) -> str:
        """Answer with the text and a random draw (seeded by the worker for the episode and turn).

        Args:
            text: what to say back
        """
        self.seen.append(text)
        return f"{text} {random.random():.6f}"

    def secret(self) -> str:
        """The stage's credential, if the worker had it."""
        return os.environ.get("AWS_SECRET_ACCESS_KEY", "none")

    def boom(self) -> str:
        """Raise."""
        raise ValueError("no such luck")

    def hang(self) -> str:
        """Block the alarm and sleep: only a kill ends it."""
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(60)
        return "never"

    def die(self) -> str:
        """End the worker."""
        os._exit(3)
'''


@pytest.fixture
def rough(tmp_path):
    path = tmp_path / "rough.py"
    path.write_text(ROUGH)
    return Source(kind="environment", environment=f"{path}:Rough", environment_file=str(path), timeout_s=0.5)


def turn(workers: Workers, keys: list, calls: list[list[ToolCall]], seed: int = 1, limit: float = 2.0) -> list:
    return workers.run("respond", [Item(k, seed, ("", c), limit) for k, c in zip(keys, calls)])


def test_episodes_live_in_workers_without_credentials_and_survive_their_tools(rough, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    with RewardPool(2) as pool:
        assert [t["function"]["name"] for t in pool.apply(probe, (rough, None))] == [
            "boom",
            "die",
            "echo",
            "hang",
            "secret",
        ]
        workers = Workers(pool, rough, None)
        keys = workers.keys(4)  # episodes 0, 2 in worker 0; 1, 3 in worker 1
        reset = workers.run("reset", [Item(k, 7, ({"prompt": "p"}, 7)) for k in keys])
        assert all(o.value[0] == [] for o in reset)  # Rough's reset adds nothing to the prompt
        out = turn(
            workers, keys, [[ToolCall("secret", {})], [ToolCall("boom", {})], [ToolCall("echo", {"text": "a"})], []]
        )
        assert out[0].value.messages == [
            {"role": "tool", "name": "secret", "content": "none"}
        ]  # the credential stayed out
        assert out[1].value.messages[0]["content"] == "{'error': 'no such luck'}"
        assert out[1].value.errors == ["boom: ValueError: no such luck"] and not out[1].value.done
        assert out[3].value == Reply(done=True)  # no call: the episode ends
        again = turn(workers, [keys[2]], [[ToolCall("echo", {"text": "a"})]])  # the same seed: the same draw
        assert again[0].value.messages == out[2].value.messages

        out = turn(
            workers,
            keys,
            [[ToolCall("die", {})], [ToolCall("echo", {"text": "b"})], [ToolCall("echo", {"text": "c"})], []],
        )
        assert "its tool worker died (exit code 3)" in out[0].lost
        assert out[2].lost.startswith("lost with its worker")  # its environment lived there too
        assert out[1].value.messages[0]["content"].startswith("b ")  # the other worker's episodes go on
        later = turn(workers, [keys[0], keys[1]], [[ToolCall("echo", {"text": "d"})], [ToolCall("hang", {})]])
        assert later[0].lost == out[0].lost  # not sent again
        assert "respond ran past 2s (its limit by rollout.tool_timeout_s); its tool worker was killed" in later[1].lost
        fresh = workers.keys(2)  # the replaced workers serve new episodes
        workers.run("reset", [Item(k, 7, ({}, 7)) for k in fresh])
        assert all(o.value.messages for o in turn(workers, fresh, [[ToolCall("echo", {"text": "e"})]] * 2))


def test_a_tool_past_its_time_limit_is_an_error_the_model_sees(tmp_path):
    path = tmp_path / "slow.py"
    path.write_text(
        "import time\n\ndef nap(s: float) -> str:\n"
        '    """Sleep.\n\n    Args:\n        s: seconds\n    """\n    time.sleep(s)\n    return "rested"\n'
    )
    source = Source(kind="tools", tools=(f"{path}:nap",), tool_files=(str(path),), timeout_s=0.3)
    with RewardPool(1) as pool:
        workers = Workers(pool, source, None)
        [key] = workers.keys(1)
        workers.run("reset", [Item(key, 0, ({}, 0))])
        [out] = turn(workers, [key], [[ToolCall("nap", {"s": 30}), ToolCall("nap", {"s": 0})]], limit=5)
    assert [m["content"] for m in out.value.messages] == ["{'error': 'timed out after 0.3s'}", "rested"]
    assert out.value.errors == ["nap: timed out after 0.3s"] and out.seconds < 5


def test_an_environment_that_raises_fails_its_item_not_its_worker(rough, tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("class Broken:\n    def reset(self, **row):\n        raise ConnectionError('server gone')\n")
    source = Source(kind="environment", environment=f"{path}:Broken", environment_file=str(path))
    with RewardPool(1) as pool:
        [out] = Workers(pool, source, None).run("reset", [Item(("x", 0), 0, ({}, 0))])
    assert out.failed == "ConnectionError: server gone"


def test_a_row_samples_from_its_own_seed_whatever_shares_the_call(tmp_path):
    """The transformers sampler with per-prompt seeds: a prompt's samples are the same alone or beside others."""
    torch.manual_seed(0)
    model = build_tiny_model(str(tmp_path / "m"), [str(i) for i in range(10)])
    gen = HFGenerator(model)
    a, b = [2, 5, 6], [2, 7, 8]
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=6, seed=0)
    alone = gen.generate([a], spec, seeds=[11])
    together = gen.generate([b, a], spec, seeds=[99, 11])
    assert [s.response_ids for s in alone[0]] == [s.response_ids for s in together[1]]
    shifted = gen.generate([a], dataclasses.replace(spec, n=1), seeds=[12])  # sample j draws from seed + j
    assert shifted[0][0].response_ids == alone[0][1].response_ids


def test_a_response_template_parses_the_turn():
    """Where the tokenizer has transformers' response_template, it parses the tool calls (here Qwen3's)."""
    trl = pytest.importorskip("trl.chat_template_utils")
    tok = build_chat_tokenizer(["x"], 300, TOOLS_CHAT_TEMPLATE)
    tok.response_template = trl.qwen3_template
    prefix = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    text = 'Let me.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    message, calls = parse_turn(tok, text, prefix, [])
    assert calls == [ToolCall("multiply", {"a": 2, "b": 3})] and message["content"] == "Let me."
    _, calls = parse_turn(tok, '<tool_call>\n{"name": "multiply", "arguments": {"a"\n</tool_call>', prefix, [])
    assert calls[0].name == "" and "JSON" in calls[0].error


def test_a_template_that_rewrites_earlier_turns_is_refused_in_one_line():
    tok = build_chat_tokenizer(["x"], 300, TOOLS_CHAT_TEMPLATE)
    tok.chat_template = (  # an assistant turn shown in full only while it is the last message (as Qwen3 drops <think>)
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
        "{%- if m.role == 'assistant' and not loop.last %}(earlier){% else %}{{ m.content }}{% endif %}<|im_end|>\n"
        "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    )
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "call"}]
    with pytest.raises(StageError, match="not prefix-preserving"):
        observation_tokens(tok, history, [{"role": "user", "content": "42"}], [], "<|im_end|>", ["<|im_end|>"])


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["rollout.tools=[t.py:f]", "task.prompt_format=text"], "task.prompt_format=text: episodes"),
        (["rollout.environment=nope"], "rollout.environment: 'nope' is not of the form"),
        (["rollout.tools=[m:f]", "rollout.max_turns=0"], "rollout.max_turns must be >= 1"),
        (["rollout.tools=[m:f]", "rollout.tool_timeout_s=0"], "rollout.tool_timeout_s must be > 0"),
        (["rollout.tools=[m:f]", "rollout.min_signal_groups=32"], "dynamic sampling does not sample episodes"),
        (["rollout.tool_pass_env=[AWS_*]"], "rollout.tool_pass_env lists environment variable names"),
    ],
)
def test_episode_settings_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace("[", r"\[")):
        load_config(None, overrides)


def test_the_final_state_is_stored_as_json(rough):
    with RewardPool(1) as pool:
        workers = Workers(pool, rough, None)
        [key] = workers.keys(1)
        workers.run("reset", [Item(key, 0, ({"prompt": "p"}, 0))])
        turn(workers, [key], [[ToolCall("echo", {"text": "a"})]])
        [out] = workers.run("final", [Item(key, 0)])
    assert out.value == {"seen": ["a"], "row": {"prompt": "p"}} and json.dumps(out.value)


def test_a_single_turn_response_is_an_episode_whose_loop_is_the_samplers_own_call(tmp_path):
    """Without an environment an episode is the single-turn response single-turn rollouts committed before it was one:
    Loop.run is the sampler's one call for the chunk (spec.n samples of each prompt, every number drawn from
    spec.seed), Loop.advance (rollout.segment_tokens) continues each from its ids with at most `cap` tokens, seeded
    by the response alone; each token stamped with the loop's policy, and the rows' finish reasons the sampler's."""
    from transformers import AutoTokenizer

    from grpo.episodes.loop import Limits, Loop, Start
    from grpo.record.layout import episode_seed
    from grpo.sampling.base import stop_token_ids

    model = build_tiny_model(str(tmp_path / "m"), [str(i) for i in range(10)])
    gen, tok = HFGenerator(model), AutoTokenizer.from_pretrained(model)
    loop = Loop(gen, tok, stop_token_ids(tok, model), None, Limits(1, 9, 64, 1.0), policy=(4, "abc"))
    prompts = [[2, 5, 6], [2, 7, 8, 9]]
    starts = [Start(i, [], {}, f"p{i}", ids, 9 - i, str(i), "{}", 3) for i, ids in enumerate(prompts)]
    spec = SamplingSpec(n=3, temperature=1.0, max_tokens=9, seed=7)
    groups = loop.run(starts, spec, env_seed=0)
    direct = gen.generate(prompts, spec, [9, 8])
    assert [[(e.response_ids, e.logprobs, e.finish_reason) for e in g] for g in groups] == [
        [(list(s.response_ids), list(s.logprobs), s.finish_reason) for s in g] for g in direct
    ]
    e = groups[1][2]
    assert (e.prompt_id, e.sample_index, e.prompt_text, e.prompt_ids, e.budget, e.started) == (
        1,
        2,
        "p1",
        prompts[1],
        8,
        3,
    )
    assert e.loss_mask == [1] * len(e.response_ids) and e.versions == [4] * len(e.response_ids) and not e.turns
    assert e.policy_hash == "abc" and not e.has_environment and e.finish is not None

    fresh = [g[0] for g in loop.open(starts, 1, env_seed=0)]
    total = loop.advance(fresh, spec, cap=2, rows=2)
    one = dataclasses.replace(spec, n=1)
    seeds = [episode_seed(7, i, 0, 0) for i in range(2)]
    cut = gen.generate(prompts, one, [2, 2], seeds=seeds)
    assert [e.response_ids for e in fresh] == [list(s.response_ids) for [s] in cut]
    assert total == sum(len(e.response_ids) for e in fresh)
    for e, [s] in zip(fresh, cut):  # cut by the cap: still going unless it stopped
        assert e.finish == ("stop" if s.finish_reason == "stop" else None) and e.open is None
