"""Asynchronous iterations (rollout.staleness >= 1): with learn on a stage worker of its own, the flow samples
iteration k+1 (and evaluates iteration k) while learn k runs, and commits exactly what the same run commits
stage after stage in one process: which policy sampled which rows is fixed by the config, never by the overlap."""

import datetime as dt
import json
from pathlib import Path

import pandas as pd
import pytest
from test_stage_workers_e2e import run_beside_workers
from test_stages import TINY

from flows.cli import main
from grpo.record.layout import run_dir, stage_dir
from grpo.record.storage import latest_committed, open_storage
from grpo.report import overlaps, stage_times
from stages.common import load_run
from stages.init import init_run
from stages.iteration import run_iteration

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
ITERATIONS = 3
OVERRIDES = TINY + ["rollout.staleness=1"]


def committed(storage, run_id: str, k: int, stage: str):
    return latest_committed(storage, stage_dir(storage, run_id, k, stage))


def when(c, key: str) -> dt.datetime:
    return dt.datetime.fromisoformat(getattr(c.manifest, key))


def test_stale_iterations_sample_while_the_placed_learner_runs_and_commit_what_in_order_ones_do(tmp_path):
    store = (tmp_path / "store").as_uri()
    params = {"run_id": "a", "overrides": OVERRIDES, "storage_url": store, "iterations": ITERATIONS}
    out = run_beside_workers(tmp_path, [["learn"]], params | {"placement": {"learn": "warm"}})  # the learner's machine
    storage = open_storage(store)
    assert json.loads(out.strip().splitlines()[-1])["eval"].startswith(store)  # the last iteration's URIs

    # iteration k+1 sampled while learn k ran: its rollouts began before learn k committed; `grpo timeline` shows it
    assert overlaps(stage_times(storage, "a")), "no iteration sampled while the previous learn ran"
    assert main(["--storage", store, "timeline", "--run", "a"]) == 0
    assert storage.exists(f"{run_dir(storage, 'a')}/timeline.png")
    # at most one learn at a time: learn k+1 began after learn k committed
    for k in range(ITERATIONS - 1):
        assert when(committed(storage, "a", k + 1, "learn"), "started_at") >= when(
            committed(storage, "a", k, "learn"), "committed_at"
        )

    init_run(storage, "in-order", load_run(storage, "a"))
    for k in range(ITERATIONS):
        single = run_iteration(storage, "in-order", k)
        rows = [
            pd.read_parquet(c.path("rollouts.parquet")).drop(columns=["run_id"])
            for c in (committed(storage, "a", k, "rollouts"), single["rollouts"])
        ]
        pd.testing.assert_frame_equal(*rows)
        assert rows[0]["policy_version"].tolist() == [max(k - 2, -1)] * len(rows[0])  # learn k-1-S (S = 1), or the base
        a, b = (
            Path(c.path("policy/model.safetensors")).read_bytes()
            for c in (committed(storage, "a", k, "learn"), single["learn"])
        )
        assert a == b
