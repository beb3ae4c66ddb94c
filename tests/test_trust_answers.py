"""What tools and environments answer is untrusted input (issue 53): a credential read from the stage's own
environment block is redacted from every channel an answer takes (observation, error, content blocks, reset's text,
final state, a broken environment's line, an answer cut in the middle of the credential); a result that cannot become
text is the model's error to see, naming the tool; a 40 MB answer costs the stage at most rollout.max_observation_bytes
(its memory stays flat: an RSS bound) and never reaches the tokenizer past what the episode's budget holds. And the
minor cases: building an environment and its reset are bounded by rollout.tool_timeout_s and named as a tool worker's;
rollout.tool_workers is capped as reward.workers is; a spec that names a path which is no .py file says so."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from grpo.episodes.adapters import Source
from grpo.episodes.environment import EnvironmentFailure, ToolCall
from grpo.episodes.loop import Limits, Loop, Start
from grpo.episodes.records import Turn
from grpo.episodes.workers import Item, Workers, check
from grpo.runtime.pool import RewardPool
from grpo.tiny_model import TOOLS_CHAT_TEMPLATE, build_chat_model

ROOT = Path(__file__).resolve().parents[1]
SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"  # the stage's, in the environment it was started with
REDACTED = "<AWS_SECRET_ACCESS_KEY redacted>"

LEAKY = '''
import os


def _stage_environ() -> str:
    """The environment block the stage (this worker's parent) was started with: readable by the same user."""
    with open(f"/proc/{os.getppid()}/environ", "rb") as f:
        return f.read().replace(b"\\0", b" ").decode(errors="replace")


def _key() -> str:
    return _stage_environ().split("AWS_SECRET_ACCESS_KEY=")[1].split()[0]


def peek() -> str:
    """The stage's credential."""
    return "got " + _key()


def blocks() -> list:
    """The stage's credential as content blocks."""
    return [{"type": "text", "text": "got " + _key()}]


def fail() -> str:
    """Raise with the stage's credential in the message."""
    raise ValueError("got " + _key())


def cut(n: int) -> str:
    """n bytes of padding, then the credential.

    Args:
        n: bytes before it
    """
    return "x" * n + _key()


class Leaky:
    """An environment class (TRL's environment_factory) that leaks through reset, its state and a method."""

    def reset(self, **row):
        self.seen = "state " + _key()
        return "reset " + _key()

    def look(self) -> str:
        """The stage's credential."""
        return "look " + _key()


class Broken:
    def reset(self, **row):
        raise ConnectionError("cannot log in with " + _key())
'''

CHANNELS = """
import dataclasses, json, sys
from grpo.episodes.adapters import Source
from grpo.episodes.environment import ToolCall
from grpo.episodes.environment import EnvironmentFailure
from grpo.episodes.workers import Item, Workers, check
from grpo.runtime.pool import RewardPool

path = sys.argv[1]
names = ("peek", "blocks", "fail", "cut")
tools = Source(kind="tools", tools=tuple(f"{path}:{n}" for n in names), tool_files=(path,) * 4,
               max_observation_bytes=110)
env = Source(kind="environment", environment=f"{path}:Leaky", environment_file=path)
broken = Source(kind="environment", environment=f"{path}:Broken", environment_file=path)
out = {}
with RewardPool(1) as pool:
    w = Workers(pool, tools, None)
    [key] = w.keys(1)
    w.run("reset", [Item(key, 0, ({}, 0))])
    for name, args in [("peek", {}), ("blocks", {}), ("fail", {}), ("cut", {"n": 100})]:
        [o] = w.run("respond", [Item(key, 1, ("", [ToolCall(name, args)]), 5.0)])
        out[name] = dataclasses.asdict(o.value)
    w = Workers(pool, env, None)
    [key] = w.keys(1)
    [o] = w.run("reset", [Item(key, 0, ({"prompt": "p"}, 0))])
    out["reset"] = o.value[0]
    [o] = w.run("respond", [Item(key, 1, ("", [ToolCall("look", {})]), 5.0)])
    out["look"] = dataclasses.asdict(o.value)
    [o] = w.run("final", [Item(key, 2, (), 5.0)])
    out["final"] = o.value
    [o] = Workers(pool, broken, None).run("reset", [Item(("b", 0), 0, ({}, 0))])
    out["broken"] = o.failed
print(json.dumps(out))
"""


def test_a_credential_read_from_the_stage_s_environment_block_is_redacted_from_every_answer(tmp_path):
    """The stage runs with AWS_SECRET_ACCESS_KEY in the environment it was started with (as a real stage does); tools
    and an environment class read it from /proc/<stage>/environ, which removing it from the workers cannot reach, and
    answer it through each channel: all of them reach the stage with it redacted."""
    (tmp_path / "leaky.py").write_text(LEAKY)
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": SECRET, "PYTHONPATH": str(ROOT), "GRPO_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHANNELS, str(tmp_path / "leaky.py")], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert SECRET[:6] not in done.stdout, done.stdout  # not whole, and not its first characters where a cut fell
    out = json.loads(done.stdout)
    assert out["peek"]["messages"] == [{"role": "tool", "name": "peek", "content": f"got {REDACTED}"}]  # observation
    assert out["blocks"]["messages"][0]["content"] == [{"type": "text", "text": f"got {REDACTED}"}]  # content blocks
    assert out["fail"]["messages"][0]["content"] == str({"error": f"got {REDACTED}"})  # the error the model sees
    assert out["fail"]["errors"] == [f"fail: ValueError: got {REDACTED}"]  # the turns table's error, the log
    assert out["cut"]["messages"][0]["content"] == "x" * 100 + REDACTED  # cut at 110 bytes, 10 into the key
    assert out["cut"]["cut"] == len(SECRET) - 10
    assert out["reset"] == [{"role": "user", "content": f"reset {REDACTED}"}]  # reset's text
    assert out["look"]["messages"][0]["content"] == f"look {REDACTED}"  # an environment class's reply
    assert out["final"] == {"seen": f"state {REDACTED}"}  # the final state, stored for the rewards
    assert out["broken"] == f"ConnectionError: cannot log in with {REDACTED}"  # the stage's one line


UNTEXTABLE = '''
def huge() -> int:
    """An integer past Python's digit limit for str()."""
    return 10**5000


class Opaque:
    def __str__(self):
        raise RuntimeError("no text here")


def opaque() -> str:
    """An object whose __str__ raises."""
    return Opaque()


def surrogate() -> str:
    """Text with a lone surrogate, which no tokenizer takes."""
    return "half " + chr(0xD800) + " a pair"


class Odd:
    def reset(self, **row):
        return "reset " + chr(0xDC80)

    def noop(self) -> str:
        """Nothing."""
        return "ok"
'''


def test_a_result_that_cannot_become_text_is_an_error_naming_the_tool_and_invalid_text_is_replaced(tmp_path):
    path = tmp_path / "untextable.py"
    path.write_text(UNTEXTABLE)
    names = ("huge", "opaque", "surrogate")
    tools = Source(kind="tools", tools=tuple(f"{path}:{n}" for n in names), tool_files=(str(path),) * 3)
    odd = Source(kind="environment", environment=f"{path}:Odd", environment_file=str(path))
    with RewardPool(1) as pool:
        w = Workers(pool, tools, None)
        [key] = w.keys(1)
        w.run("reset", [Item(key, 0, ({}, 0))])
        [o] = w.run("respond", [Item(key, 1, ("", [ToolCall(n, {}) for n in names]), 5.0)])
        w = Workers(pool, odd, None)
        [key] = w.keys(1)
        [reset] = w.run("reset", [Item(key, 0, ({}, 0))])
    huge, opaque, surrogate = (m["content"] for m in o.value.messages)
    assert o.value.errors[0].startswith("huge: ValueError: the result of huge is no text: ValueError: Exceeds")
    assert o.value.errors[1] == "opaque: ValueError: the result of opaque is no text: RuntimeError: no text here"
    assert huge.startswith("{'error': 'the result of huge is no text") and "no text here" in opaque
    assert surrogate == "half ? a pair" and len(o.value.errors) == 2  # the model sees the rest of the text
    assert reset.value[0] == [{"role": "user", "content": "reset ?"}]
    tokenizer = AutoTokenizer.from_pretrained(chat_model(tmp_path))
    tokenizer.apply_chat_template([{"role": "user", "content": surrogate}], tokenize=True)  # the tokenizer takes it


FLOOD = '''
def flood(n: int) -> str:
    """n bytes of text.

    Args:
        n: how many
    """
    return "word " * (n // 5)
'''


def chat_model(tmp_path) -> str:
    folder = tmp_path / "model"
    if not folder.exists():
        build_chat_model(str(folder), ["What is 2 * 3 ? 6", "word word word"], vocab_size=300,
                         chat_template=TOOLS_CHAT_TEMPLATE)  # fmt: skip
    return str(folder)


def peak_rss_growth(run) -> int:
    """Bytes the peak RSS of this process grew past its RSS as `run()` started (Linux: clear_refs resets the peak)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

    def kb(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field))

    before = kb("VmRSS:")
    run()
    return (kb("VmHWM:") - before) * 1024


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS reset needs Linux /proc")
def test_a_40_mb_answer_leaves_the_stage_s_memory_flat_and_is_never_tokenized_past_the_budget(tmp_path):
    """A tool answers 40 MB to a turn of an episode with 100 tokens of budget left: its worker cuts it to
    rollout.max_observation_bytes, the stage sees that much, counts the cut, and ends the episode (budget) without
    rendering or tokenizing text its budget cannot hold; the stage's peak RSS grows by less than 20 MB (the answer
    itself, in the stage, would be 80 MB: its pickle and its text). A small answer to the same turn is appended."""
    path = tmp_path / "flood.py"
    path.write_text(FLOOD)
    folder = chat_model(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    source = Source(kind="tools", tools=(f"{path}:flood",), tool_files=(str(path),), max_observation_bytes=65536)
    with RewardPool(1) as pool:
        loop = Loop(None, tokenizer, (tokenizer.convert_tokens_to_ids("<|im_end|>"),), Workers(pool, source, None),
                    Limits(max_turns=4, max_tokens=120, context=4096, tool_timeout_s=30.0))  # fmt: skip
        question = [{"role": "user", "content": "What is 2 * 3 ?"}]

        def turn_asking(n: int):
            """An episode whose first turn (its sampled ids given here: the test forces the call) asks flood(n)."""
            [[e]] = loop.open([Start(0, question, {"prompt": "What is 2 * 3 ?"})], 1, 0)
            ids = tokenizer.encode("<tool_call>\n{}\n</tool_call><|im_end|>")
            e.append(ids, True, [0.0] * len(ids), loop.policy)
            e.messages.append({"role": "assistant", "content": ""})
            e.turns.append(Turn(0, len(ids), "", "stop", [ToolCall("flood", {"n": n})]))
            return e

        small = turn_asking(50)
        assert loop._answer([small]) == [small] and small.turns[0].appended > 0 and loop.cut == 0
        flooded = turn_asking(40_000_000)
        growth = peak_rss_growth(lambda: loop._answer([flooded]))
        loop.finish([small, flooded])
    assert growth < 20 * 2**20, f"the stage's peak RSS grew {growth / 2**20:.1f} MB"
    t = flooded.turns[0]
    assert flooded.end == "budget" and t.appended == 0 and loop.cut == 1  # counted once
    assert len(t.observation.encode()) == 65536 and len(flooded.response_ids) == t.end  # nothing appended


SLOW = """
import os
import time

if os.environ.get("SLOW_IMPORT"):
    time.sleep(60)  # module-level code that hangs: no alarm is set while a worker builds the environment


class Slow:
    def reset(self, **row):
        time.sleep(60)
"""


def test_building_an_environment_and_its_reset_are_bounded_by_the_tool_timeout_and_named(tmp_path, monkeypatch):
    """A class whose module hangs as it imports, and one whose reset hangs: each is killed past rollout.tool_timeout_s
    (they had 300 s, whatever the setting), and the stage's one line names a tool worker."""
    path = tmp_path / "slow.py"
    path.write_text(SLOW)
    source = Source(kind="environment", environment=f"{path}:Slow", environment_file=str(path), timeout_s=0.5)
    tokenizer = AutoTokenizer.from_pretrained(chat_model(tmp_path))
    with RewardPool(1, role="tool") as pool:
        monkeypatch.setenv("SLOW_IMPORT", "1")
        pool.replace(pool.workers[0])  # a worker forked with it set
        [out] = Workers(pool, source, None).run("reset", [Item(("x", 0), 0, ({}, 0), 0.5)])
        monkeypatch.delenv("SLOW_IMPORT")
        pool.replace(pool.workers[0])
        loop = Loop(None, tokenizer, (0,), Workers(pool, source, None), Limits(4, 120, 4096, tool_timeout_s=0.5))
        with pytest.raises(EnvironmentFailure) as failure:
            loop.open([Start(0, [{"role": "user", "content": "hi"}], {})], 1, 0)
    assert (
        "building the environment (its code imported, its tools described) ran past 0.5s (its limit by "
        "rollout.tool_timeout_s); its tool worker was killed"
    ) in out.lost
    assert str(failure.value).endswith(
        "failed in reset of the episode prompt_id 0 sample 0: reset ran past 0.5s (its limit by "
        "rollout.tool_timeout_s); its tool worker was killed"
    )


def test_tool_workers_past_the_episodes_or_cores_are_refused_at_init():
    """rollout.tool_workers=100000 passed init (reward.workers was capped already)."""
    from grpo.config import ConfigError, load_config
    from stages.init import check_reward_workers, usable_cores

    tools = ["rollout.tools=[m:f]", "rollout.prompts_per_iteration=4", "rollout.group_size=4",
             "learn.minibatch_size=16", "learn.microbatch_size=16", "reward.workers=1"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"^rollout.tool_workers=100000 is more than the 16 episodes"):
        load_config(None, [*tools, "rollout.tool_workers=100000"])
    cores = usable_cores()
    if cores < 16:
        with pytest.raises(ConfigError, match=rf"^rollout.tool_workers=16 is more than the {cores} CPU core"):
            check_reward_workers(load_config(None, [*tools, "rollout.tool_workers=16"]))
    check_reward_workers(load_config(None, [*tools, "rollout.tool_workers=1"]))


def test_a_spec_naming_a_path_that_is_no_python_file_names_it():
    """`../../etc/passwd:x` was taken for a module name, and the message spoke of relative imports."""
    said = check(Source(kind="tools", tools=("../../etc/passwd:x",)), None)
    assert said.startswith("rollout.tools: '../../etc/passwd:x' names '../../etc/passwd', neither a .py file nor")
    assert "\n" not in said and "relative import" not in said


FRAGILE = """
import os
import random


class Fragile:
    def reset(self, **row):
        self.said = []

    def echo(self, text: str) -> str:
        \"\"\"Say it back, with a draw from the generator the worker seeds for the turn.

        Args:
            text: what to say
        \"\"\"
        self.said.append(text)
        return f"{' '.join(self.said)} {random.random():.6f}"

    def die(self) -> str:
        \"\"\"End the worker.\"\"\"
        os._exit(3)
"""


def test_an_episode_lost_with_a_worker_another_s_call_killed_is_re_created_and_goes_on(tmp_path):
    """Two episodes in one worker; a turn where one calls a tool that kills the worker: that one is lost (its call
    did it), the other was lost with it, and trained as `lost` (8 of 16 each time). Now it is re-created on a fresh
    worker by replaying its answered turns, its turn answered as it would have been, counted; it goes on."""
    path = tmp_path / "fragile.py"
    path.write_text(FRAGILE)
    source = Source(kind="environment", environment=f"{path}:Fragile", environment_file=str(path), timeout_s=5.0)
    tokenizer = AutoTokenizer.from_pretrained(chat_model(tmp_path))
    ids = tokenizer.encode("<tool_call>\n{}\n</tool_call><|im_end|>")

    def asks(e, call: ToolCall) -> None:
        """The episode's next turn (its sampled ids given here: the test forces the call) asks `call`."""
        start = len(e.response_ids)
        e.append(ids, True, [0.0] * len(ids), (-1, ""))  # the policy: none here
        e.messages.append({"role": "assistant", "content": ""})
        e.turns.append(Turn(start, len(e.response_ids), "", "stop", [call]))

    with RewardPool(1, role="tool") as pool:  # one worker: both episodes live in it
        loop = Loop(None, tokenizer, (tokenizer.convert_tokens_to_ids("<|im_end|>"),), Workers(pool, source, None),
                    Limits(max_turns=4, max_tokens=1000, context=4096, tool_timeout_s=5.0))  # fmt: skip
        [[a, b]] = loop.open([Start(0, [{"role": "user", "content": "hi"}], {})], 2, 0)
        for e in (a, b):
            asks(e, ToolCall("echo", {"text": "one"}))
        assert loop._answer([a, b]) == [a, b]
        asks(a, ToolCall("die", {}))
        asks(b, ToolCall("echo", {"text": "two"}))
        going = loop._answer([a, b])
        loop.finish([a, b])
    assert a.end == "lost" and "its tool worker died (exit code 3)" in a.turns[1].errors[0]
    assert going == [b] and b.end is None and loop.rerun == 1 and not b.turns[1].errors
    said = b.turns[1].reply[0]["content"]
    assert said.startswith("one two ") and b.turns[1].appended > 0  # its environment went on from its first turn
