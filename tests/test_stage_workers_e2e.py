"""Long-lived stage workers (flows/stage_worker.py): two Prefect task workers, one serving the "GPU"
stages (rollouts, learn, eval) and one the rest, keep what they load between iterations, and a third
serves rewards too; a flow run with every stage placed on `warm`, rollouts and rewards in two shards
each, commits what the unsharded stages commit in one process, and its second iteration's learner comes
from the worker's memory."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from test_placement_e2e import unsharded
from test_stages import TINY

from grpo.record.layout import stage_dir
from grpo.record.storage import latest_committed, open_storage
from grpo.runtime.procs import stop_group
from stages.common import load_run
from stages.init import init_run
from stages.iteration import run_iteration
from tools.prefect_server import prefect_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
WORKERS = [["rollouts", "learn", "eval"], ["snapshot", "rewards", "advantages"], ["rewards"]]
OVERRIDES = TINY + ["rollout.chunk_prompts=8", "rollout.shards=2", "reward.shards=2"]
WARM = {s: "warm" for s in ("snapshot", "rollouts", "rewards", "advantages", "learn", "eval")}
TABLES = {"rollouts": "rollouts.parquet", "rewards": "rewards.parquet", "advantages": "advantages.parquet"}


def run_beside_workers(tmp_path, workers: list[list[str]], params: dict) -> str:
    """The flow `grpo(**params)` in a process of its own, beside a stage worker serving each list of `workers`, all on
    a Prefect server started here; the flow's stdout (its last line: the returned URIs as JSON). Every process it
    started is stopped."""
    with prefect_server(tmp_path / "prefect") as server:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "flows.stage_worker", *stages],
                cwd=REPO,
                env=server.env,
                stdout=open(tmp_path / f"worker-{i}.log", "wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            for i, stages in enumerate(workers)
        ]
        try:
            code = "import json, sys; from flows.grpo import grpo; print(json.dumps(grpo(**json.loads(sys.argv[1]))))"
            out = subprocess.run(
                [sys.executable, "-c", code, json.dumps(params)],
                cwd=REPO,
                env=server.env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            logs = "\n".join(
                (tmp_path / f"worker-{i}.log").read_text(errors="replace")[-3000:] for i in range(len(workers))
            )
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + logs
        finally:
            for w in procs:
                stop_group(w)
    return out.stdout


def test_flow_on_warm_stage_workers_commits_what_one_process_does_and_keeps_the_learner(tmp_path):
    store = (tmp_path / "store").as_uri()
    params = {"run_id": "w", "overrides": OVERRIDES, "storage_url": store, "iterations": 2, "placement": WARM}
    run_beside_workers(tmp_path, WORKERS, params)
    storage = open_storage(store)
    learn = [latest_committed(storage, stage_dir(storage, "w", k, "learn")) for k in (0, 1)]
    assert [c.manifest.summary["warm_learner"] for c in learn] == [False, True]  # kept by the worker
    init_run(storage, "single", unsharded(load_run(storage, "w")))
    for k in (0, 1):
        single = run_iteration(storage, "single", k)
        for stage, name in TABLES.items():
            warm = latest_committed(storage, stage_dir(storage, "w", k, stage))
            read = lambda c: pd.read_parquet(c.path(name)).drop(columns=["run_id"])  # noqa: E731
            pd.testing.assert_frame_equal(read(warm), read(single[stage]))
        a, b = (Path(c.path("policy/model.safetensors")).read_bytes() for c in (learn[k], single["learn"]))
        assert a == b
