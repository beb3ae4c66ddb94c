"""Partial rollouts of episodes (issue 42 with issue 41): with rollout.segment_tokens B and tools, an iteration samples
at most B tokens of each episode, a turn cut there is continued by the next round or iteration from exactly its ids,
and an episode's environment is re-created in the next iteration's stage by replaying its answered turns. Every
released episode is still the tokens the sampler was given and gave, each sampled token by the policy of the iteration
that sampled it; an environment that answers otherwise on replay fails the stage in one line; a run killed with
episodes carried resumes to the bytes of a run never stopped.

The world (tests/tool_world.py) is the episode tests': a Qwen2 model warm-started to call a calculator tool.
"""

import importlib.util
import json
from collections import Counter

import pandas as pd
import pytest
from kill_points import kill_iterations_at
from test_episodes import check_token_in_token_out, schemas
from test_segments import Spy, cold, committed, committed_files, table
from tool_world import config, world

from flows.cli import main
from grpo.config import load_config
from grpo.errors import StageError
from grpo.record.layout import stage_dir
from grpo.record.lineage import policy_version
from grpo.record.storage import committed_attempts, list_attempts, open_storage
from grpo.sampling.engines import close_generators
from stages.init import init_run
from stages.iteration import run_iteration
from stages.rollouts import rollouts
from stages.snapshot import snapshot

pytestmark = [pytest.mark.e2e, pytest.mark.precision_pinned]  # the learner pins float32
B, N, ITERATIONS = 8, 4, 3
SEGMENTED = [
    f"rollout.segment_tokens={B}",
    "rollout.chunk_prompts=2",  # two sampler calls a round: the kill below lands between them
    "learn.minibatch_size=4",  # a group a minibatch: an iteration releases what is complete, carries the rest
    "learn.microbatch_size=4",
    "learn.mixed_precision=no",
    "eval.every=100",  # with last=False no eval runs: every tool call that runs is a rollouts' (counted below)
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return world(tmp_path_factory.mktemp("tools"))


@pytest.fixture(scope="module")
def run(root, tmp_path_factory):
    """A segmented run of episodes, 3 iterations, every sampler call seen; its storage, the calls and the file where
    every tool call that ran wrote its arguments."""
    mp, log = pytest.MonkeyPatch(), tmp_path_factory.mktemp("log") / "calls.log"
    mp.setenv("TOOL_LOG", str(log))
    spy = Spy(mp)
    storage = open_storage((tmp_path_factory.mktemp("seg") / "store").as_uri())
    init_run(storage, "e", load_config(None, config(root, *SEGMENTED)))
    cold()
    for k in range(ITERATIONS):
        spy.iteration = k
        run_iteration(storage, "e", k, last=False)
    mp.undo()
    return storage, spy, log


def tables(storage, k: int, run_id: str = "e") -> dict[str, pd.DataFrame]:
    return {t: table(storage, run_id, k, t) for t in ("rollouts", "turns", "episodes", "carried")}


def walk(storage, run_id: str, root, spy: Spy, iterations: int, staleness: int = 0) -> tuple[int, int]:
    """Each released episode, walked from the iteration its group started to the one that released it: every run of
    sampled ids is what one sampler call gave (at most B) for the context prompt + the ids before, in the iteration
    whose policy version each of those ids records; between turns, the template's render of the stored tool messages
    (mask 0); an episode's turns, conversation and end as without segments. Returns (the sampler calls that continued
    an episode of an earlier iteration, the turns that took more than one call)."""
    tools = schemas(f"{root / 'tools.py'}:multiply")
    crossed = cut_turns = 0
    for k in range(iterations):
        t = tables(storage, k, run_id)
        assert len(t["rollouts"]) and (t["rollouts"].iteration == k).all()
        check_token_in_token_out(t, str(root / "model"), None, tools)
        turns = t["turns"].set_index(["prompt_id", "sample_index", "turn"])
        for row in t["rollouts"].itertuples():
            ids, mask, logps = list(row.response_ids), list(row.loss_mask), list(row.sampler_logprobs)
            versions, at, j, calls = list(row.token_versions), 0, row.prompt_id // N, []
            while at < len(ids):
                if not mask[at]:  # appended between turns: checked above
                    at += 1
                    continue
                context = tuple(list(row.prompt_ids) + ids[:at])
                while not spy.has(j, context, ids[at:]):
                    j += 1
                    assert j <= k, f"no sampler call of iterations {row.prompt_id // N}..{k} gave these ids"
                got, their_logps = spy.take(j, context, ids[at:])
                assert 0 < len(got) <= B and mask[at : at + len(got)] == [1] * len(got)
                assert logps[at : at + len(got)] == pytest.approx(their_logps, abs=1e-6)
                assert versions[at : at + len(got)] == [policy_version(j, staleness)] * len(got)
                calls.append(at)
                at += len(got)
                crossed += j > row.prompt_id // N
            mine = turns.loc[(row.prompt_id, row.sample_index)]
            assert list(mine.policy_version) == [versions[end - 1] for end in mine.token_end]
            cut_turns += sum(sum(s <= c < e for c in calls) > 1 for s, e in zip(mine.token_start, mine.token_end))
    return crossed, cut_turns


def test_every_released_episode_is_its_segments_token_in_token_out_each_token_by_its_iteration(root, run):
    """walk: every token of every released episode is what a sampler call of its iteration gave, by its policy. The
    episodes whose sampled tokens carry two policy versions or more crossed iterations: the walk found a sampler call
    of a later iteration for each (how many there are is the sampling's on this CPU; 6 on one AMD EPYC: the count is
    read from the record, never assumed)."""
    storage, spy, _ = run
    crossed, cut_turns = walk(storage, "e", root, spy, ITERATIONS)
    rows = pd.concat([tables(storage, k)["rollouts"] for k in range(ITERATIONS)])
    spans = [
        len({v for v, m in zip(versions, mask) if m}) for versions, mask in zip(rows.token_versions, rows.loss_mask)
    ]
    assert crossed >= sum(n - 1 for n in spans) > 0 and cut_turns > 0  # episodes crossed, turns were cut and continued


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_continues_cut_turns_and_carried_episodes_from_their_ids_and_a_rerun_the_same_bytes(root, tmp_path):
    """With vLLM (staleness 1: iteration 1 samples the base policy, no learn needed), rounds and iterations continue
    episodes from their ids as with transformers' sampler, and a rerun of rollouts 1 commits the same bytes."""
    from grpo.sampling.vllm_engine import VLLMGenerator

    mp = pytest.MonkeyPatch()
    spy = Spy(mp, VLLMGenerator)
    storage = open_storage((tmp_path / "store").as_uri())
    init_run(storage, "v", load_config(None, config(root, *SEGMENTED, "rollout.backend=vllm", "rollout.staleness=1")))
    try:
        for k in range(2):
            spy.iteration = k
            snapshot(storage, "v", k)
            first = rollouts(storage, "v", k)
        crossed, cut_turns = walk(storage, "v", root, spy, 2, staleness=1)
        again = rollouts(storage, "v", 1, force=True)
    finally:
        mp.undo()
        close_generators()
    assert crossed > 0 and cut_turns > 0
    assert sorted((f.path, f.sha256) for f in again.manifest.files) == sorted(
        (f.path, f.sha256) for f in first.manifest.files
    )


def ran(turns) -> Counter:
    """The multiply calls of `turns` (the turns table's rows, or a carried episode's turns) that reach the function."""
    calls = [(n, json.loads(a) if isinstance(a, str) else a) for t in turns for n, a in zip(*t)]
    return Counter(f"{c['a']} {c['b']}" for n, c in calls if n == "multiply" and set(c) == {"a", "b"})


def test_each_carried_episode_is_continued_from_its_ids_and_its_environment_replayed(run):
    """What iteration k carries, iteration k + 1 continues from exactly its ids (a turn cut by B left open); its
    environment is re-created by replay: each call a carried episode's turns made runs once more per iteration it is
    carried into, and no other call runs twice."""
    storage, spy, log = run
    first = Counter()  # every turn once: in the turns table that released it, or in the last carried table
    for k in range(ITERATIONS):
        t = tables(storage, k)["turns"]
        first += ran(zip(t.tool_names, t.tool_arguments))
    replayed, opened = Counter(), 0
    for k in range(ITERATIONS):
        carried = tables(storage, k)["carried"]
        episodes = [json.loads(e) for e in carried.episode]
        going = [(row, e) for row, e in zip(carried.itertuples(), episodes) if e["end"] is None]
        assert len(going) and all(pd.isna(row.finish_reason) for row, _ in going)
        turns = [([c["name"] for c in t["calls"]], [c["arguments"] for c in t["calls"]]) for _, e in going
                 for t in e["turns"]]  # fmt: skip
        if k == ITERATIONS - 1:
            ended = [([c["name"] for c in t["calls"]], [c["arguments"] for c in t["calls"]]) for e in episodes
                     if e["end"] is not None for t in e["turns"]]  # fmt: skip
            first += ran(turns) + ran(ended)
            continue
        replayed += ran(turns)
        for row, e in going:
            assert len(e["turns"]) <= 3 and tuple(list(row.prompt_ids) + list(row.response_ids)) in spy.calls[k + 1]
            opened += e["open"] is not None
    assert Counter(log.read_text().splitlines()) == first + replayed and sum(replayed.values()) > 0
    for k in range(1, ITERATIONS):  # the summary counts what was re-created
        summary = committed(storage, "e", k, "rollouts").manifest.summary
        carried = table(storage, "e", k - 1, "carried")
        assert summary["episodes_replayed"] == carried.finish_reason.isna().sum() > 0 and summary["replay_s"] > 0
    assert opened > 0  # turns cut in the middle were carried


def test_an_environment_that_answers_otherwise_on_replay_fails_in_one_line(root, tmp_path, monkeypatch):
    """A tool with an effect outside its episode (its answers count the calls before it, in a file) answers a replayed
    call otherwise: iteration 1's rollouts fail in one line naming the environment, the episode and what to do, and
    commit nothing."""
    monkeypatch.setenv("TOOL_LOG", str(tmp_path / "calls.log"))
    counted = tmp_path / "counted.py"
    counted.write_text(
        (root / "tools.py")
        .read_text()
        .replace("    return a * b\n", "    return a * b + len(open(os.environ['TOOL_LOG']).read().splitlines())\n")
    )
    storage = open_storage((tmp_path / "store").as_uri())
    init_run(storage, "c", load_config(None, config(root, *SEGMENTED, f"rollout.tools=[{counted}:multiply]")))
    cold()
    run_iteration(storage, "c", 0, last=False)
    carried = table(storage, "c", 0, "carried")
    answered = [t for e in carried.episode.dropna() if json.loads(e)["end"] is None for t in json.loads(e)["turns"]]
    assert any(t["observation"] and not t["errors"] for t in answered)  # a call that ran is replayed
    with pytest.raises(StageError) as failed:
        run_iteration(storage, "c", 1, last=False)
    said = str(failed.value)
    assert "\n" not in said and said.startswith("environment ") and "multiply: replayed to continue the episode" in said
    assert "otherwise than recorded" in said and "unset rollout.segment_tokens" in said
    assert not committed_attempts(storage, stage_dir(storage, "c", 1, "rollouts"))


def test_a_run_killed_with_episodes_carried_resumes_to_the_same_bytes_and_rewards_read_them(root, run, tmp_path):
    """SIGKILL in iteration 1's rollouts, its carried episodes' environments replayed and one sampler call into the
    round: resumed in a new process, every file of iterations 0 and 1 has the bytes of the run never stopped."""
    whole, _, _ = run
    for k in range(2):  # the rewards scored what was released, with the episodes' conversations
        scored = table(whole, "e", k, "rollouts").merge(
            pd.read_parquet(whole.uri(committed(whole, "e", k, "rewards").path("rewards.parquet"))),
            on=["prompt_id", "sample_index"],
        )
        assert len(scored) == len(table(whole, "e", k, "rollouts")) and scored.error.isna().all()
    killed = open_storage((tmp_path / "killed").as_uri())
    init_run(killed, "e", load_config(None, config(root, *SEGMENTED)))
    kill_iterations_at("segments:1", killed.url, "e", 2, tmp_path, last=False)
    attempts = stage_dir(killed, "e", 1, "rollouts")
    assert list_attempts(killed, attempts) and not committed_attempts(killed, attempts)
    cold()
    run_iteration(killed, "e", 1, last=False)
    assert committed_files(killed, "e", 2) == committed_files(whole, "e", 2)


def test_a_fork_replays_its_parents_carried_episodes_and_goes_on_with_its_own_policy(run):
    """Forked at 2 with another learning rate: the fork's rollouts 3 re-create the environments of the episodes the
    parent's rollouts 2 carried (replayed with their own seeds: the same answers) and continue each from its ids."""
    storage, _, _ = run
    fork = ["fork", "--from", "e", "--at", "2", "--run", "f", "--set", "learn.lr=3e-3"]
    assert main(["--storage", storage.url, *fork]) == 0
    cold()
    for k in (2, 3):
        run_iteration(storage, "f", k, last=False)
    parent = table(storage, "e", 2, "carried")
    mine = table(storage, "f", 3, "segments").set_index(["prompt_id", "sample_index"])
    going = parent[parent.finish_reason.isna()]
    assert len(going)
    for row in going.itertuples():
        assert mine.loc[(row.prompt_id, row.sample_index)].tokens_before == len(row.response_ids)
    assert table(storage, "f", 3, "rollouts").token_versions.map(lambda v: 2 in list(v)).any()  # the fork's learn 2


def test_a_rescore_scores_the_released_episodes_as_committed_and_runs_no_tool(root, run, monkeypatch):
    """grpo rescore of 0..1 with a reward that counts an episode's tool results scores each iteration's released
    episodes from their stored conversations: the rows the learns took, each its own count, and not one tool call."""
    storage, _, log = run
    before = log.read_text()
    monkeypatch.setenv("TOOL_LOG", str(log))
    counted = f"reward.functions=[{root / 'rewards.py'}:tool_turns]"
    rescore = ["rescore", "--run", "e", "--iterations", "0:1", "--set", counted, "--as", "x"]
    assert main(["--storage", storage.url, *rescore]) == 0
    assert log.read_text() == before
    for k in range(2):
        scored = pd.read_parquet(storage.uri(committed(storage, "x", k, "rewards").path("rewards.parquet")))
        episodes = table(storage, "e", k, "episodes")
        tools = {(e.prompt_id, e.sample_index): sum(m["role"] == "tool" for m in json.loads(e.messages))
                 for e in episodes.itertuples()}  # fmt: skip
        assert {(s.prompt_id, s.sample_index): s.reward for s in scored.itertuples()} == tools
    assert sum(tools.values()) > 0


def test_a_row_json_cannot_hold_as_it_is_is_refused_in_one_line_before_it_is_carried():
    """A carried episode's environment is reset again from its stored row: a date would come back a string."""
    import datetime

    from grpo.episodes import carry
    from grpo.episodes.records import Episode

    plain = Episode(3, 0, (), row={"question": "2 x 3?", "answer": "6", "tags": ["x"], "n": 2})
    assert carry.loads(carry.dumps(plain), Episode(3, 0, None)).row == plain.row
    dated = Episode(3, 0, (), row={"question": "2 x 3?", "asked": datetime.date(2026, 12, 6)})
    with pytest.raises(StageError, match=r"prompt_id 3 has columns JSON does not hold as they are \(asked\)") as e:
        carry.dumps(dated)
    assert "\n" not in str(e.value) and "unset rollout.segment_tokens" in str(e.value)


def test_a_trl_environment_class_s_final_state_waits_with_its_episode_and_reaches_the_rewards(root, tmp_path):
    """With TRL's environment_factory class, an episode that ends while its group waits keeps the final state its
    environment gave when it ended (carried with it): every released episode has one, and the rewards read it."""
    storage = open_storage((tmp_path / "store").as_uri())
    overrides = config(
        root,
        *SEGMENTED,
        f"rollout.environment={root / 'calculator_env.py'}:Calculator",
        "rollout.tools=[]",
        f"reward.functions=[{root / 'rewards.py'}:calculator]",
    )
    init_run(storage, "t", load_config(None, overrides))
    cold()
    waited = 0
    for k in range(3):
        run_iteration(storage, "t", k, last=False)
        episodes, segments = table(storage, "t", k, "episodes"), table(storage, "t", k, "segments")
        assert episodes.environment.notna().all()
        states = [json.loads(s) for s in episodes.environment]
        scored = pd.read_parquet(storage.uri(committed(storage, "t", k, "rewards").path("rewards.parquet")))
        assert list(scored.components.map(lambda c: dict(c)["environment"])) == [s["get_reward"] for s in states]
        released = segments[segments.state == "released"]
        waited += (released.tokens_before == released.tokens).sum()  # ended in an earlier iteration, then waited
    assert waited > 0
