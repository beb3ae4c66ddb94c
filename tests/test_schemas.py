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
