"""Validated Parquet reads and writes over any fsspec filesystem.

Writers stream row groups (memory stays bounded however many rows a stage
writes); readers refuse a file whose table name, schema version, columns or
types differ from the declaration in `schemas.tables`, naming file and field.
"""

from __future__ import annotations

import functools
from typing import Iterable, Mapping

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem

from schemas.tables import SCHEMA_VERSION, SCHEMAS, UPGRADES


class SchemaError(ValueError):
    """A table or file does not match its declared schema."""


def schema_for(name: str) -> pa.Schema:
    if name not in SCHEMAS:
        raise SchemaError(f"unknown table {name!r}; valid tables: {sorted(SCHEMAS)}")
    return SCHEMAS[name]


def _with_metadata(name: str) -> pa.Schema:
    meta = {b"grpo.table": name.encode(), b"grpo.schema_version": str(SCHEMA_VERSION).encode()}
    return schema_for(name).with_metadata(meta)


def check_schema(actual: pa.Schema, name: str, where: str, expected: pa.Schema | None = None) -> None:
    """Raise SchemaError naming `where` and the field if `actual` differs from table `name` (or `expected`)."""
    expected = schema_for(name) if expected is None else expected
    for field in expected:
        idx = actual.get_field_index(field.name)
        if idx < 0:
            raise SchemaError(f"{where}: missing column {field.name!r} of table {name!r}")
        got = actual.field(idx).type
        if got != field.type:
            raise SchemaError(f"{where}: column {field.name!r} has type {got}, table {name!r} declares {field.type}")
    extra = set(actual.names) - set(expected.names)
    if extra:
        raise SchemaError(f"{where}: unexpected columns {sorted(extra)} in table {name!r}")


def to_table(rows: Mapping[str, list] | list[dict], name: str, where: str = "<rows>") -> pa.Table:
    """Build a table of schema `name` from columns or row dicts; nulls in non-null fields fail."""
    schema = schema_for(name)
    try:
        if isinstance(rows, Mapping):
            table = pa.Table.from_pydict(dict(rows), schema=schema)
        else:
            table = pa.Table.from_pylist(list(rows), schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError) as e:
        raise SchemaError(f"{where}: rows do not fit table {name!r}: {e}") from e
    for field in schema:
        if not field.nullable and table.column(field.name).null_count:
            raise SchemaError(f"{where}: column {field.name!r} of table {name!r} has nulls")
    return table


class ParquetWriter:
    """Streams validated row groups of table `name` to `path` on `fs`."""

    def __init__(self, fs: AbstractFileSystem, path: str, name: str):
        self.fs, self.path, self.name = fs, path, name
        self._file = fs.open(path, "wb")
        self._writer = pq.ParquetWriter(self._file, _with_metadata(name))
        self.num_rows = 0

    def write(self, rows: Mapping[str, list] | list[dict] | pa.Table) -> None:
        table = rows if isinstance(rows, pa.Table) else to_table(rows, self.name, self.path)
        check_schema(table.schema, self.name, self.path)
        self._writer.write_table(table.cast(_with_metadata(self.name)))
        self.num_rows += table.num_rows

    def close(self) -> None:
        self._writer.close()
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        self.close()


def write_parquet(
    fs: AbstractFileSystem, path: str, name: str, rows: Mapping[str, list] | list[dict] | pa.Table
) -> int:
    with ParquetWriter(fs, path, name) as w:
        w.write(rows)
    return w.num_rows


def _checked_file(fs: AbstractFileSystem, path: str, name: str):
    """(the file checked against its schema version's declaration, the function that makes its tables current)."""
    pf = pq.ParquetFile(fs.open(path, "rb"))
    meta = pf.schema_arrow.metadata or {}
    table, version = meta.get(b"grpo.table"), meta.get(b"grpo.schema_version")
    if table is not None and table.decode() != name:
        raise SchemaError(f"{path}: holds table {table.decode()!r}, expected {name!r}")
    if version is not None and int(version) > SCHEMA_VERSION:
        raise SchemaError(f"{path}: schema version {int(version)} is newer than this code's {SCHEMA_VERSION}")
    steps = [step for step in UPGRADES.get(name, ()) if version is not None and int(version) < step[0]]
    if steps:  # written before the table last changed: checked as it was written, read as it is now
        check_schema(pf.schema_arrow, name, path, steps[0][1])
        return pf, lambda table: functools.reduce(lambda t, step: step[2](t), steps, table)
    check_schema(pf.schema_arrow, name, path)
    return pf, None


def _current(table: pa.Table, upgrade, columns: list[str] | None) -> pa.Table:
    """A table read from an older file made current (all its columns were read), cut to `columns`."""
    table = upgrade(table)
    return table if columns is None else table.select(columns)


def iter_row_groups(fs: AbstractFileSystem, path: str, name: str) -> Iterable[pa.Table]:
    """Stream a validated file of table `name` as it was written, row group by row group."""
    pf, upgrade = _checked_file(fs, path, name)
    for i in range(pf.num_row_groups):
        yield pf.read_row_group(i) if upgrade is None else _current(pf.read_row_group(i), upgrade, None)


def read_parquet(fs: AbstractFileSystem, path: str, name: str, columns: list[str] | None = None) -> pa.Table:
    """Read and validate a whole file of table `name`."""
    pf, upgrade = _checked_file(fs, path, name)
    return pf.read(columns=columns) if upgrade is None else _current(pf.read(), upgrade, columns)


def iter_batches(
    fs: AbstractFileSystem, path: str, name: str, batch_size: int = 4096, columns: list[str] | None = None
) -> Iterable[pa.RecordBatch]:
    """Stream a validated file of table `name` in record batches."""
    pf, upgrade = _checked_file(fs, path, name)
    if upgrade is None:
        yield from pf.iter_batches(batch_size=batch_size, columns=columns)
        return
    for batch in pf.iter_batches(batch_size=batch_size):
        yield from _current(pa.Table.from_batches([batch]), upgrade, columns).to_batches()
