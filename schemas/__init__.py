"""Versioned Parquet schemas and the manifest that commits a stage's output.

Each name loads its module when first used: the manifest is plain JSON, and a reader of manifests alone
(`grpo status`) does not pay pyarrow's import.
"""

import importlib

_MODULES = {
    "manifest": ["MANIFEST_NAME", "FileEntry", "InputRef", "Manifest"],
    "parquet": [
        "ParquetWriter",
        "SchemaError",
        "check_schema",
        "iter_batches",
        "iter_row_groups",
        "read_parquet",
        "schema_for",
        "to_table",
        "write_parquet",
    ],
    "tables": ["SCHEMA_VERSION", "SCHEMAS"],
    "files": ["TABLE_FILES", "table_file"],
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'schemas' has no attribute {name!r}")
    return getattr(importlib.import_module(f"schemas.{_WHERE[name]}"), name)


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
