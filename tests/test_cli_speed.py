"""The CLI answers at once: each command loads what it uses and nothing more. `grpo --help`, `grpo status` and a
rerun of a finished `grpo demo` import none of torch, transformers, vLLM, Prefect, pyarrow, pandas, DuckDB or
matplotlib, and `grpo query` only DuckDB and pyarrow; each checked in a fresh process through sys.modules, not
timed (benchmarks/RESULTS.md, "The CLI's own start", has the timings)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_stages import TINY

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("GRPO_", "VLLM_"))}
HEAVY = ("torch", "transformers", "vllm", "prefect", "pyarrow", "pandas", "duckdb", "matplotlib")
SETS = [a for kv in TINY for a in ("--set", kv)]

LOADED = """
import json, sys
from flows.cli import main
try:
    rc = main(sys.argv[2:])
except SystemExit as e:  # --help
    rc = e.code
with open(sys.argv[1], "w") as f:
    json.dump({"rc": rc, "heavy": [m for m in %r if m in sys.modules]}, f)
""" % (HEAVY,)


def loaded(tmp_path, *args, env=None) -> tuple[int, list[str], str]:
    """(exit code, the HEAVY packages imported, stdout) of `grpo --storage tmp_path/store ARGS` in a new process."""
    out = tmp_path / "loaded.json"
    proc = subprocess.run(
        [sys.executable, "-c", LOADED, str(out), "--storage", str(tmp_path / "store"), *args],
        cwd=ROOT,
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.exists(), proc.stderr
    found = json.loads(out.read_text())
    return found["rc"], found["heavy"], proc.stdout


def test_help_imports_no_heavy_package(tmp_path):
    rc, heavy, out = loaded(tmp_path, "--help")
    assert rc == 0 and "grpo init --run demo" in out
    assert heavy == []


@pytest.fixture(scope="module")
def finished_demo(tmp_path_factory):
    """A demo run of one iteration whose eval reached its target (0: any eval does)."""
    tmp = tmp_path_factory.mktemp("speed")
    rc, _, _ = loaded(tmp, "--threads", "1", "demo", "--iterations", "1", "--target", "0", *SETS)
    assert rc == 0
    return tmp


def test_status_and_a_finished_demo_import_no_heavy_package(finished_demo):
    rc, heavy, out = loaded(finished_demo, "--threads", "1", "status", "--run", "demo")
    assert rc == 0 and "ok x1" in out and "newest policy: iteration 0" in out
    assert heavy == []
    rc, heavy, out = loaded(finished_demo, "demo", "--iterations", "1", "--target", "0", *SETS)
    assert rc == 0 and "already, at iteration 0" in out
    assert heavy == []


def test_query_imports_duckdb_and_pyarrow_alone(finished_demo):
    sql = "SELECT iteration, count(*) AS n, (SELECT count(*) FROM draws) AS d FROM rollouts GROUP BY 1"
    rc, heavy, out = loaded(finished_demo, "query", "--run", "demo", sql)
    assert rc == 0 and out.split() == ["iteration", "n", "d", "0", "64", "0"]
    assert heavy == ["pyarrow", "duckdb"]  # pyarrow: the empty draws view's types
    rc, heavy, out = loaded(finished_demo, "query", "--run", "demo", "SELECT stage, write_bytes > 0 AS w FROM io")
    assert rc == 0 and ["learn", "True"] in [line.split() for line in out.splitlines()]


def test_the_thread_count_reaches_torch_when_it_loads_after_the_setting():
    """`grpo --threads 7` sets nothing in torch until a command loads it; then torch has the count at once (7: no
    machine's own count)."""
    code = (
        "import sys; from grpo.runtime import threads; threads.apply_threads(); assert 'torch' not in sys.modules; "
        "import torch; print(torch.get_num_threads())"
    )
    env = {k: v for k, v in ENV.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")} | {"GRPO_THREADS": "7"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.split() == ["7"], done.stderr


def test_import_grpo_and_its_train_load_no_heavy_package():
    """`from grpo import train` loads the API's module, not what training needs (that loads when train runs)."""
    code = f"import sys, grpo; from grpo import train; print([m for m in {HEAVY!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


def test_every_tables_empty_view_has_the_types_duckdb_reads_from_arrow():
    """The DDL of an empty view (grpo.query.duckdb_type) against DuckDB's own reading of each Arrow schema."""
    import duckdb

    from grpo.query import duckdb_type
    from schemas.tables import SCHEMAS

    con = duckdb.connect()
    for name, schema in SCHEMAS.items():
        con.execute(f"CREATE TABLE ddl_{name} ({', '.join(f'{f.name} {duckdb_type(f.type)}' for f in schema)})")
        con.register("arrow", schema.empty_table())
        con.execute(f"CREATE TABLE arrow_{name} AS SELECT * FROM arrow")
        con.unregister("arrow")
        sql = "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = ? ORDER BY 1"
        assert con.execute(sql, [f"ddl_{name}"]).fetchall() == con.execute(sql, [f"arrow_{name}"]).fetchall(), name
