"""Parquet schemas: validation on write and read names the file and the field."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem

from schemas import SCHEMAS, ParquetWriter, SchemaError, iter_batches, read_parquet, to_table, write_parquet

FS = LocalFileSystem()


def rollout_row(i=0):
    return {
        "run_id": "r",
        "iteration": 0,
        "prompt_id": i // 2,
        "sample_index": i % 2,
        "prompt": "sort 2 1 :",
        "prompt_ids": [2, 5, 4, 6],
        "response": "1 2",
        "response_ids": [4, 5, 3],
        "sampler_logprobs": [-0.1, -0.2, -0.05],
        "loss_mask": [1, 1, 1],
        "finish_reason": "stop",
        "ground_truth": "1 2",
        "row": "{}",
        "policy_version": -1,
        "policy_hash": "abc",
    }


def test_every_table_round_trips(tmp_path):
    for name, schema in SCHEMAS.items():
        path = str(tmp_path / f"{name}.parquet")
        write_parquet(FS, path, name, schema.empty_table())
        assert read_parquet(FS, path, name).schema.equals(schema)


def test_write_rejects_missing_field_naming_it(tmp_path):
    row = rollout_row()
    del row["sampler_logprobs"]
    with pytest.raises(SchemaError, match="sampler_logprobs"):
        to_table([row], "rollouts", "x.parquet")
    row = rollout_row()
    row["response_ids"] = None
    with pytest.raises(SchemaError, match="response_ids"):
        write_parquet(FS, str(tmp_path / "r.parquet"), "rollouts", [row])


def test_write_rejects_wrong_type(tmp_path):
    row = rollout_row()
    row["prompt_id"] = "seven"
    with pytest.raises(SchemaError, match="x.parquet"):
        to_table([row], "rollouts", "x.parquet")


def test_read_rejects_foreign_file_naming_file_and_field(tmp_path):
    path = tmp_path / "bad.parquet"
    table = to_table([rollout_row()], "rollouts").drop_columns(["finish_reason"])
    pq.write_table(table, path)
    with pytest.raises(SchemaError, match=r"bad\.parquet.*finish_reason"):
        read_parquet(FS, str(path), "rollouts")
    pq.write_table(to_table([rollout_row()], "rollouts").set_column(1, "iteration", pa.array([0], pa.int64())), path)
    with pytest.raises(SchemaError, match="iteration.*int64"):
        read_parquet(FS, str(path), "rollouts")


def test_read_rejects_other_table(tmp_path):
    path = str(tmp_path / "p.parquet")
    write_parquet(FS, path, "rollouts", [rollout_row()])
    with pytest.raises(SchemaError, match="holds table 'rollouts'"):
        read_parquet(FS, path, "rewards")


def test_streamed_row_groups(tmp_path):
    path = str(tmp_path / "s.parquet")
    with ParquetWriter(FS, path, "rollouts") as w:
        for start in range(0, 10, 4):
            w.write([rollout_row(i) for i in range(start, min(start + 4, 10))])
    assert w.num_rows == 10
    assert pq.ParquetFile(path).num_row_groups == 3
    got = [b.num_rows for b in iter_batches(FS, path, "rollouts", batch_size=3)]
    assert sum(got) == 10


def test_unknown_table_lists_valid():
    with pytest.raises(SchemaError, match="valid tables"):
        to_table([], "nope")


def test_a_rollouts_file_of_schema_version_3_reads_as_version_4(tmp_path):
    """Written before rollout.staleness: its policy_version held the checkpoint hash, now policy_hash, and the
    policy that sampled a row was the previous iteration's learn's (-1: the base)."""
    from schemas.tables import ROLLOUTS_V3

    rows = [rollout_row(i) | {"iteration": i} for i in range(3)]
    for row in rows:
        row["policy_version"] = row.pop("policy_hash")
    old = pa.Table.from_pylist(rows, schema=ROLLOUTS_V3)
    path = str(tmp_path / "v3.parquet")
    pq.write_table(old.replace_schema_metadata({b"grpo.table": b"rollouts", b"grpo.schema_version": b"3"}), path)
    table = read_parquet(FS, path, "rollouts")
    assert table.schema.equals(SCHEMAS["rollouts"])
    assert table.column("policy_version").to_pylist() == [-1, 0, 1]
    assert table.column("policy_hash").to_pylist() == ["abc"] * 3
    assert read_parquet(FS, path, "rollouts", columns=["policy_version"]).column_names == ["policy_version"]
    batches = list(iter_batches(FS, path, "rollouts", batch_size=2, columns=["iteration", "policy_version"]))
    assert [b.column(1).to_pylist() for b in batches] == [[-1, 0], [1]]
    with pytest.raises(SchemaError, match="policy_version"):  # a version 4 file still holds to version 4
        pq.write_table(old.replace_schema_metadata({b"grpo.table": b"rollouts", b"grpo.schema_version": b"4"}), path)
        read_parquet(FS, path, "rollouts")


def test_a_rollouts_file_of_schema_version_4_reads_with_every_token_trained_on(tmp_path):
    """Written before episodes: every response token was sampled, so its loss_mask is all ones; a version 3 file
    goes through both upgrades."""
    from schemas.tables import ROLLOUTS_V4

    rows = [rollout_row(i) | {"response_ids": list(range(i))} for i in range(3)]
    old = pa.Table.from_pylist(rows, schema=ROLLOUTS_V4)
    path = str(tmp_path / "v4.parquet")
    pq.write_table(old.replace_schema_metadata({b"grpo.table": b"rollouts", b"grpo.schema_version": b"4"}), path)
    table = read_parquet(FS, path, "rollouts")
    assert table.schema.equals(SCHEMAS["rollouts"])
    assert table.column("loss_mask").to_pylist() == [[], [1], [1, 1]]
    sliced = list(iter_batches(FS, path, "rollouts", batch_size=2, columns=["loss_mask"]))
    assert [b.column(0).to_pylist() for b in sliced] == [[[], [1]], [[1, 1]]]
    with pytest.raises(SchemaError, match="loss_mask"):  # a version 5 file holds to version 5
        pq.write_table(old.replace_schema_metadata({b"grpo.table": b"rollouts", b"grpo.schema_version": b"5"}), path)
        read_parquet(FS, path, "rollouts")
