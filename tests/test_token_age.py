"""Per-token policy versions in the loss: rollouts.token_versions (null: every token by the row's policy_version) gives
each token's age (the version the learn updates from minus the token's), the learn manifest records the trained
tokens of each age and the largest, and learn.max_token_age masks older tokens out of the loss, counted. The tables
are made by hand, as a run whose responses were carried across iterations would commit them."""

import hashlib

import numpy as np
import pytest
import torch
from test_learn import F32, TINY
from test_learn import make_run as make_run_with_inputs

from grpo.config import ConfigError, load_config
from grpo.errors import LearnError
from grpo.learner import Batch
from grpo.learner.loss import within_age
from grpo.record.commit import StageWriter
from grpo.record.identity import section
from grpo.record.layout import stage_dir
from grpo.record.storage import latest_committed, open_storage
from schemas import read_parquet, write_parquet
from stages import StageError, stage_function
from stages.init import init_run
from stages.learn_data import load_batch

pytestmark = [pytest.mark.equivalence, pytest.mark.precision_pinned]  # every learner here pins float32


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


def hand_made(versions, loss_mask=None) -> Batch:
    """A batch of one group whose tokens were sampled by `versions` (rows of equal length), padding -9."""
    versions = torch.tensor(versions)
    n, t = versions.shape
    mask = torch.ones(n, t)
    return Batch(
        torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), torch.ones(n, t, dtype=torch.long),
        mask, mask if loss_mask is None else torch.tensor(loss_mask, dtype=torch.float), torch.zeros(n, t), versions,
        torch.zeros(n), torch.zeros(n), n, [0] * n, list(range(n)),
    )  # fmt: skip


def test_ages_are_counted_over_the_trained_tokens_and_the_too_old_masked():
    """Start version 5: tokens of versions 5, 4 and 2 are of ages 0, 1 and 3; observations (loss_mask 0) are not
    counted; max_token_age=1 masks the age-3 tokens, which the summary counts."""
    batch = hand_made([[4, 4, 5, 5], [2, 2, 4, 5]], loss_mask=[[1, 1, 0, 1], [1, 1, 1, 1]])
    same, ages = within_age(batch, 5, None)
    assert same is batch  # no limit: the very batch, every token trains
    assert ages == {"token_ages": {"0": 2, "1": 3, "3": 2}, "largest_token_age": 3}
    limited, ages = within_age(batch, 5, 1)
    assert ages == {"token_ages": {"0": 2, "1": 3}, "largest_token_age": 1, "tokens_too_old": {"3": 2}}
    assert limited.loss_mask.tolist() == [[1, 1, 0, 1], [0, 0, 1, 1]]
    _, ages = within_age(batch, 5, 0)
    assert ages["token_ages"] == {"0": 2} and ages["tokens_too_old"] == {"1": 3, "3": 2}
    assert ages["largest_token_age"] == 0
    _, ages = within_age(hand_made([[7, 7]], loss_mask=[[0, 0]]), 7, 0)
    assert ages == {"token_ages": {}, "largest_token_age": None, "tokens_too_old": {}}
    with pytest.raises(LearnError, match="policy version 6, newer than the policy this update starts from \\(5\\)"):
        within_age(hand_made([[5, 6]]), 5, None)


def test_max_token_age_is_checked_and_left_out_of_identities_when_unset():
    with pytest.raises(ConfigError, match="learn.max_token_age must be >= 0"):
        load_config(None, ["learn.max_token_age=-1"])
    assert "max_token_age" not in section(load_config(None), "learn")
    assert section(load_config(None, ["learn.max_token_age=2"]), "learn")["max_token_age"] == 2


def rewrite_rollouts(storage, run_id: str, k: int, change) -> None:
    """Commit iteration k's rollouts again, their table changed by `change(frame)` in place (same inputs)."""
    ro = latest_committed(storage, stage_dir(storage, run_id, k, "rollouts"))
    table = read_parquet(storage.fs, ro.path("rollouts.parquet"), "rollouts").to_pandas()
    change(table)
    writer = StageWriter(
        storage, stage_dir(storage, run_id, k, "rollouts"), run_id=run_id, iteration=k, stage="rollouts",
        config={"hand-made": True}, inputs=dict(ro.manifest.inputs),
    )  # fmt: skip
    write_parquet(storage.fs, writer.path("rollouts.parquet"), "rollouts", table.to_dict("list"))
    writer.commit(ro.manifest.summary)


def carried(frame) -> None:
    """Every response of 2+ tokens carried over from the iteration before: its first half sampled by the policy
    before the row's (age 1 in a learn at rollout.staleness 0)."""
    frame["token_versions"] = [
        None if len(ids) < 2 else [v - 1] * (len(ids) // 2) + [v] * (len(ids) - len(ids) // 2)
        for ids, v in zip(frame.response_ids, frame.policy_version)
    ]


def as_masked(frame) -> None:
    """What learn.max_token_age=0 makes of carried(): those first halves masked out of the loss, one version."""
    frame["loss_mask"] = [
        [1] * len(ids) if len(ids) < 2 else [0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2)
        for ids in frame.response_ids
    ]


def test_the_batch_takes_each_tokens_version_from_the_table_and_refuses_a_list_of_another_length(storage):
    make_run_with_inputs(storage, "t", extra=[F32])
    rewrite_rollouts(storage, "t", 0, carried)
    ro, ad = (latest_committed(storage, stage_dir(storage, "t", 0, s)) for s in ("rollouts", "advantages"))
    batch = load_batch(storage, ro, ad, pad_id=0, group_size=4)
    lengths = batch.response_mask.sum(1).long()
    for row, n in zip(batch.token_versions.tolist(), lengths.tolist()):
        assert row[:n] == ([-1] * n if n < 2 else [-2] * (n // 2) + [-1] * (n - n // 2))

    def one_too_many(frame) -> None:
        frame["token_versions"] = [[0] * (len(ids) + 1) for ids in frame.response_ids]

    rewrite_rollouts(storage, "t", 0, one_too_many)
    ro = latest_committed(storage, stage_dir(storage, "t", 0, "rollouts"))
    with pytest.raises(StageError, match=r"rollouts.*prompt_id \d+ has \d+ token_versions for \d+ response_ids"):
        load_batch(storage, ro, ad, pad_id=0, group_size=4)


def policy_sha(storage, run_id: str, k: int) -> str:
    learned = latest_committed(storage, stage_dir(storage, run_id, k, "learn"))
    return hashlib.sha256(open(learned.path("policy/model.safetensors"), "rb").read()).hexdigest()


@pytest.mark.slow
def test_max_token_age_masks_the_older_tokens_as_a_loss_mask_would_and_the_manifest_counts_them(storage):
    """Learn 1 (rollout.staleness 0: it updates from version 0) on rollouts whose responses' first halves version
    -1 sampled (age 1): without a limit it trains on both ages, and so with learn.max_token_age=1 (the same bytes);
    max_token_age=0 masks the age-1 tokens, the update of a table whose loss_mask leaves them out (the same bytes)."""
    runs = {"none": ([], carried), "one": (["learn.max_token_age=1"], carried)}
    runs |= {"zero": (["learn.max_token_age=0"], carried), "masked": ([], as_masked)}
    for run_id, (extra, change) in runs.items():
        init_run(storage, run_id, load_config(None, TINY + [F32, "learn.behavior_correction=tis"] + extra))
        for k, stage in [(0, s) for s in ("snapshot", "rollouts", "rewards", "advantages", "learn")] + [
            (1, "snapshot"), (1, "rollouts")
        ]:  # fmt: skip
            stage_function(stage)(storage, run_id, k)
        rewrite_rollouts(storage, run_id, 1, change)
        for s in ["rewards", "advantages", "learn"]:
            stage_function(s)(storage, run_id, 1)
    summary = {r: latest_committed(storage, stage_dir(storage, r, 1, "learn")).manifest.summary for r in runs}
    ages = summary["none"]["token_ages"]
    assert (
        set(ages) == {"0", "1"}
        and summary["none"]["largest_token_age"] == 1
        and "tokens_too_old" not in summary["none"]
    )
    assert summary["one"]["token_ages"] == ages and summary["one"]["tokens_too_old"] == {}
    assert summary["zero"]["token_ages"] == {"0": ages["0"]} and summary["zero"]["tokens_too_old"] == {"1": ages["1"]}
    assert summary["zero"]["largest_token_age"] == 0 and summary["masked"]["token_ages"] == {"0": ages["0"]}
    assert summary["zero"]["tokens"] == summary["masked"]["tokens"] < summary["none"]["tokens"]
    sha = {r: policy_sha(storage, r, 1) for r in runs}
    assert sha["none"] == sha["one"] != sha["zero"] == sha["masked"]
    assert np.isclose(summary["zero"]["loss"], summary["masked"]["loss"])


@pytest.mark.slow
def test_a_stale_run_trains_every_token_at_the_age_of_its_staleness(storage):
    """rollout.staleness=1, nothing carried (token_versions null): learn 1 updates from learn 0's policy on rows the
    base sampled, every trained token of age 1; learn 0, from the base on the base's rows, age 0."""
    init_run(storage, "s", load_config(None, TINY + [F32, "rollout.staleness=1", "learn.behavior_correction=tis"]))
    for k in (0, 1):
        for stage in ("snapshot", "rollouts", "rewards", "advantages", "learn"):
            stage_function(stage)(storage, "s", k)
    for k in (0, 1):
        summary = latest_committed(storage, stage_dir(storage, "s", k, "learn")).manifest.summary
        per_epoch = summary["tokens"] // 2  # learn.epochs=2: each token trained twice, counted once
        assert summary["token_ages"] == {str(k): per_epoch} and summary["largest_token_age"] == k
