"""Stages across machines, end to end on real servers: a Prefect server, two process work pools ("gpu",
one stage at a time; "cpu") with a worker each in its own working folder, the local S3 server as the only
thing they share, and a run of `grpo/placed` (one iteration), with rollouts and rewards in two shards each
(a flow run each). Every committed row and checkpoint equals what the stages commit in one process,
unsharded. That a second iteration waits for the first is the deployments' concurrency limit, tested end to
end on `grpo/iteration` (tests/test_flow_e2e.py); `test_placed_iterations_run_one_at_a_time` checks that
`grpo/placed` sets the same limit."""

import dataclasses
import hashlib
import json
import re
from datetime import datetime
from pathlib import Path

import pandas as pd
import pytest
import yaml
from test_stages import TINY

from grpo.record.layout import stage_dir
from grpo.record.storage import latest_committed, open_storage
from stages.init import init_run
from stages.iteration import run_iteration
from tools.prefect_server import prefect_server, process_worker

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.s3]

REPO = Path(__file__).resolve().parent.parent
PLACEMENT = {"snapshot": "cpu", "rollouts": "gpu", "rewards": "cpu", "advantages": "cpu", "learn": "gpu", "eval": "gpu"}
TABLES = {"rollouts": "rollouts.parquet", "rewards": "rewards.parquet", "advantages": "advantages.parquet"}
SHARDS = {"rollouts": 2, "rewards": 2}  # each shard a flow run on the stage's pool
OVERRIDES = TINY + ["rollout.chunk_prompts=8", "rollout.shards=2", "reward.shards=2"]


def placed_run(server, storage_url: str, run_id: str) -> str:
    out = server.cli(
        "deployment",
        "run",
        "grpo/placed",
        "--params",
        json.dumps({"run_id": run_id, "overrides": OVERRIDES}),
        "--job-variable",
        "env=" + json.dumps({"GRPO_STORAGE": storage_url}),
    ).stdout
    return re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)


def stage_runs(server) -> list[dict]:
    """Every flow run of the flow grpo-stage: name, work pool, start and end."""
    runs = server.api("POST", "/flow_runs/filter", {"flow_runs": {"name": {"like_": " "}}, "limit": 200})
    return [r for r in runs if r.get("work_pool_name") in ("gpu", "cpu") and r["start_time"] and r["end_time"]]


def content(storage, committed, name: str) -> pd.DataFrame:
    return pd.read_parquet(storage.fs.open(committed.path(name), "rb")).drop(columns=["run_id"])


def sha256(storage, path: str) -> str:
    return hashlib.sha256(storage.fs.cat_file(path)).hexdigest()


def test_placed_iterations_run_one_at_a_time():
    deployments = yaml.safe_load((REPO / "deploy/placement/prefect.yaml").read_text())["deployments"]
    placed = next(d for d in deployments if d["name"] == "placed")
    assert placed["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}


def test_an_iteration_with_stages_on_two_pools_commits_what_one_process_does(s3, tmp_path, monkeypatch):
    s3_env = s3.env()
    storage_url = f"s3://{s3.bucket}/placement-{tmp_path.name}"
    with prefect_server(tmp_path / "prefect") as server:
        for pool in ("gpu", "cpu"):
            server.cli("work-pool", "create", pool, "--type", "process", "--overwrite")
        server.cli("work-pool", "set-concurrency-limit", "gpu", "1")  # one GPU stage at a time
        server.cli("--no-prompt", "deploy", "--all", "--prefect-file", "deploy/placement/prefect.yaml", cwd=REPO)
        homes = {pool: tmp_path / f"machine-{pool}" for pool in ("gpu", "cpu")}  # no shared folder
        for home in homes.values():
            home.mkdir()
        env = lambda pool: {**s3_env, "GRPO_CACHE": str(homes[pool] / "cache")}  # noqa: E731
        with process_worker(server, "gpu", cwd=homes["gpu"], env=env("gpu")):
            with process_worker(server, "cpu", cwd=homes["cpu"], env=env("cpu")):
                run = server.wait_for_flow_run(placed_run(server, storage_url, "placed"), 900)
                assert run["state"]["type"] == "COMPLETED", server.log_tails(40)
                children = stage_runs(server)

    # each stage ran on its pool; the gpu pool ran one stage at a time, its two rollouts shards too
    by_name = {r["name"]: r for r in children}
    for stage, pool in PLACEMENT.items():
        names = [f"placed {stage} 0 shard {i}" for i in range(SHARDS[stage])] if stage in SHARDS else []
        for name in names or [f"placed {stage} 0"]:
            assert by_name[name]["work_pool_name"] == pool
    t = lambda r, key: datetime.fromisoformat(r[key])  # noqa: E731
    on_gpu = sorted((r for r in children if r["work_pool_name"] == "gpu"), key=lambda r: t(r, "start_time"))
    assert len(on_gpu) == 4  # rollouts x2, learn, eval
    assert all(t(a, "end_time") <= t(b, "start_time") for a, b in zip(on_gpu, on_gpu[1:]))

    # the same rows and checkpoints as the stages run in one process
    for key, value in {**s3_env, "GRPO_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(key, value)
    storage = open_storage(storage_url)
    init_run(storage, "single", unsharded(latest_config(storage)))
    single = run_iteration(storage, "single", 0)
    for stage, name in TABLES.items():
        placed = latest_committed(storage, stage_dir(storage, "placed", 0, stage))
        pd.testing.assert_frame_equal(content(storage, placed, name), content(storage, single[stage], name))
    placed = latest_committed(storage, stage_dir(storage, "placed", 0, "learn"))
    assert sha256(storage, placed.path("policy/model.safetensors")) == sha256(
        storage, single["learn"].path("policy/model.safetensors")
    )


def unsharded(cfg):
    return dataclasses.replace(
        cfg,
        rollout=dataclasses.replace(cfg.rollout, shards=1),
        reward=dataclasses.replace(cfg.reward, shards=1),
    )


def latest_config(storage):
    from stages.common import load_run

    return load_run(storage, "placed")
