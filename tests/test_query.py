"""`grpo query`: DuckDB views over committed outputs only, on file:// and S3."""

import pyarrow.parquet as pq
import pytest
from test_schemas import rollout_row
from test_stages import make_run

from flows.cli import main
from grpo.query import committed_files, connect, query
from grpo.record.commit import StageWriter
from grpo.record.layout import stage_dir
from grpo.record.storage import CorruptArtifactError, latest_committed, list_attempts, open_storage
from schemas import read_parquet, write_parquet
from schemas.files import OPTIONAL_TABLES
from stages import STAGES, StageError, stage_function


@pytest.fixture(scope="module")
def env():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module", params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def storage(request, tmp_path_factory, env):
    """One storage per backend for the module; the CLI tests reopen it from its URL."""
    base = tmp_path_factory.mktemp("query")
    if request.param == "file":
        return open_storage((base / "store").as_uri())
    s3 = request.getfixturevalue("s3")
    for k, v in s3.env().items():
        env.setenv(k, v)
    return open_storage(s3.url(base.name))


@pytest.fixture(scope="module")
def run(storage):
    """Run "q": iteration 0 complete, iteration 1 up to rollouts (slow to make: shared by the module)."""
    make_run(storage, "q")
    for stage in STAGES:
        stage_function(stage)(storage, "q", 0)
    for stage in ("snapshot", "rollouts"):
        stage_function(stage)(storage, "q", 1)
    return storage


def num_rows(storage, uri):
    with storage.fs.open(uri, "rb") as f:
        return pq.ParquetFile(f).metadata.num_rows


def crash(storage, run_id, iteration, stage, name, table, rows):
    """Write `rows` into a new attempt that never commits, as a writer killed before its manifest."""
    w = StageWriter(
        storage,
        stage_dir(storage, run_id, iteration, stage),
        run_id=run_id,
        iteration=iteration,
        stage=stage,
        config={"crashed": True},
        inputs={},
    )
    write_parquet(storage.fs, w.path(name), table, rows)
    return w


def test_counts_match_committed_parquet(run):
    files = committed_files(run, "q")
    assert {v: len(u) for v, u in files.items()} == {
        "rollouts": 2,
        "draws": 0,  # only with rollout.min_signal_groups
        "turns": 0,  # these two only with episodes (rollout.tools, rollout.environment: tests/test_episodes.py)
        "episodes": 0,
        "segments": 0,  # these two only with rollout.segment_tokens (tests/test_segments.py)
        "carried": 0,
        "rewards": 1,
        "judge": 0,  # only with reward.judge (tests/test_judge.py)
        "advantages": 1,
        "teacher": 0,  # these two only with a teacher section (tests/test_teacher.py)
        "token_advantages": 0,
        "logprobs": 1,
        "learn_metrics": 1,
        "eval": 1,
        "sft": 0,  # these two only with a warm start (sft: tests/test_sft.py)
        "sft_metrics": 0,
    }
    con = connect(run, "q")
    for view, uris in files.items():
        expected = sum(num_rows(run, u) for u in uris)
        assert expected > 0 or view in (*OPTIONAL_TABLES, "teacher", "sft", "sft_metrics")
        assert con.execute(f'SELECT count(*) FROM "{view}"').fetchall() == [(expected,)], view
    assert con.execute("SELECT iteration, count(*) FROM rollouts GROUP BY 1 ORDER BY 1").fetchall() == [
        (0, 64),
        (1, 64),
    ]


def test_crashed_attempts_are_not_seen(run):
    ro = latest_committed(run, stage_dir(run, "q", 0, "rollouts"))
    table = read_parquet(run.fs, ro.path("rollouts.parquet"), "rollouts")
    fake = table.to_pydict()
    fake["prompt_id"] = [p + 10_000 for p in fake["prompt_id"]]
    before = query(run, "q", "SELECT count(*) AS n, max(prompt_id) AS top FROM rollouts")
    crash(run, "q", 0, "rollouts", "rollouts.parquet", "rollouts", fake)  # beside a committed attempt
    crash(run, "q", 1, "rewards", "rewards.parquet", "rewards", [])  # the only attempt of a stage
    crash(run, "q", 2, "rollouts", "rollouts.parquet", "rollouts", fake)  # an iteration with nothing committed
    assert len(list_attempts(run, stage_dir(run, "q", 0, "rollouts"))) == 2
    after = query(run, "q", "SELECT count(*) AS n, max(prompt_id) AS top FROM rollouts")
    assert after.equals(before) and after.top[0] < 10_000
    assert len(committed_files(run, "q")["rewards"]) == 1


def test_join_rollouts_rewards(run):
    sql = (
        "SELECT r.prompt_id, avg(w.reward) AS reward, count(*) AS n FROM rollouts r "
        "JOIN rewards w USING (prompt_id, sample_index, iteration) GROUP BY 1 ORDER BY 1"
    )
    df = query(run, "q", sql)
    assert len(df) == 16 and (df.n == 4).all()  # iteration 1 has no rewards: only iteration 0 joins
    rewards = read_parquet(
        run.fs, latest_committed(run, stage_dir(run, "q", 0, "rewards")).path("rewards.parquet"), "rewards"
    ).to_pandas()
    expected = rewards.groupby("prompt_id").reward.mean()
    assert df.reward.tolist() == pytest.approx(expected.loc[df.prompt_id].tolist())
    # the advantages stage's copy of the reward agrees with the rewards stage
    assert (
        query(
            run,
            "q",
            "SELECT count(*) AS bad FROM advantages a JOIN rewards w "
            "USING (iteration, prompt_id, sample_index) WHERE a.reward != w.reward",
        ).bad[0]
        == 0
    )


def test_cli_prints_table_and_bad_sql_exits_2(run, capsys):
    url = run.url
    assert (
        main(
            [
                "--storage",
                url,
                "query",
                "--run",
                "q",
                "SELECT iteration, count(*) AS n FROM rollouts GROUP BY 1 ORDER BY 1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.split("\n")
    assert out[0].split() == ["iteration", "n"] and out[1].split() == ["0", "64"] and out[2].split() == ["1", "64"]
    assert main(["--storage", url, "query", "--run", "q", "SELECT * FROM rewards WHERE false"]) == 0
    assert "no rows" in capsys.readouterr().out
    assert main(["--storage", url, "query", "--run", "q", "SELEC nonsense"]) == 2
    assert "query failed" in capsys.readouterr().err
    assert main(["--storage", url, "query", "--run", "q", "SELECT * FROM no_such_view"]) == 2
    assert "no_such_view" in capsys.readouterr().err
    assert main(["--storage", url, "query", "--run", "nope", "SELECT 1"]) == 2
    assert "no such run" in capsys.readouterr().err


def _fake_run(storage, run_id):
    """A run folder without a model: enough for the query layer, fast to make."""
    path = storage.path("runs", run_id, "run.json")
    storage.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    storage.fs.pipe_file(path, b"{}")


def _commit_rewards(storage, run_id, iteration, n):
    rows = {
        "run_id": [run_id] * n,
        "iteration": [iteration] * n,
        "prompt_id": list(range(n)),
        "sample_index": [0] * n,
        "reward": [1.0] * n,
        "components": [{}] * n,
        "error": [None] * n,
    }
    w = StageWriter(
        storage,
        stage_dir(storage, run_id, iteration, "rewards"),
        run_id=run_id,
        iteration=iteration,
        stage="rewards",
        config={"n": n},
        inputs={},
    )
    write_parquet(storage.fs, w.path("rewards.parquet"), "rewards", rows)
    return w.commit()


def test_newest_committed_attempt_wins_and_hashes_are_checked(storage):
    _fake_run(storage, "w")
    _commit_rewards(storage, "w", 0, 2)
    newest = _commit_rewards(storage, "w", 0, 3)  # a forced rerun: the old attempt stays beside it
    _commit_rewards(storage, "w", 3, 5)  # iterations 1-2 have nothing: skipped
    assert query(
        storage, "w", "SELECT iteration, count(*) AS n FROM rewards GROUP BY 1 ORDER BY 1"
    ).values.tolist() == [[0, 3], [3, 5]]
    path = newest.path("rewards.parquet")
    good = storage.read_bytes(path)
    storage.fs.pipe_file(path, good[:4] + bytes([good[4] ^ 1]) + good[5:])  # one bit off in the data
    with pytest.raises(CorruptArtifactError, match="sha256"):
        connect(storage, "w")
    assert main(["--storage", storage.url, "query", "--run", "w", "SELECT 1"]) == 2
    connect(storage, "w", verify=False)  # opt-out: no hash check (DuckDB only reads footers here)
    storage.fs.pipe_file(path, good)


def test_nothing_committed_gives_empty_typed_views(storage):
    _fake_run(storage, "e")
    crash(storage, "e", 0, "rollouts", "rollouts.parquet", "rollouts", [])
    con = connect(storage, "e")
    for view in ("rollouts", "rewards", "advantages", "logprobs", "learn_metrics", "eval"):
        assert con.execute(f'SELECT count(*) FROM "{view}"').fetchall() == [(0,)]
    assert query(storage, "e", "SELECT avg(reward) AS r FROM rewards").r.isna().all()
    cols = [c for c, *_ in con.execute("DESCRIBE rollouts").fetchall()]
    assert cols[:4] == ["run_id", "iteration", "prompt_id", "sample_index"]
    with pytest.raises(StageError, match="no such run"):
        connect(storage, "nope")


def test_a_run_whose_older_files_lack_a_column_added_since_reads_it_as_null_there(storage):
    """A run committed before rollouts.loss_mask and continued after: its older files hold no such column, the view
    has it (null in those rows)."""
    import pyarrow as pa

    from schemas.tables import ROLLOUTS_V4

    _fake_run(storage, "v")
    for k in (0, 1):
        w = StageWriter(
            storage, stage_dir(storage, "v", k, "rollouts"), run_id="v", iteration=k, stage="rollouts",
            config={}, inputs={},
        )  # fmt: skip
        row = rollout_row() | {"run_id": "v", "iteration": k}
        if k == 0:  # as the code before loss_mask wrote it
            del row["loss_mask"]
            old = pa.Table.from_pylist([row], schema=ROLLOUTS_V4)
            with storage.fs.open(w.path("rollouts.parquet"), "wb") as f:
                meta = {b"grpo.table": b"rollouts", b"grpo.schema_version": b"4"}
                pq.write_table(old.replace_schema_metadata(meta), f)
        else:
            write_parquet(storage.fs, w.path("rollouts.parquet"), "rollouts", [row])
        w.commit()
    got = query(storage, "v", "SELECT iteration, loss_mask FROM rollouts ORDER BY 1")
    assert got.iteration.tolist() == [0, 1] and got.loss_mask.isna().tolist() == [True, False]
    assert list(got.loss_mask[1]) == [1, 1, 1]
