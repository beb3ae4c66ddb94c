"""A user's dataset: load it, split off the held-out set, draw prompts epoch by epoch. What pins a run to its bytes
is grpo/record/pins.py; how a prompt is rendered for the model, grpo/episodes/templates.py.

A dataset is a Parquet, JSONL/JSON or CSV file at any fsspec URL, or a folder written by
`datasets`' `save_to_disk`. Its prompt column holds a string or a list of `{role, content}`
chat messages; its answer column the ground truth; every other column travels with each
sample (`Example.row`) to user reward functions.

Training draws without replacement: a seeded permutation per epoch, the position derived
from the iteration, so a resumed run draws exactly the prompts an uninterrupted one would.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import random
import re
from typing import TYPE_CHECKING, Any

from grpo.errors import DatasetError
from grpo.record.storage import url_to_fs
from grpo.tasks import Example

if TYPE_CHECKING:  # imported where a dataset is read: a run's manifests alone (`grpo status`) need neither
    import pandas as pd

log = logging.getLogger("grpo.data")

_SUFFIXES = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


def _read_frame(uri: str) -> pd.DataFrame:
    import pandas as pd

    fs, path = url_to_fs(uri)
    if not fs.exists(path):
        raise DatasetError(f"dataset {uri}: no such file or folder")
    if fs.isdir(path):
        if not fs.exists(f"{path}/state.json"):
            splits = [p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False) if fs.exists(f"{p}/state.json")]
            hint = f"; name one split's folder, e.g. {uri.rstrip('/')}/{splits[0]}" if splits else ""
            raise DatasetError(f"dataset {uri}: a folder must be one split saved by datasets' save_to_disk{hint}")
        import datasets

        return datasets.load_from_disk(uri, storage_options=fs.storage_options or None).to_pandas()
    kind = next((k for s, k in _SUFFIXES.items() if path.endswith(s)), None)
    if kind is None:
        raise DatasetError(f"dataset {uri}: unknown format; use .parquet, .jsonl, .json, .csv or a save_to_disk folder")
    with fs.open(path, "rb") as f:
        try:
            if kind == "parquet":
                return pd.read_parquet(f)
            if kind == "csv":
                return pd.read_csv(f, dtype=str, keep_default_na=False)
            raw = f.read()
            if _SURROGATE.search(raw):  # pandas' JSON reader drops a lone surrogate without a word: Python's keeps it
                return _json_checked(raw, path.endswith(".jsonl"), uri)
            return pd.read_json(io.BytesIO(raw), lines=path.endswith(".jsonl"), dtype=False)
        except DatasetError:
            raise
        except Exception as e:  # noqa: BLE001 (pandas and arrow raise many kinds; name the file)
            raise DatasetError(f"dataset {uri}: cannot be read as {kind}: {type(e).__name__}: {e}") from e


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # JSON's escape of a UTF-16 surrogate


def _json_checked(raw: bytes, lines: bool, uri: str) -> pd.DataFrame:
    """A JSON dataset that escapes UTF-16 surrogates, read by Python's json: a pair is one character, a lone one is
    refused naming its row and column."""
    import pandas as pd

    rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()] if lines else json.loads(raw)
    for i, row in enumerate(rows if isinstance(rows, list) else []):
        for column, value in row.items() if isinstance(row, dict) else ():
            if isinstance(value, str):
                _text(value, f"dataset {uri} row {i}'s {column}")
    return pd.DataFrame(rows)


def _plain(value: Any) -> Any:
    """A cell as plain Python (numpy arrays and scalars out), so it pickles and JSON-encodes."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def _text(value: str, where: str) -> str:
    """`value`, refused where it is no valid Unicode: a lone surrogate (JSON's "\\ud800") the tokenizer drops
    without a word and Arrow cannot write.

    >>> _text("3 + 4 " + chr(0xD800) + " =", "row 7")
    Traceback (most recent call last):
    grpo.errors.DatasetError: row 7 holds a lone surrogate (U+D800 at character 6), no valid Unicode; fix the file
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DatasetError(
            f"{where} holds a lone surrogate (U+{ord(value[e.start]):04X} at character {e.start}), no valid "
            "Unicode; fix the file"
        ) from None
    return value


def _prompt(value: Any, where: str) -> str | list[dict]:
    """A prompt cell: a string, or a list of {role, content} messages."""
    value = _plain(value)
    if isinstance(value, str):
        return _text(value, f"{where}'s prompt")
    if isinstance(value, list) and value and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in value):
        return [{"role": str(m["role"]), "content": _text(str(m["content"]), f"{where}'s prompt")} for m in value]
    raise DatasetError(
        f"{where}: a prompt must be a string or a list of {{role, content}} messages, got {str(value)[:80]!r}"
    )


def _blank(value: Any) -> bool:
    """A cell that holds no prompt or answer: None, NaN, an empty (or all-space) string or list.

    >>> import pandas as pd
    >>> [_blank(v) for v in (None, float("nan"), pd.NA, "", " ", [], "0", 0, [{"role": "user"}])]
    [True, True, True, True, True, True, False, False, False]
    """
    import pandas as pd

    value = _plain(value)
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, (list, dict)):
        return not value
    return value is None or bool(pd.isna(value))


def _blank_rows(df: pd.DataFrame, columns: tuple[str, ...]) -> dict[str, set[int]]:
    """{column: positions of the rows where it is blank} (null ground truths would be scored as "nan")."""
    return {c: {i for i, v in enumerate(df[c]) if _blank(v)} for c in columns}


def _read_columns(uri: str, prompt_column: str, answer_column: str) -> pd.DataFrame:
    df = _read_frame(uri)
    missing = [c for c in (prompt_column, answer_column) if c not in df.columns]
    if missing:
        raise DatasetError(
            f"dataset {uri}: no column {missing[0]!r} (columns: {', '.join(map(str, df.columns))}); "
            "set task.prompt_column / task.answer_column"
        )
    return df


@functools.lru_cache(maxsize=8)
def load_examples(
    uri: str,
    prompt_column: str = "prompt",
    answer_column: str = "ground_truth",
    skip_invalid: bool = False,
    version: str = "",
) -> tuple[Example, ...]:
    """The rows of the dataset at `uri` as Examples (cached per process; `version`, the dataset's
    fingerprint, only keys the cache: read once a run, again only if the dataset changes).

    A row without a prompt or a ground truth (null, NaN, empty) fails the dataset, naming the column
    and the count; with `skip_invalid` it is left out (`blank_row_count` counts them), the same rows
    in every stage.
    """
    df = _read_columns(uri, prompt_column, answer_column)
    blank = _blank_rows(df, (prompt_column, answer_column))
    if any(blank.values()) and not skip_invalid:
        counts = ", ".join(f"{len(r)} row{'s' * (len(r) > 1)} with no {c!r}" for c, r in blank.items() if r)
        raise DatasetError(
            f"dataset {uri}: {counts} (null, NaN or empty); fill them in, or set "
            "task.skip_invalid_rows=true to leave them out"
        )
    skip = set().union(*blank.values())
    others = [c for c in df.columns if c not in (prompt_column, answer_column)]
    out = []
    for i, rec in enumerate(df.to_dict("records")):
        if i in skip:
            continue
        row = {str(c): _plain(rec[c]) for c in others}
        answer = _text(str(rec[answer_column]), f"dataset {uri} row {i}'s {answer_column}")
        out.append(Example(_prompt(rec[prompt_column], f"dataset {uri} row {i}"), answer, row))
    if not out:
        raise DatasetError(
            f"dataset {uri}: no rows" + (f" ({len(skip)} without a prompt or a ground truth)" if skip else "")
        )
    return tuple(out)


def blank_row_count(uri: str, prompt_column: str = "prompt", answer_column: str = "ground_truth") -> int:
    """How many rows lack a prompt or a ground truth: those load_examples(skip_invalid=True) leaves out."""
    df = _read_columns(uri, prompt_column, answer_column)
    return len(set().union(*_blank_rows(df, (prompt_column, answer_column)).values()))


def split(examples: tuple[Example, ...], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, held out): a seeded `fraction` of the rows held out, never drawn for training."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_out = round(len(examples) * fraction)
    held = sorted(order[:n_out])
    held_set = set(held)
    return [e for i, e in enumerate(examples) if i not in held_set], [examples[i] for i in held]


def draw(n_rows: int, n: int, iteration: int, seed: int) -> list[int]:
    """Row indices of iteration `iteration`'s `n` prompts: epoch by epoch without replacement.

    Draw i of the run (i = iteration * n + j) is row perm_e[i mod n_rows] of epoch e = i // n_rows,
    perm_e a permutation seeded by (seed, e): every row once per epoch.

    >>> [draw(4, 2, k, seed=0) for k in range(4)] == [draw(4, 4, 0, 0)[:2], draw(4, 4, 0, 0)[2:],
    ...                                                 draw(4, 4, 1, 0)[:2], draw(4, 4, 1, 0)[2:]]
    True
    >>> sorted(draw(5, 5, 3, seed=1))
    [0, 1, 2, 3, 4]
    """
    return draw_at(n_rows, iteration * n, n, seed)


def draw_at(n_rows: int, start: int, n: int, seed: int) -> list[int]:
    """Row indices of draws start..start+n-1 of the run's epoch order (see `draw`).

    >>> draw_at(4, 3, 3, seed=0) == draw(4, 4, 0, 0)[3:] + draw(4, 4, 1, 0)[:2]
    True
    """
    perms: dict[int, list[int]] = {}
    out = []
    for i in range(start, start + n):
        epoch = i // n_rows
        if epoch not in perms:
            perms[epoch] = list(range(n_rows))
            random.Random(f"{seed}:{epoch}").shuffle(perms[epoch])
        out.append(perms[epoch][i % n_rows])
    return out


def row_json(example: Example) -> str:
    """The dataset's other columns of a sample, as stored in the rollouts table."""
    return json.dumps(example.row or {}, sort_keys=True, default=str)


ROLES = ("system", "user", "assistant", "tool")


def load_conversations(uri: str, split: str = "train") -> list[tuple[list[dict], list[dict]]]:
    """(messages, tools) of each row of a warm start's dataset (sft.dataset: a file or folder as task.dataset, or a hub
    dataset's `split`) in one of TRL's SFT shapes: a `messages` column of chat messages, or conversational `prompt`
    and `completion` columns (lists of messages, joined); an optional `tools` column (JSON schemas, or their JSON
    text) renders with each. Any other shape is refused in one line naming the column."""
    df = _hub_frame(uri, split) if is_hub_id(uri) else _read_frame(uri)
    columns = list(df.columns)
    if "messages" in columns:
        shape = ("messages",)
    elif "prompt" in columns and "completion" in columns:
        shape = ("prompt", "completion")
    else:
        raise DatasetError(
            f"sft.dataset {uri}: no `messages` column, nor `prompt` and `completion` columns (TRL's conversational "
            f"SFT shapes); its columns: {columns}"
        )
    out = []
    for i, row in enumerate(df.to_dict("records")):
        messages = [m for c in shape for m in _messages(row[c], f"sft.dataset {uri} row {i}'s column {c}")]
        tools = _plain(row.get("tools")) or []
        tools = json.loads(tools) if isinstance(tools, str) else tools
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise DatasetError(f"sft.dataset {uri} row {i}'s column tools: a list of JSON schemas, got {tools!r:.80}")
        out.append((messages, tools))
    if not out:
        raise DatasetError(f"sft.dataset {uri}: no rows")
    return out


def _messages(value: Any, where: str) -> list[dict]:
    """A cell of chat messages as the chat template takes them: each a {role, content, ...} mapping (keys a Parquet
    struct fills with null dropped)."""
    value = _plain(value)
    if isinstance(value, str):
        raise DatasetError(f"{where} holds text (TRL's standard shape); the warm start reads conversations: a list of "
                           "{role, content} messages")  # fmt: skip
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        raise DatasetError(f"{where}: a list of {{role, content}} messages, got {str(value)[:80]!r}")
    out = []
    for m in value:
        if m.get("role") not in ROLES:
            raise DatasetError(f"{where}: a message's role must be one of {list(ROLES)}, got {m.get('role')!r}")
        kept = {k: v for k, v in m.items() if v is not None}
        if isinstance(kept.get("content"), str):
            _text(kept["content"], where)
        out.append({"content": "", **kept})
    return out


def is_hub_id(uri: str) -> bool:
    """A Hugging Face Hub dataset id (`org/name`): no URL scheme, no file suffix, no such local path."""
    import os

    return (
        "://" not in uri
        and not os.path.exists(uri)
        and re.fullmatch(r"[\w.-]+/[\w.-]+", uri) is not None
        and not uri.endswith(tuple(_SUFFIXES))
    )


def _hub_frame(uri: str, split: str) -> pd.DataFrame:
    import datasets

    try:
        return datasets.load_dataset(uri, split=split).to_pandas()
    except Exception as e:  # noqa: BLE001 (the hub and datasets raise many kinds; name the dataset)
        raise DatasetError(f"sft.dataset {uri} (split {split}): does not load from the hub: {type(e).__name__}: {e}")
