"""TRL's reward functions run unchanged (issue 54, item 3): a function with TRL's environment signature gets
`completions` as message lists and `environments` as the episodes' stored final states, whether it declares
`environments` with a default or not; a run that has no environment to give refuses it at `grpo init`, in one line
showing the wrapper, instead of calling it without them."""

import json
import textwrap

import pandas as pd
import pytest
from tool_world import config, world

from flows.cli import main
from grpo.config import ConfigError, load_config
from grpo.record.storage import open_storage
from grpo.tasks.base import FinalState
from grpo.tasks.functions import Scorer
from stages.init import init_run
from stages.rewards import rewards
from stages.rollouts import rollouts
from stages.snapshot import snapshot

TRL_REWARDS = textwrap.dedent('''
    """Reward functions as TRL's docs write them for GRPOTrainer(environment_factory=...)."""


    def reward_func(environments, **kwargs):
        return [float(len(env.products)) for env in environments]


    def knows_the_answer(completions, environments=None, **kwargs):  # a default: it must get them all the same
        if environments is None:
            return [0.0] * len(completions)
        return [float(env.answer == int(g)) for env, g in zip(environments, kwargs["ground_truth"])]


    def conversation(completions, **kwargs):  # completions: each episode's messages after the prompt
        return [float(isinstance(c, list) and all("role" in m for m in c)) for c in completions]
''')


@pytest.fixture
def trl_file(tmp_path):
    path = tmp_path / "trl_rewards.py"
    path.write_text(TRL_REWARDS)
    return path


def test_trl_environment_rewards_get_the_final_states_and_messages(trl_file):
    specs = [f"{trl_file}:{name}" for name in ("reward_func", "knows_the_answer", "conversation")]
    score = Scorer.for_functions(specs, None, [None] * 3)
    messages = [{"role": "assistant", "content": "", "tool_calls": []}, {"role": "tool", "content": "42"}]
    row = {"environment": FinalState({"products": [6, 42], "answer": 42}), "messages": messages, "level": 1}
    out = score("The answer is 42.", "42", "What is 6 times 7?", row)
    assert out["reward_func"] == 2.0 and out["knows_the_answer"] == 1.0 and out["conversation"] == 1.0, out
    row["environment"] = FinalState({"products": [], "answer": 41})
    assert score("41", "42", "q", row)["knows_the_answer"] == 0.0


def test_a_trl_environment_reward_is_never_called_without_environments(trl_file):
    score = Scorer.for_functions([f"{trl_file}:knows_the_answer"], None, [None])
    with pytest.raises(TypeError, match="takes `environments` and this sample has none"):
        score("42", "42", "q", {"environment": None, "messages": []})  # an episode that stored no final state
    with pytest.raises(TypeError, match="takes `environments`"):
        score("42", "42", "q", {})  # a single-turn sample


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return world(tmp_path_factory.mktemp("tools"))


@pytest.mark.e2e
def test_trls_documented_environment_rewards_score_a_run_unchanged(root, trl_file, tmp_path):
    storage = open_storage((tmp_path / "store").as_uri())
    specs = [f"{trl_file}:{n}" for n in ("reward_func", "knows_the_answer", "conversation")]
    specs.append(f"{root / 'calculator_env.py'}:used_the_calculator")  # tool_world's own, TRL's shape
    overrides = config(
        root,
        f"rollout.environment={root / 'calculator_env.py'}:Calculator",
        "rollout.tools=[]",
        f"reward.functions=[{', '.join(specs)}]",
    )
    init_run(storage, "r", load_config(None, overrides))
    snapshot(storage, "r", 0)
    ro = rollouts(storage, "r", 0)
    episodes = pd.read_parquet(storage.uri(ro.path("episodes.parquet")))
    rw = rewards(storage, "r", 0)
    scored = pd.read_parquet(storage.uri(rw.path("rewards.parquet")))
    states = {(p, s): json.loads(e) for p, s, e in zip(episodes.prompt_id, episodes.sample_index, episodes.environment)}
    for p, s, comps, error in zip(scored.prompt_id, scored.sample_index, scored.components, scored.error):
        comps, state = dict(comps), states[p, s]
        assert not isinstance(error, str), error
        assert comps["knows_the_answer"] == 1.0 and comps["conversation"] == 1.0, comps  # got them, in TRL's shape
        assert comps["reward_func"] == len(state["products"])
        assert comps["used_the_calculator"] == float(len(state["products"]) > 0)


@pytest.mark.e2e
def test_a_trl_environment_reward_in_a_run_without_an_environment_is_refused_at_init_showing_the_wrapper(
    root, trl_file, tmp_path, capsys
):
    overrides = config(root, f"reward.functions=[{trl_file}:knows_the_answer]")  # tools, no environment
    storage = open_storage((tmp_path / "store").as_uri())
    with pytest.raises(ConfigError) as refused:
        init_run(storage, "r", load_config(None, overrides))
    line = str(refused.value)
    assert "takes `environments`" in line and "this run has no environment (rollout.environment" in line, line
    assert (
        "`def knows_the_answer_alone(completions, **kw): return knows_the_answer(completions, "
        "environments=[None] * len(completions), **kw)`" in line
    )
    assert not storage.exists(storage.path("runs", "r", "run.json"))
    capsys.readouterr()
    rc = main(["--storage", storage.url, "init", "--run", "r", *[a for s in overrides for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and "knows_the_answer_alone" in err, err
