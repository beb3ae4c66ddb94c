"""Dynamic sampling (DAPO; rollout.min_signal_groups): extra rounds while too few groups have signal, only
groups with signal reach the learner, and a rerun or a resumed run draws and commits the same rows."""

import json

import pytest
import torch
from test_stages import TINY

from grpo.config import ConfigError, load_config
from grpo.data import draw_at
from grpo.query import query
from grpo.record.layout import Salt, iteration_seed, stage_dir
from grpo.record.storage import committed_attempts, latest_committed, open_storage
from grpo.runtime.pool import WARM_POOLS
from grpo.tasks import get_task
from schemas import read_parquet, table_file
from stages import StageError
from stages.advantages import advantages
from stages.init import init_run
from stages.iteration import run_iteration
from stages.learn import learn, load_batch
from stages.prompts import held_out_split
from stages.rewards import rewards
from stages.rollouts import rollouts
from stages.snapshot import snapshot

# constant for 3 prompts in 4 (the first number is not 0 mod 4), else the response's length: most groups
# have no signal, so 8 of 16 needs extra rounds
REWARD = """
def mostly_flat(response, ground_truth, prompt, **row):
    if int(prompt.split()[1]) % 4:
        return 0.5
    return float(len(response))
"""

DYNAMIC = [
    "reward.truncated_reward=null",
    "rollout.min_signal_groups=8",
    "learn.minibatch_size=16",
    "learn.microbatch_size=8",
]


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


def make_run(storage, tmp_path, run_id="d", extra=()):
    (tmp_path / "flat.py").write_text(REWARD)
    cfg = load_config(None, TINY + [f"reward.functions=[{tmp_path / 'flat.py'}:mostly_flat]"] + DYNAMIC + list(extra))
    init_run(storage, run_id, cfg)
    return cfg


def committed(storage, run_id, k, stage):
    return latest_committed(storage, stage_dir(storage, run_id, k, stage))


def table(storage, run_id, k, name, stage=None):
    c = committed(storage, run_id, k, stage or name)
    return read_parquet(storage.fs, c.path(table_file(name)), name).to_pylist()


def test_too_few_groups_with_signal_draw_more_rounds_and_only_signal_groups_train(storage, tmp_path):
    make_run(storage, tmp_path)
    run_iteration(storage, "d", 0)
    ro = committed(storage, "d", 0, "rollouts").manifest.summary
    draws = table(storage, "d", 0, "draws", "rollouts")
    rounds = max(d["round"] for d in draws) + 1
    assert ro["rounds"] == rounds > 1 and ro["prompts_drawn"] == 16 * rounds and ro["draw_end"] == 16 * rounds
    assert ro["samples"] == 4 * len(draws) and ro["signal_groups"] == sum(d["signal"] for d in draws)
    assert ro["signal_groups"] >= 8 or rounds == 3  # enough, or the rounds ran out (max_sampling_rounds=3)
    assert sum(d["signal"] for d in draws if d["round"] < rounds - 1) < 8  # the last round was needed
    assert sorted(d["prompt_id"] for d in draws) == list(range(16 * rounds))  # none skipped: ids in draw order
    assert query(storage, "d", "SELECT count(*) AS n FROM draws WHERE signal")["n"][0] == ro["signal_groups"]
    rows = table(storage, "d", 0, "rollouts")
    following = get_task("sort").generate(32, iteration_seed(0, 0, Salt.PROMPTS))[16:]  # the next ones drawn
    assert [r["prompt"] for r in rows if 16 <= r["prompt_id"] < 32 and r["sample_index"] == 0] == [
        e.prompt for e in following
    ]

    adv = committed(storage, "d", 0, "advantages").manifest.summary
    adv_rows = table(storage, "d", 0, "advantages")
    kept = sorted({r["prompt_id"] for r in adv_rows if r["kept"]})
    signal = sorted(d["prompt_id"] for d in draws if d["signal"])  # the rewards stage scores the same
    assert adv["signal_groups"] == len(signal) and adv["kept_groups"] == len(kept) == min(len(signal), 16) // 4 * 4
    assert kept == signal[: len(kept)] and len(kept) >= 4  # the first in draw order, whole minibatches of 4
    rollouts_in, adv_in = committed(storage, "d", 0, "rollouts"), committed(storage, "d", 0, "advantages")
    batch = load_batch(storage, rollouts_in, adv_in, 0, 4)
    assert sorted(set(batch.prompt_id)) == kept  # only groups with signal reach the learner
    assert all(r.std() > 0 for r in batch.rewards.reshape(-1, 4))
    steps = table(storage, "d", 0, "learn_metrics", "learn")
    assert len(steps) == len(kept) // 4  # learn.epochs=1: a step per minibatch of kept groups, none left over


def test_max_sampling_rounds_bounds_the_rounds(storage, tmp_path):
    make_run(storage, tmp_path, extra=["rollout.max_sampling_rounds=1", "rollout.min_signal_groups=16"])
    snapshot(storage, "d", 0)
    ro = rollouts(storage, "d", 0).manifest.summary
    assert ro["rounds"] == 1 and ro["prompts_drawn"] == 16 and ro["samples"] == 64 and ro["signal_groups"] < 16


def test_too_few_groups_with_signal_for_a_minibatch_fail_advantages_naming_the_groups_found_and_needed(
    storage, tmp_path
):
    """Before: the learn stage's `0 kept samples, fewer than learn.minibatch_size`. Now the advantages stage says
    how many groups had signal against how many one minibatch takes, and commits nothing."""
    extra = ["rollout.max_sampling_rounds=1", "rollout.min_signal_groups=16", "learn.minibatch_size=64"]
    make_run(storage, tmp_path, extra=extra)
    snapshot(storage, "d", 0)
    found = rollouts(storage, "d", 0).manifest.summary["signal_groups"]
    rewards(storage, "d", 0)
    assert found < 16
    with pytest.raises(StageError) as e:
        advantages(storage, "d", 0)
    assert str(e.value) == (
        f"advantages: dynamic sampling found {found} groups with signal among the 16 drawn "
        "(rollout.max_sampling_rounds 1), fewer than the 16 groups one minibatch needs (learn.minibatch_size 64 / "
        "rollout.group_size 4); lower learn.minibatch_size or raise rollout.max_sampling_rounds (nothing was committed)"
    )
    assert committed_attempts(storage, stage_dir(storage, "d", 0, "advantages")) == []


def test_a_rerun_and_a_run_resumed_after_rollouts_commit_the_same_rows(storage, tmp_path):
    """A dataset run of two iterations from scratch twice, the second time stopped after iteration 1's
    rollouts and resumed by fresh stage calls: the same draws, rollouts, rewards and advantages; iteration 1
    draws on from where iteration 0's rounds ended in the epoch order."""
    rows = [(f"sort {4 if i % 5 == 0 else 1} {i % 10} 3 :", f"1 3 {i % 10}") for i in range(40)]  # 1 in 5 signal
    lines = [json.dumps({"prompt": p, "ground_truth": t}) + "\n" for p, t in rows]
    (tmp_path / "sort.jsonl").write_text("".join(lines))
    for run_id in ("a", "b"):
        make_run(storage, tmp_path, run_id, extra=[f"task.dataset={tmp_path / 'sort.jsonl'}"])
    with WARM_POOLS.keep():
        for run_id in ("a", "b"):
            for k in (0, 1):
                for stage in (snapshot, rollouts, rewards, advantages, learn):
                    if (run_id, k, stage) == ("b", 1, rewards):
                        WARM_POOLS._pools.popitem()[1].terminate()  # resumed here: a fresh pool
                    stage(storage, run_id, k)
    for k in (0, 1):
        for name, stage in [("draws", "rollouts"), ("rollouts", None), ("rewards", None), ("advantages", None)]:
            a, b = table(storage, "a", k, name, stage), table(storage, "b", k, name, stage)
            for row in a + b:
                row.pop("run_id")
            assert a == b, (k, name)
    first, second = (committed(storage, "a", k, "rollouts") for k in (0, 1))
    assert second.manifest.summary["draw_start"] == first.manifest.summary["draw_end"] > 16
    assert second.manifest.inputs["previous"] == first.ref()  # where it starts is a committed input
    cfg = load_config(None, TINY + [f"task.dataset={tmp_path / 'sort.jsonl'}"])
    train, _ = held_out_split(cfg)
    start = first.manifest.summary["draw_end"]
    drawn = [train[i].prompt for i in draw_at(len(train), start, 16, iteration_seed(0, 0, Salt.EPOCH_DRAWS))]
    rows = table(storage, "a", 1, "rollouts")
    assert [r["prompt"] for r in rows if r["prompt_id"] < 16 and r["sample_index"] == 0] == drawn


def test_signal_groups_kept_caps_in_draw_order_and_in_whole_minibatches():
    from stages.advantages import signal_groups_kept

    spread = torch.tensor([True, False] * 6)  # 6 groups with signal
    assert signal_groups_kept(spread, at_most=4, multiple_of=2).nonzero().flatten().tolist() == [0, 2, 4, 6]
    assert signal_groups_kept(spread, at_most=8, multiple_of=4).sum() == 4
    assert signal_groups_kept(spread, at_most=8, multiple_of=8).sum() == 0


@pytest.mark.parametrize(
    "extra,error",
    [
        (["rollout.min_signal_groups=0"], "rollout.min_signal_groups must be in"),
        (["rollout.min_signal_groups=17"], "rollout.min_signal_groups must be in"),
        (["rollout.min_signal_groups=3"], r"rollout.min_signal_groups must be in \[learn.minibatch_size"),
        (["rollout.min_signal_groups=8", "rollout.max_sampling_rounds=0"], "rollout.max_sampling_rounds must be >= 1"),
        (["rollout.min_signal_groups=8", "rollout.chunk_prompts=8", "rollout.shards=2"], "rollout.shards=2: rollout"),
        (["rollout.min_signal_groups=4"], None),
        (["rollout.max_sampling_rounds=5"], None),
    ],
)
def test_settings_are_validated_naming_the_field(extra, error):
    overrides = TINY + ["learn.minibatch_size=16", "learn.microbatch_size=8"] + extra
    if error is None:
        load_config(None, overrides)
        return
    with pytest.raises(ConfigError, match=error):
        load_config(None, overrides)
