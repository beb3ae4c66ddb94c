"""`grpo query`: DuckDB SQL over the committed Parquet outputs of one run.

    grpo query --run r1 "SELECT iteration, avg(reward) FROM rewards GROUP BY 1 ORDER BY 1"

Each view reads, for every iteration, the file of the newest committed attempt
of its stage (the same attempt a downstream stage would read), found through
the manifests: a glob over `attempt-*` would also pick up the half-written
files of a crashed attempt, or the rows of an older attempt beside a forced
rerun. The files read are hash-checked against their manifest by default.

Views: rollouts, rewards, advantages, logprobs, learn_metrics, eval, and with episodes (rollout.tools,
rollout.environment) turns (a row per sampled assistant turn: its token span in the rollout's response_ids, tool calls,
observation, tool seconds, error) and episodes (how each ended, its conversation, its environment's final state);
draws with dynamic sampling; with partial rollouts (rollout.segment_tokens) segments (a row per response an iteration
held: its tokens before and after, those sampled there, released, finished or carried, its group's start) and carried
(the responses handed on to the next iteration, whole); columns as declared in `schemas/tables.py`. A view with
nothing committed is empty, not missing. In a fork (`grpo fork`, `grpo rescore`) the parent's views too, as
`parent.rewards` and so on, and `rescore` (RESCORE_VIEW): per sample of the iterations both runs share, the reward and
advantage before and after.

    grpo query --run r1-fix "SELECT iteration, count(*) FILTER (WHERE reward_changed) FROM rescore GROUP BY 1"
    grpo query --run agent "SELECT iteration, avg(tool_errors), sum(len(tool_names)) FROM turns GROUP BY 1"

Several runs at once (`--run` again): each further run's views in a schema of its name, and all of them in
`runs.<view>` with a `run` column:

    grpo query --run r1 --run r1-gspo "SELECT run, iteration, avg(reward) FROM runs.rewards GROUP BY ALL ORDER BY 2"

And `io`, from the manifests: what each committed stage moved through storage (its `io` record, one
row per stage and iteration, the base's iteration null):

    grpo query --run r1 "SELECT stage, sum(read_bytes + download_bytes) AS bytes_in FROM io GROUP BY 1"
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo.config import load_config
from grpo.errors import LayoutError
from grpo.record.counts import IoCounts, is_local
from grpo.record.fork import fork_of, origin
from grpo.record.layout import no_such_run, run_dir, run_json, stage_dir
from grpo.record.storage import (
    Committed,
    CorruptArtifactError,
    NotCommittedError,
    Storage,
    committed_attempts,
    latest_committed,
    load_manifest,
    verify_files,
)
from schemas.files import OPTIONAL_TABLES, RUN_TABLES, TABLE_FILES

if TYPE_CHECKING:  # imported where used: training and `grpo status` import this module (grpo.report)
    import duckdb
    import pandas as pd

VIEWS = dict(TABLE_FILES)  # view = table name
_ITER = re.compile(r"iter-(\d+)$")


def iterations(storage: Storage, run_id: str) -> list[int]:
    """Iterations with a folder in the run, ascending (committed or not)."""
    rdir = run_dir(storage, run_id)
    if not storage.exists(run_json(storage, run_id)):
        raise LayoutError(no_such_run(storage, run_id))
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in storage.fs.ls(rdir, detail=False)]
    return sorted(int(m.group(1)) for n in names if (m := _ITER.match(n)))


def committed_files(storage: Storage, run_id: str, verify: bool = True) -> dict[str, list[str]]:
    """URIs each view reads: per iteration, the file of the stage's newest committed attempt.

    Iterations where the stage has no committed attempt are skipped. With `verify`,
    each listed file's size and sha256 are checked against its manifest (only
    the files read: the learner's checkpoint is not hashed).
    """
    out: dict[str, list[str]] = {view: [] for view in VIEWS}
    stages = sorted({stage for view, (stage, _) in VIEWS.items() if view not in RUN_TABLES})
    for view in RUN_TABLES:  # a stage the run commits once (the warm start)
        stage, name = VIEWS[view]
        if (once := _newest(storage, stage_dir(storage, run_id, None, stage))) is not None:
            out[view].append(storage.uri(_committed_file(once, name, verify)))
    for k in iterations(storage, run_id):
        newest = {stage: _newest(storage, stage_dir(storage, run_id, k, stage)) for stage in stages}
        for view, (stage, name) in VIEWS.items():
            if view in RUN_TABLES:
                continue
            optional = view in OPTIONAL_TABLES and newest[stage] is not None
            if optional and name not in [f.path for f in newest[stage].manifest.files]:
                continue
            if newest[stage] is not None:
                out[view].append(storage.uri(_committed_file(newest[stage], name, verify)))
    return out


IO_COLUMNS = ["iteration", "stage", "attempt", *(f.name for f in dataclasses.fields(IoCounts))]


def io_records(storage: Storage, run_id: str) -> list[dict]:
    """The `io` view's rows: per committed stage (the base, and each stage and shard of each iteration: the newest
    attempt), its manifest's io record; the counts of a manifest written before the record existed are None."""
    rows, rdir = [], run_dir(storage, run_id)
    once = [(None, f"{rdir}/base"), (None, f"{rdir}/sft")]  # the stages a run commits once (sft: a warm start)
    folders = once + [(k, f"{rdir}/iter-{k:04d}") for k in iterations(storage, run_id)]
    for k, folder in folders:
        sdirs = [folder] if k is None else sorted(storage.fs.ls(folder, detail=False))
        for sdir in sdirs:
            try:
                found = latest_committed(storage, sdir.rstrip("/"), verify=False)
            except NotCommittedError:
                continue
            io = found.manifest.io or {}
            name = found.attempt_dir.rsplit("/", 1)[-1]
            rows.append(
                {c: None for c in IO_COLUMNS} | io | {"iteration": k, "stage": found.manifest.stage, "attempt": name}
            )
    return rows


def io_rows(storage: Storage, run_id: str) -> pd.DataFrame:
    """io_records as a DataFrame (the iteration null for the base)."""
    import pandas as pd

    return pd.DataFrame(io_records(storage, run_id), columns=IO_COLUMNS).astype({"iteration": "Int64"})


def _io_table(con, storage: Storage, run_id: str) -> None:
    """The `io` view in `con`, from io_records (no DataFrame: `grpo query` prints without pandas)."""
    types = {"iteration": "BIGINT", "stage": "VARCHAR", "attempt": "VARCHAR"}
    types |= {f.name: "BIGINT" if f.type in (int, "int") else "DOUBLE" for f in dataclasses.fields(IoCounts)}
    con.execute("CREATE TABLE _io (" + ", ".join(f"{c} {types[c]}" for c in IO_COLUMNS) + ")")
    rows = [[r[c] for c in IO_COLUMNS] for r in io_records(storage, run_id)]
    if rows:  # one statement: DuckDB's executemany costs ~2 ms a row
        one = f"({', '.join('?' * len(IO_COLUMNS))})"
        con.execute(f"INSERT INTO _io VALUES {', '.join([one] * len(rows))}", [v for row in rows for v in row])
    con.execute('CREATE VIEW "io" AS SELECT * FROM _io')


def _newest(storage: Storage, sdir: str) -> Committed | None:
    """The newest committed attempt; None where there is none, or it is an eval eval.every skipped (no table)."""
    try:
        found = latest_committed(storage, sdir, verify=False)  # files are checked one by one below
    except NotCommittedError:
        return None
    return None if found.manifest.summary.get("skipped") else found


def _committed_file(committed: Committed, name: str, verify: bool) -> str:
    """fs path of `name` in a committed attempt, its size and sha256 checked with `verify`."""
    try:
        entry = committed.manifest.file(name)
    except KeyError as e:
        raise CorruptArtifactError(f"{committed.uri}: {e.args[0]}") from e
    if verify:
        only = dataclasses.replace(committed.manifest, files=[entry])
        verify_files(committed.storage, committed.attempt_dir, only)
    return committed.path(name)


def _duckdb_path(storage: Storage, uri: str) -> str:
    """DuckDB reads local files by path and others through the registered fsspec filesystem."""
    return uri[len("file://") :] if is_local(storage.fs) and uri.startswith("file://") else uri


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def connect(
    storage: Storage, run_id: str, verify: bool = True, others: tuple[str, ...] = ()
) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with one view per table over the committed files; in a fork (grpo.record.fork)
    also the parent's, as `parent.<view>`, and `rescore` over both. With `others` (more runs: a parent and its
    forks), each one's views in a schema named after it (`"demo-gspo".rewards`), and every run's rows in
    `runs.<view>` with a `run` column."""
    import duckdb

    others = tuple(r for r in dict.fromkeys(others) if r != run_id)
    if clash := [r for r in others if r.lower() in RESERVED]:
        raise LayoutError(f"run {clash[0]}: a schema of that name is taken ({', '.join(RESERVED)}); query it as --run")
    con = duckdb.connect()
    if not is_local(storage.fs):
        con.register_filesystem(storage.fs)  # no httpfs needed: DuckDB reads through s3fs
    _create_views(con, storage, run_id, verify, "main")
    _io_table(con, storage, run_id)
    fork = fork_of(storage, run_id)
    if fork is not None:
        con.execute("CREATE SCHEMA parent")
        _create_views(con, storage, fork["parent"], verify, "parent")
        shared = shared_rollouts(storage, run_id, fork["parent"])
        where = f"a.iteration IN ({', '.join(map(str, shared))})" if shared else "FALSE"
        con.execute(RESCORE_VIEW.format(where=where))
    for other in others:
        con.execute(f"CREATE SCHEMA {_ident(other)}")
        _create_views(con, storage, other, verify, other)
    if others:
        con.execute("CREATE SCHEMA runs")
        schemas = {run_id: "main", **{r: r for r in others}}
        for view in VIEWS:
            parts = [f'SELECT {_sql_str(r)} AS run, * FROM {_ident(s)}."{view}"' for r, s in schemas.items()]
            con.execute(f'CREATE VIEW runs."{view}" AS ' + " UNION ALL BY NAME ".join(parts))
    return con


RESERVED = ("main", "parent", "runs")
"""Schemas of a connection: a run of these names is queried as the first --run only."""


def _ident(name: str) -> str:
    """`name` as a DuckDB identifier, quoted (a run id may hold '-', '.', quotes)."""
    return '"' + name.replace('"', '""') + '"'


RESCORE_VIEW = """CREATE VIEW rescore AS
SELECT a.iteration, a.prompt_id, a.sample_index,
       p.reward AS reward_before, a.reward AS reward_after,
       p.advantage AS advantage_before, a.advantage AS advantage_after,
       a.reward IS DISTINCT FROM p.reward AS reward_changed,
       sign(a.advantage) * sign(p.advantage) < 0 AS advantage_flipped
FROM main.advantages a JOIN parent.advantages p USING (iteration, prompt_id, sample_index)
WHERE {where}"""
"""A fork's samples beside its parent's, in the iterations whose rollouts both runs share (the same committed
file: a rescore, `grpo rescore`, or a fork's iterations before it diverged): each sample's reward and advantage
in the parent (before) and the fork (after), whether the reward changed and whether the advantage's sign
flipped (positive to negative or back; a zero advantage flips nothing)."""


def shared_rollouts(storage: Storage, run_id: str, parent: str) -> list[int]:
    """The iterations whose newest committed rollouts are the same in both runs (one's taken by reference)."""
    out = []
    for k in sorted(set(iterations(storage, run_id)) & set(iterations(storage, parent))):
        a, b = (_newest(storage, stage_dir(storage, r, k, "rollouts")) for r in (run_id, parent))
        if a is not None and b is not None and origin(a) == origin(b):
            out.append(k)
    return out


def _create_views(con, storage: Storage, run_id: str, verify: bool, schema: str) -> None:
    """One view per table of `run_id` in `schema` (main: unqualified) over its committed files."""
    from schemas.tables import SCHEMAS

    files = committed_files(storage, run_id, verify=verify)
    into, empty = _ident(schema), _ident(f"_empty_{schema}")
    con.execute(f"CREATE SCHEMA {empty}")
    for view, uris in files.items():
        if uris:
            paths = ", ".join(_sql_str(_duckdb_path(storage, u)) for u in uris)
            # by name: a run's older files lack the columns added since (schemas.tables), which read as null there
            con.execute(f'CREATE VIEW {into}."{view}" AS SELECT * FROM read_parquet([{paths}], union_by_name = true)')
        else:  # typed and empty, so `SELECT count(*) FROM rollouts` is 0 rather than an error
            columns = ", ".join(f'"{f.name}" {duckdb_type(f.type)}' for f in SCHEMAS[view])
            con.execute(f'CREATE TABLE {empty}."{view}" ({columns})')
            con.execute(f'CREATE VIEW {into}."{view}" AS SELECT * FROM {empty}."{view}"')


def duckdb_type(arrow_type) -> str:
    """An Arrow type of schemas/tables.py as DuckDB declares it (an empty view made without handing DuckDB an Arrow
    table, which would load pandas: seconds of `grpo query`).

    >>> import pyarrow as pa
    >>> duckdb_type(pa.list_(pa.float32())), duckdb_type(pa.map_(pa.string(), pa.float64()))
    ('FLOAT[]', 'MAP(VARCHAR, DOUBLE)')
    >>> duckdb_type(pa.list_(pa.struct([("verdict", pa.string()), ("score", pa.float64())])))
    'STRUCT(verdict VARCHAR, score DOUBLE)[]'
    """
    import pyarrow as pa

    if pa.types.is_map(arrow_type):
        return f"MAP({duckdb_type(arrow_type.key_type)}, {duckdb_type(arrow_type.item_type)})"
    if pa.types.is_list(arrow_type):
        return f"{duckdb_type(arrow_type.value_type)}[]"
    if pa.types.is_struct(arrow_type):  # the judge table's verdicts
        return f"STRUCT({', '.join(f'{f.name} {duckdb_type(f.type)}' for f in arrow_type)})"
    return DUCKDB_TYPES[str(arrow_type)]


DUCKDB_TYPES = {
    "string": "VARCHAR",
    "bool": "BOOLEAN",
    "int8": "TINYINT",
    "int32": "INTEGER",
    "int64": "BIGINT",
    "float": "FLOAT",
    "double": "DOUBLE",
}
"""The plain Arrow types of schemas/tables.py, as DuckDB names them (tests/test_cli_speed.py checks every table)."""


def query(storage: Storage, run_id: str, sql: str, verify: bool = True, others: tuple[str, ...] = ()) -> pd.DataFrame:
    """Run `sql` over the views of `run_id` (and of `others`: connect); duckdb.Error on bad SQL."""
    con = connect(storage, run_id, verify=verify, others=others)
    try:
        return con.execute(sql).df()
    finally:
        con.close()


@dataclass(frozen=True)
class Best:
    """The best iteration so far: the highest eval.metric among committed evals (skipped ones have none)."""

    iteration: int
    metric: str
    """eval.metric as the eval summary names it (config.EvalConfig.metric_key): exact_match, avg@4, ..."""
    value: float
    all_zero: bool = False
    """Every eval considered scored 0 on the metric: none is better than another, so none is claimed best (the
    report, `grpo status`, `grpo export --best`)."""

    def __str__(self) -> str:
        return f"iteration {self.iteration} ({self.metric} {self.value:.4g})"


def eval_metric(storage: Storage, run_id: str) -> str:
    """The run's eval.metric as the eval summary names it (read from run.json alone)."""
    return load_config(json.loads(storage.read_bytes(run_json(storage, run_id)))["config"]).eval.metric_key


def best_iteration(storage: Storage, run_id: str, among: list[int] | None = None) -> Best | None:
    """The iteration (of `among`, default every one) whose newest committed eval has the highest eval.metric;
    ties: the higher eval mean reward, then the later iteration. None before the first eval that ran."""
    metric, scores = eval_metric(storage, run_id), {}
    for k in iterations(storage, run_id) if among is None else among:
        attempts = committed_attempts(storage, stage_dir(storage, run_id, k, "eval"))
        summary = load_manifest(storage, attempts[-1], verify=False)[0].summary if attempts else {}
        if isinstance(summary.get(metric), (int, float)):
            scores[k] = (summary[metric], summary.get("reward_mean") or 0.0, k)
    if not scores:
        return None
    k = max(scores, key=scores.__getitem__)
    return Best(k, metric, float(scores[k][0]), all_zero=all(v[0] == 0 for v in scores.values()))
