"""Episodes (issue 41): a tiny chat model warm-started to call a calculator tool samples multi-turn episodes, the tools
running in worker processes; every committed episode is the tokens the sampler was given and gave, in order, with a
loss mask of 1 exactly on the sampled ones; the turns and episodes tables say what happened; TRL's environment_factory
class runs unchanged; a rerun commits the same bytes.

The world (tests/tool_world.py) is built once for the module: a Qwen2 model with Qwen2.5's own tool template.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from kill_points import kill_iterations_at
from tool_world import config, world
from transformers import AutoTokenizer

from flows.cli import main
from grpo.config import load_config
from grpo.episodes import templates
from grpo.episodes.chat import observation_tokens, prompt_tokens, with_reset
from grpo.errors import StageError
from grpo.query import query
from grpo.record.layout import STAGES, stage_dir
from grpo.record.storage import committed_attempts, latest_committed, list_attempts, open_storage
from grpo.report import iteration_rows, shown_plots
from grpo.sampling.base import stop_token_ids
from grpo.sampling.engines import close_generators
from grpo.sampling.hf import HFGenerator
from stages import learn
from stages.init import init_run
from stages.iteration import run_iteration
from stages.rewards import rewards
from stages.rollouts import rollouts
from stages.snapshot import snapshot

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return world(tmp_path_factory.mktemp("tools"))


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


def tables(storage, committed) -> dict[str, pd.DataFrame]:
    return {t: pd.read_parquet(storage.uri(committed.path(f"{t}.parquet"))) for t in ("rollouts", "turns", "episodes")}


class Spy:
    """Every sampler call of the stage, as the sampler saw it: {context ids: [(sampled ids, their log-probs), ...]}
    (the G episodes of a prompt share their first turn's context)."""

    def __init__(self, monkeypatch, cls=HFGenerator):
        self.calls: dict[tuple, list] = {}
        generate = cls.generate

        def spied(gen, prompts, spec, budgets=None, progress=None, seeds=None):
            out = generate(gen, prompts, spec, budgets, progress, seeds)
            for context, [sample] in zip(prompts, out):
                self.calls.setdefault(tuple(context), []).append((list(sample.response_ids), list(sample.logprobs)))
            return out

        monkeypatch.setattr(cls, "generate", spied)

    def take(self, context: tuple, sampled: list[int]) -> list[float]:
        """The log-probs the sampler gave with `sampled` for `context`; that call is used up."""
        given = self.calls.get(context, [])
        at = next((i for i, (ids, _) in enumerate(given) if ids == sampled), None)
        assert at is not None, "the sampler never gave these ids for this context"
        return given.pop(at)[1]


def schemas(*specs: str) -> list[dict]:
    from transformers.utils import get_json_schema

    from grpo.tasks.functions import load_object

    return [get_json_schema(load_object(s)) for s in specs]


def check_token_in_token_out(
    t: dict[str, pd.DataFrame], model_dir: str, spy: Spy | None, tools: list[dict], reset: str = ""
) -> None:
    """On every episode: the prompt is the template's render of the question with the tools; each turn's sampled ids
    are what the sampler gave for the context prompt + the response so far, with their log-probs and mask 1 (None:
    the caller checks the sampled ids, which several calls may have given); what lies between turns is the
    template's render of the tool messages the episode stored, mask 0, log-prob 0.0."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    eos = stop_token_ids(tok, model_dir)
    turns = t["turns"].groupby(["prompt_id", "sample_index"])
    episodes = t["episodes"].set_index(["prompt_id", "sample_index"])
    assert len(t["rollouts"]) == len(episodes) > 0
    for row in t["rollouts"].itertuples():
        ids, mask, logps = list(row.response_ids), list(row.loss_mask), list(row.sampler_logprobs)
        assert len(ids) == len(mask) == len(logps) <= 120 and set(mask) <= {0, 1}
        asked = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", row.prompt, re.S).group(1)
        question = templates.chat_messages(asked.removesuffix(reset), None)
        messages = with_reset(question, [{"role": "user", "content": reset}] if reset else [])
        assert (row.prompt, list(row.prompt_ids)) == prompt_tokens(tok, messages, tools)
        ep, mine = episodes.loc[(row.prompt_id, row.sample_index)], turns.get_group((row.prompt_id, row.sample_index))
        conversation = json.loads(ep.messages)
        history, at = list(messages), 0
        for k, turn in enumerate(mine.sort_values("turn").itertuples()):
            start, end = turn.token_start, turn.token_end
            assert turn.turn == k and start == at
            context = tuple(list(row.prompt_ids) + ids[:start])
            sampled = [int(i) for i in ids[start:end]]
            if spy is not None:
                assert logps[start:end] == pytest.approx(spy.take(context, sampled))  # token in, token out
            assert mask[start:end] == [1] * len(sampled)  # token out: exactly what it gave, trained on
            history.append(conversation.pop(0))  # the assistant turn, parsed
            at = end + turn.observation_tokens
            assert mask[end:at] == [0] * turn.observation_tokens and logps[end:at] == [0.0] * (at - end)
            if turn.observation_tokens:
                new = [conversation.pop(0) for _ in range(len(turn.tool_names))]
                ended = tok.decode(sampled[-1:]) if sampled[-1] in eos else None
                turn_ends = [tok.decode([i]) for i in eos]
                text, obs = observation_tokens(tok, history, new, tools, ended, turn_ends)
                assert ids[end:at] == obs and text.endswith("<|im_start|>assistant\n")
                assert all(f"<tool_response>\n{m['content']}\n</tool_response>" in text for m in new)
                history += new
        assert at == len(ids) and not conversation  # nothing else was appended
        assert ep.turns == len(mine) <= 3
        assert (row.finish_reason == "length") == (ep.ended_by == "budget")
    assert spy is None or not any(spy.calls.values())  # and every sampler call is some episode's turn


def test_every_episode_is_the_tokens_the_sampler_gave_and_was_given(root, storage, monkeypatch, tmp_path):
    monkeypatch.setenv("TOOL_LOG", str(tmp_path / "calls.log"))
    spy = Spy(monkeypatch)
    init_run(storage, "r", load_config(None, config(root)))
    snapshot(storage, "r", 0)
    ro = rollouts(storage, "r", 0)
    t = tables(storage, ro)
    check_token_in_token_out(t, str(root / "model"), spy, schemas(f"{root / 'tools.py'}:multiply"))
    summary = ro.manifest.summary
    assert summary["tool_calls"] == t["turns"].tool_names.map(len).sum() > 0
    assert summary["tool_errors"] == t["turns"].tool_errors.sum() > 0  # the warm-started model botches some calls
    assert summary["turns_per_episode"] == pytest.approx(t["episodes"].turns.mean())
    ran = (tmp_path / "calls.log").read_text().splitlines()
    calls = [
        (n, json.loads(a))
        for names, args in zip(t["turns"].tool_names, t["turns"].tool_arguments)
        for n, a in zip(names, args)
    ]
    good = [f"{c['a']} {c['b']}" for n, c in calls if n == "multiply" and set(c) == {"a", "b"}]
    assert sorted(ran) == sorted(good) and ran  # every call that reached multiply ran once, in a worker
    for turn in t["turns"].itertuples():  # multiply sleeps 30 s on a 13: interrupted, the episode goes on
        thirteen = any(13 in json.loads(a).values() for a in turn.tool_arguments)
        error = turn.error if isinstance(turn.error, str) else ""
        assert thirteen == ("multiply: timed out after 1s" in error), turn


def test_a_rerun_commits_the_same_bytes(root, storage):
    init_run(storage, "r", load_config(None, config(root)))
    snapshot(storage, "r", 0)
    first = rollouts(storage, "r", 0)
    close_generators()
    again = rollouts(storage, "r", 0, force=True)
    assert again.attempt_dir != first.attempt_dir
    assert sorted((f.path, f.sha256) for f in again.manifest.files) == sorted(
        (f.path, f.sha256) for f in first.manifest.files
    )


def test_a_trl_environment_class_runs_unchanged(root, storage, monkeypatch):
    """The class file is the one a TRL user passes as environment_factory: reset(**row)'s string joins the question,
    its public method is the tool, get_reward a reward of its own; rewards see its final state."""
    spy = Spy(monkeypatch)
    overrides = config(
        root,
        f"rollout.environment={root / 'calculator_env.py'}:Calculator",
        "rollout.tools=[]",
        f"reward.functions=[{root / 'rewards.py'}:calculator]",
    )
    init_run(storage, "r", load_config(None, overrides))
    snapshot(storage, "r", 0)
    ro = rollouts(storage, "r", 0)
    t = tables(storage, ro)
    from transformers.utils import get_json_schema

    from grpo.tasks.functions import load_object

    tools = [get_json_schema(load_object(f"{root / 'calculator_env.py'}:Calculator")().multiply)]
    check_token_in_token_out(t, str(root / "model"), spy, tools, reset=" Use the calculator.")
    states = [json.loads(s) for s in t["episodes"].environment]
    answers = [int(a) for a in t["rollouts"].ground_truth]
    assert all(s["answer"] == a and s["get_reward"] == float(a in s["products"]) for s, a in zip(states, answers))
    rw = rewards(storage, "r", 0)
    scored = pd.read_parquet(storage.uri(rw.path("rewards.parquet")))
    for s, comps, reward in zip(states, scored.components, scored.reward):
        comps = dict(comps)
        assert comps["environment"] == s["get_reward"] and reward == s["get_reward"] + comps["calculator"]
    assert any(s["products"] for s in states)


RESUMED = ["learn.mixed_precision=no", "rollout.chunk_prompts=2"]  # two chunks: the kill lands in the first


def committed_files(storage, run_id: str, iterations: int) -> dict:
    """{(iteration, stage): [(file, sha256)]} of the newest committed attempt of every stage."""
    return {
        (k, s): sorted(
            (f.path, f.sha256) for f in latest_committed(storage, stage_dir(storage, run_id, k, s)).manifest.files
        )
        for k in range(iterations)
        for s in STAGES
    }


def test_a_run_killed_with_its_episodes_half_done_resumes_to_the_same_bytes_and_rescores_without_tools(
    root, tmp_path, monkeypatch
):
    """SIGKILL in iteration 1's rollouts, every episode of its first chunk answered once and none sampled on: the run
    resumed commits every file of iterations 0 and 1 with the bytes of a run never stopped (the environments seeded
    per episode and turn from the run's seed). Then `grpo rescore` scores the stored episodes again: no tool runs."""
    whole, killed = (open_storage((tmp_path / name).as_uri()) for name in ("whole", "killed"))
    for storage in (whole, killed):
        rewarded = f"reward.functions=[{root / 'rewards.py'}:answered,{root / 'rewards.py'}:tool_turns]"
        init_run(storage, "r", load_config(None, config(root, *RESUMED, rewarded)))
    monkeypatch.setenv("TOOL_LOG", str(tmp_path / "calls.log"))
    learn.WARM.take(None)
    close_generators()
    for k in range(2):
        run_iteration(whole, "r", k)
    kill_iterations_at("episodes:1", killed.url, "r", 2, tmp_path)
    attempts = stage_dir(killed, "r", 1, "rollouts")
    assert list_attempts(killed, attempts) and not committed_attempts(killed, attempts)  # half done, nothing committed
    learn.WARM.take(None)  # what a new process has
    close_generators()
    run_iteration(killed, "r", 1)
    assert committed_files(killed, "r", 2) == committed_files(whole, "r", 2)

    turns = query(whole, "r", "SELECT iteration, count(*) AS n, sum(tool_errors) AS e FROM turns GROUP BY 1 ORDER BY 1")
    rows = iteration_rows(whole, "r")  # what `grpo report` draws
    assert [(r["turns_per_episode"] * 16, r["tool_errors"]) for r in rows] == list(zip(turns.n, turns.e))
    assert {"turns per episode", "tool calls and tool errors"} <= {name for name, _ in shown_plots(rows)}
    ev = latest_committed(whole, stage_dir(whole, "r", 1, "eval"))  # greedy episodes on the held-out questions
    assert pd.read_parquet(whole.uri(ev.path("eval.parquet"))).prompt.str.contains("<tools>").all()

    calls = (tmp_path / "calls.log").read_text()
    before = pd.read_parquet(
        whole.uri(latest_committed(whole, stage_dir(whole, "r", 1, "rewards")).path("rewards.parquet"))
    )
    rescore = ["rescore", "--run", "r", "--iterations", "0:1", "--set", "reward.weights=[2.0,2.0]", "--as", "x"]
    assert main(["--storage", whole.url, *rescore]) == 0
    assert (tmp_path / "calls.log").read_text() == calls  # the stored episodes were scored, no tool ran again
    after = pd.read_parquet(
        whole.uri(latest_committed(whole, stage_dir(whole, "x", 1, "rewards")).path("rewards.parquet"))
    )
    assert list(after.reward) == [2 * r for r in before.reward] and before.reward.sum() > 0


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_vllm_episodes_are_the_tokens_it_gave_and_a_rerun_the_same_bytes(root, storage, monkeypatch, prefix_caching):
    """The same invariants with vLLM, each turn seeded per episode; with its prefix cache on (an episode's context
    grows turn by turn: each turn reuses the KV of the last) a rerun still commits the same bytes: the cache starts
    empty in every rollouts stage, so what it reuses depends on the stage's own requests alone."""
    from grpo.sampling.vllm_engine import VLLMGenerator

    spy = Spy(monkeypatch, VLLMGenerator)
    extra = ["rollout.backend=vllm", f"rollout.vllm.enable_prefix_caching={str(prefix_caching).lower()}"]
    init_run(storage, "r", load_config(None, config(root, *extra)))
    snapshot(storage, "r", 0)
    try:
        first = rollouts(storage, "r", 0)
        check_token_in_token_out(
            tables(storage, first), str(root / "model"), spy, schemas(f"{root / 'tools.py'}:multiply")
        )
        assert first.manifest.summary["sampler"]["enable_prefix_caching"] is prefix_caching
        assert first.manifest.summary["tool_calls"] > 0
        again = rollouts(storage, "r", 0, force=True)  # the warm engine, its cache emptied first
    finally:
        close_generators()
    assert sorted((f.path, f.sha256) for f in again.manifest.files) == sorted(
        (f.path, f.sha256) for f in first.manifest.files
    )


def test_an_environment_that_breaks_fails_the_stage_in_one_line_naming_it(root, storage, tmp_path):
    """A class that cannot start its episode (its server gone) is no episode's error: the stage fails, naming the
    environment and the episode, and commits nothing."""
    broken = tmp_path / "broken.py"
    broken.write_text(
        "class Remote:\n    def reset(self, **row):\n        raise ConnectionError('env.example:8000 refused')\n\n"
        "    def multiply(self, a: int, b: int) -> int:\n"
        '        """Multiply.\n\n        Args:\n            a: one\n            b: two\n        """\n'
        "        return a * b\n"
    )
    init_run(storage, "r", load_config(None, config(root, f"rollout.environment={broken}:Remote", "rollout.tools=[]")))
    snapshot(storage, "r", 0)
    with pytest.raises(StageError) as failed:
        rollouts(storage, "r", 0)
    said = str(failed.value)
    assert "\n" not in said and said.startswith(f"environment {broken}:Remote failed in reset of the episode prompt_id")
    assert said.endswith("ConnectionError: env.example:8000 refused")
    assert not committed_attempts(storage, stage_dir(storage, "r", 0, "rollouts"))


TOOL_AT_IMPORT = {  # module-level code of a tools file, run when `grpo init` builds its schemas
    "reads": "import os\nopen(os.environ['SEEN_FILE'], 'w').write(os.environ.get('AWS_SECRET_ACCESS_KEY', 'absent'))\n",
    "exits": "import os\nos._exit(0)\n",
}


@pytest.mark.parametrize("module", ["reads", "exits"])
def test_init_builds_the_tools_in_a_worker_without_credentials_and_an_exit_is_one_line(root, tmp_path, module):
    """grpo init checks rollout.tools where the rollouts stage runs them, a tool worker: module-level code never sees
    the CLI's credentials, and one that exits as it imports fails init in one line, no run made."""
    tools = tmp_path / f"{module}.py"
    tools.write_text(TOOL_AT_IMPORT[module] + "\n\n" + (root / "tools.py").read_text())
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": "s3cr3t-v4lue", "SEEN_FILE": str(tmp_path / "seen")}
    sets = [f"--set={s}" for s in config(root, f"rollout.tools=[{tools}:multiply]")]
    argv = [sys.executable, "-m", "flows.cli", "--storage", str(tmp_path / "store"), "init", "--run", "t", *sets]
    done = subprocess.run(argv, cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    if module == "reads":
        assert done.returncode == 0, done.stderr[-2000:]
        assert (tmp_path / "seen").read_text() == "absent"
    else:
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-2000:]
        assert "rollout.tools: does not build in a tool worker: tool worker died" in done.stderr
        assert "exit code 0" in done.stderr and not (tmp_path / "store" / "runs" / "t").exists()
