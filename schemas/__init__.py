"""Versioned Parquet schemas and the manifest that commits a stage's output."""

from schemas.manifest import MANIFEST_NAME, FileEntry, InputRef, Manifest
from schemas.parquet import (
    ParquetWriter,
    SchemaError,
    check_schema,
    iter_batches,
    iter_row_groups,
    read_parquet,
    schema_for,
    to_table,
    write_parquet,
)
from schemas.tables import SCHEMA_VERSION, SCHEMAS, TABLE_FILES, table_file

__all__ = [
    "MANIFEST_NAME",
    "FileEntry",
    "InputRef",
    "Manifest",
    "ParquetWriter",
    "SchemaError",
    "check_schema",
    "iter_batches",
    "iter_row_groups",
    "read_parquet",
    "schema_for",
    "to_table",
    "write_parquet",
    "SCHEMA_VERSION",
    "SCHEMAS",
    "TABLE_FILES",
    "table_file",
]
