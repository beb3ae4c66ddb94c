"""Sharded rollouts and rewards (rollout.shards, reward.shards): each shard committed on its own, the stage
committing their rows merged, the same rows, rewards and next policy as one shard; a failed shard reruns
alone; the CLI runs one shard."""

import hashlib

import pandas as pd
import pytest
from test_stages import TINY

import grpo.scoring.score
from flows.cli import main
from grpo.config import ConfigError, load_config
from grpo.gc import plan
from grpo.record.layout import shard_stage, stage_dir
from grpo.record.storage import latest_committed, list_attempts, open_storage
from stages import StageError, stage_function
from stages.init import init_run
from stages.iteration import run_iteration

CHUNKED = TINY + ["rollout.chunk_prompts=4"]  # 16 prompts: 4 chunks
SHARDED = ["rollout.shards=3", "reward.shards=2"]
TABLES = {"rollouts": "rollouts.parquet", "rewards": "rewards.parquet", "advantages": "advantages.parquet"}


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


def content(storage, committed, name: str) -> pd.DataFrame:
    return pd.read_parquet(storage.fs.open(committed.path(name), "rb")).drop(columns=["run_id"])


def attempts(storage, run_id: str, stage: str) -> list[str]:
    return list_attempts(storage, stage_dir(storage, run_id, 0, stage))


def test_shards_commit_on_their_own_and_merge_into_the_rows_and_policy_of_one(storage):
    init_run(storage, "one", load_config(None, CHUNKED))
    init_run(storage, "many", load_config(None, CHUNKED + SHARDED))
    one, many = run_iteration(storage, "one", 0), run_iteration(storage, "many", 0)
    for stage, name in TABLES.items():
        pd.testing.assert_frame_equal(content(storage, many[stage], name), content(storage, one[stage], name))
    sha = lambda c: hashlib.sha256(storage.fs.cat_file(c.path("policy/model.safetensors"))).hexdigest()  # noqa: E731
    assert sha(many["learn"]) == sha(one["learn"])  # the learner trained on the same batch

    for stage, n in (("rollouts", 3), ("rewards", 2)):
        merged = many[stage].manifest
        assert merged.summary["shards"] == n and merged.summary["samples"] == one[stage].manifest.summary["samples"]
        parts = [latest_committed(storage, stage_dir(storage, "many", 0, shard_stage(stage, k, n))) for k in range(n)]
        assert [merged.inputs[f"shard-{k}"].uri for k in range(n)] == [p.uri for p in parts]
        sizes = [p.manifest.summary["samples"] for p in parts]
        assert sum(sizes) == merged.summary["samples"] and min(sizes) > 0
    assert [p.manifest.summary["prompts"] for p in parts_of(storage, "rollouts", 3)] == [4, 4, 8]  # whole chunks


def parts_of(storage, stage: str, n: int):
    return [latest_committed(storage, stage_dir(storage, "many", 0, shard_stage(stage, k, n))) for k in range(n)]


def test_a_failed_shard_reruns_alone_and_gc_collects_its_failed_attempt(storage, monkeypatch):
    init_run(storage, "many", load_config(None, CHUNKED + SHARDED))
    for stage in ("snapshot", "rollouts"):
        stage_function(stage)(storage, "many", 0)
    real, calls = grpo.scoring.score.score_batch, []

    def second_shard_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # shard 1's one batch
            raise StageError("injected reward fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo.scoring.score, "score_batch", second_shard_fails)
    with pytest.raises(StageError, match="injected reward fault"):
        stage_function("rewards")(storage, "many", 0)
    first = attempts(storage, "many", shard_stage("rewards", 0, 2))
    assert len(first) == 1 and not attempts(storage, "many", "rewards")  # shard 0 committed, the stage not
    shard_1 = stage_dir(storage, "many", 0, shard_stage("rewards", 1, 2))
    failed = f"{shard_1}/{list_attempts(storage, shard_1)[0]}"
    assert failed in {g.path for g in plan(storage, "many", min_age_s=0).garbage}  # gc sees shard folders

    monkeypatch.setattr(grpo.scoring.score, "score_batch", real)
    done = stage_function("rewards")(storage, "many", 0)
    assert attempts(storage, "many", shard_stage("rewards", 0, 2)) == first  # reused, not scored again
    assert len(attempts(storage, "many", shard_stage("rewards", 1, 2))) == 2  # the failed one, then its rerun
    assert done.manifest.summary["samples"] == 64


def test_the_cli_runs_one_shard_then_the_rest_and_refuses_a_shard_that_is_not(storage, capsys):
    init_run(storage, "many", load_config(None, CHUNKED + SHARDED))
    stage_function("snapshot")(storage, "many", 0)
    cli = ["--storage", storage.url, "stage"]
    assert main(cli + ["rollouts", "--run", "many", "--iteration", "0", "--shard", "1"]) == 0
    assert [bool(attempts(storage, "many", shard_stage("rollouts", k, 3))) for k in range(3)] == [False, True, False]
    assert not attempts(storage, "many", "rollouts")
    shard_1 = attempts(storage, "many", shard_stage("rollouts", 1, 3))
    assert main(cli + ["rollouts", "--run", "many", "--iteration", "0"]) == 0
    assert attempts(storage, "many", shard_stage("rollouts", 1, 3)) == shard_1 and attempts(storage, "many", "rollouts")
    capsys.readouterr()
    assert main(cli + ["rollouts", "--run", "many", "--iteration", "0", "--shard", "3"]) != 0
    assert "rollout.shards=3 makes shards 0..2" in capsys.readouterr().err
    assert main(cli + ["learn", "--run", "many", "--iteration", "0", "--shard", "0"]) != 0
    assert "stage learn has no shards" in capsys.readouterr().err


@pytest.mark.parametrize(
    "setting, message",
    [
        ("rollout.shards=5", "rollout.shards=5 is more than the iteration's 4 chunk"),
        ("rollout.shards=0", "rollout.shards must be >= 1"),
        ("reward.shards=0", "reward.shards must be >= 1"),
    ],
)
def test_shard_settings_are_checked(setting, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, CHUNKED + [setting])
