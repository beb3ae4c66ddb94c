"""A user's dataset: load it, split off the held-out set, draw prompts epoch by epoch, render them.

A dataset is a Parquet, JSONL/JSON or CSV file at any fsspec URL, or a folder written by
`datasets`' `save_to_disk`. Its prompt column holds a string or a list of `{role, content}`
chat messages; its answer column the ground truth; every other column travels with each
sample (`Example.row`) to user reward functions.

Training draws without replacement: a seeded permutation per epoch, the position derived
from the iteration, so a resumed run draws exactly the prompts an uninterrupted one would.

A run is pinned to the bytes it was created with: `grpo init` records each dataset's `fingerprint`,
and a run's stages read a dataset only while it still has that fingerprint (`pin`, `pinned_version`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import random
from typing import Any, Literal

import numpy as np
import pandas as pd

from grpo.record.counts import is_local
from grpo.record.digests import file_digest
from grpo.record.storage import url_to_fs
from grpo.tasks import Example

log = logging.getLogger("grpo.data")

PromptFormat = Literal["auto", "chat", "text"]
_SUFFIXES = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


class DatasetError(ValueError):
    """A dataset cannot be read or lacks what the config names."""


class DatasetChangedError(DatasetError):
    """A dataset no longer has the fingerprint its run recorded at grpo init."""


def _read_frame(uri: str) -> pd.DataFrame:
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
            return pd.read_json(f, lines=path.endswith(".jsonl"), dtype=False)
        except Exception as e:  # noqa: BLE001 (pandas and arrow raise many kinds; name the file)
            raise DatasetError(f"dataset {uri}: cannot be read as {kind}: {type(e).__name__}: {e}") from e


def _plain(value: Any) -> Any:
    """A cell as plain Python (numpy arrays and scalars out), so it pickles and JSON-encodes."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def _prompt(value: Any, where: str) -> str | list[dict]:
    """A prompt cell: a string, or a list of {role, content} messages."""
    value = _plain(value)
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in value):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in value]
    raise DatasetError(
        f"{where}: a prompt must be a string or a list of {{role, content}} messages, got {str(value)[:80]!r}"
    )


def _blank(value: Any) -> bool:
    """A cell that holds no prompt or answer: None, NaN, an empty (or all-space) string or list.

    >>> [_blank(v) for v in (None, float("nan"), pd.NA, "", " ", [], "0", 0, [{"role": "user"}])]
    [True, True, True, True, True, True, False, False, False]
    """
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
        out.append(Example(_prompt(rec[prompt_column], f"dataset {uri} row {i}"), str(rec[answer_column]), row))
    if not out:
        raise DatasetError(
            f"dataset {uri}: no rows" + (f" ({len(skip)} without a prompt or a ground truth)" if skip else "")
        )
    return tuple(out)


def blank_row_count(uri: str, prompt_column: str = "prompt", answer_column: str = "ground_truth") -> int:
    """How many rows lack a prompt or a ground truth: those load_examples(skip_invalid=True) leaves out."""
    df = _read_columns(uri, prompt_column, answer_column)
    return len(set().union(*_blank_rows(df, (prompt_column, answer_column)).values()))


_CONTENT_TAGS = ("ETag", "etag", "VersionId", "generation", "Content-MD5", "Digest", "md5Hash", "crc32c")
"""What an object store or web server may say of an object's content, in the order they are read: a new tag
for new content. A modification time is none (an edit may keep it: `cp -p`, rsync -t, HTTP's whole seconds)."""


def _object_version(info: dict) -> str | None:
    """An object's size and content tag (ETag: opaque, a multipart one is no MD5; or a version id, Content-MD5,
    ...); None where the store gives no tag.

    >>> _object_version({"size": 3, "ETag": '"abc"', "Last-Modified": "x"}), _object_version({"size": 3, "mtime": 1})
    ('3:abc', None)
    """
    tag = next((str(info[k]).strip('"') for k in _CONTENT_TAGS if info.get(k)), None)
    return None if tag is None else f"{info.get('size')}:{tag}"


def _content_digest(fs, path: str, uri: str, size: int | None) -> str:
    """sha256 of an object's bytes, read through once (an HTTP server's in one streamed GET); a DatasetError
    where they cannot be read whole: nothing then says which bytes the run was made from."""
    h, n = hashlib.sha256(), 0
    stream = {"block_size": 0} if "http" in fs.protocol else {}  # no range requests: not every server takes them
    try:
        with fs.open(path, "rb", **stream) as f:
            while chunk := f.read(2**20):
                h.update(chunk)
                n += len(chunk)
    except Exception as e:  # noqa: BLE001 (each store raises its own kinds; aiohttp's are no OSError)
        raise DatasetError(
            f"dataset {uri}: the store gives no content tag (ETag, Content-MD5, a version id) and its bytes could "
            f"not be read whole to hash them ({type(e).__name__}: {e}); serve it with an ETag, or copy it to local "
            "or S3 storage"
        ) from e
    if size is not None and n != size:
        raise DatasetError(
            f"dataset {uri}: the store gives no content tag (ETag, Content-MD5, a version id) and sent {n} of its "
            f"{size} bytes; serve it with an ETag, or copy it to local or S3 storage"
        )
    return h.hexdigest()


def fingerprint(uri: str) -> str:
    """What identifies the dataset's bytes: `sha256:` of a local file's content (of each file's name and
    content in a save_to_disk folder), `etag:` a hash of each object's size and content tag (ETag) on
    object storage and web servers, `sha256:` of each object's bytes where the store gives no tag (an
    HTTP server without ETag: a same-size edit is seen); a DatasetError when it gives neither.

    Local files are hashed once a process while their stat stamp holds (grpo.record.storage.file_digest);
    tagged objects cost one metadata request each, untagged ones a download each time.
    """
    fs, path = url_to_fs(uri)
    if not fs.exists(path):
        raise DatasetError(f"dataset {uri}: no such file or folder")
    folder = fs.isdir(path)
    if is_local(fs):
        files = sorted(fs.find(path)) if folder else [path]
        parts = [(f[len(path) :], *file_digest(fs, f)) for f in files]
        if not folder:
            return f"sha256:{parts[0][2]}"
        kind = "sha256"
    else:
        infos = fs.find(path, detail=True) if folder else {path: fs.info(path)}
        tags = {f: _object_version(info) for f, info in infos.items()}
        if all(tags.values()):
            parts = [(f[len(path) :], tags[f]) for f in sorted(infos)]
            kind = "etag"
        else:
            parts = [(f[len(path) :], _content_digest(fs, f, uri, infos[f].get("size"))) for f in sorted(infos)]
            if not folder:
                return f"sha256:{parts[0][1]}"
            kind = "sha256"
    return f"{kind}:{hashlib.sha256(json.dumps(parts).encode()).hexdigest()}"


_PINNED: dict[str, tuple[str, str]] = {}  # dataset uri -> (its config field, the fingerprint grpo init recorded)


def pin(datasets: dict[str, dict] | None) -> None:
    """Hold the datasets of the run being loaded to their recorded fingerprints: `datasets` is
    {field: {"uri", "fingerprint", ...}} as grpo init recorded it, and replaces the pins of the run loaded
    before. None (a run made before fingerprints were recorded) pins nothing: its datasets are read as
    they are."""
    global _PINNED
    _PINNED = {facts["uri"]: (name, facts["fingerprint"]) for name, facts in (datasets or {}).items()}  # whole


def _short(fingerprint_: str) -> str:
    """`kind:` and the first 12 hex digits, enough to tell two fingerprints apart in one line."""
    kind, _, digest = fingerprint_.partition(":")
    return f"{kind}:{digest[:12]}"


def _size_only(uri: str) -> str:
    """The fingerprint a file on a store without content tags (an HTTP server without ETag) got before its bytes
    were hashed: its size alone."""
    fs, path = url_to_fs(uri)
    parts = [("", f"{fs.info(path).get('size')}:")]
    return f"etag:{hashlib.sha256(json.dumps(parts).encode()).hexdigest()}"


_SIZE_PINNED: set[str] = set()  # datasets of runs pinned by size alone, said once a process


def pinned_version(uri: str) -> str:
    """The dataset's fingerprint; a DatasetChangedError when the run pinned it (`pin`) to another. A run made
    when an untagged object was pinned by its size alone goes on while the size holds, said once (its bytes
    were never recorded: a new run pins them)."""
    now = fingerprint(uri)
    name, then = _PINNED.get(uri, ("", now))
    if now != then and now.startswith("sha256:") and then.startswith("etag:") and then == _size_only(uri):
        if uri not in _SIZE_PINNED:
            _SIZE_PINNED.add(uri)
            log.warning(
                "%s %s was pinned by its size alone when the run was made (its store gives no ETag): an edit of the "
                "same size goes unseen in this run; a new run pins its bytes",
                name,
                uri,
            )
        return now
    if now != then:
        raise DatasetChangedError(
            f"{name} {uri} changed since grpo init (fingerprint {_short(then)}, now {_short(now)}); "
            "restore it, or start a new run with grpo init --run NEW"
        )
    return now


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


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_messages(prompt: str | list[dict], system_prompt: str | None) -> list[dict]:
    """A prompt as chat messages: a string is one user message; `system_prompt` goes first unless the messages start
    with a system message.

    >>> chat_messages("2 + 2 =", "Be brief.")
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': '2 + 2 ='}]
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def render(
    tokenizer, prompt: str | list[dict], fmt: PromptFormat, system_prompt: str | None, tools: list[dict] | None = None
) -> tuple[str, bool]:
    """(prompt text the model sees, whether it came from the chat template).

    `auto`: messages go through the template, a string is used as is; `chat`: a string becomes
    one user message first; `text`: a string as is (messages are refused). `system_prompt`
    goes first as a system message in chat formats (unless the messages start with one).
    `tools` (an episode's tools, JSON schemas; [] for none): rendered by the template as
    `apply_chat_template(tools=...)` renders them, and a string under `auto` becomes a user message
    (an episode goes on in the chat template).
    """
    if tools is None and (fmt == "text" or (fmt == "auto" and isinstance(prompt, str))):
        if not isinstance(prompt, str):
            raise DatasetError("task.prompt_format is text, but a prompt is a list of chat messages; use auto or chat")
        return prompt, False
    if not has_chat_template(tokenizer):
        raise DatasetError(
            "the model's tokenizer has no chat template; use task.prompt_format=text or a model with one"
            + ("" if tools is None else " (episodes need one: rollout.tools, rollout.environment)")
        )
    messages = chat_messages(prompt, system_prompt)
    return apply_template(tokenizer, messages, tools, add_generation_prompt=True), True


def apply_template(tokenizer, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
    """The chat template's text of `messages`; `tools` rendered as apply_chat_template(tools=...) does ([] and None
    alike: some templates, Llama's, render tool instructions for an empty list)."""
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)


def tokenize_prompts(
    tokenizer, examples: list[Example], fmt: PromptFormat, system_prompt: str | None, tools: list[dict] | None = None
) -> tuple[list[str], list[list[int]]]:
    """Rendered texts and token ids; a templated prompt carries its own special tokens. `tools`: render's."""
    rendered = [render(tokenizer, e.prompt, fmt, system_prompt, tools) for e in examples]
    texts = [t for t, _ in rendered]
    ids: list[list[int]] = [[] for _ in texts]
    for templated in (False, True):
        idx = [i for i, (_, t) in enumerate(rendered) if t == templated]
        if idx:
            enc = tokenizer([texts[i] for i in idx], add_special_tokens=not templated)["input_ids"]
            for i, row in zip(idx, enc):
                ids[i] = row
    return texts, ids


def row_json(example: Example) -> str:
    """The dataset's other columns of a sample, as stored in the rollouts table."""
    return json.dumps(example.row or {}, sort_keys=True, default=str)
