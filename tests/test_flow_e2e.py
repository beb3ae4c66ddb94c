"""End to end on real servers: a Prefect server on 127.0.0.1 (temporary PREFECT_HOME, SQLite), a
process worker, the deployment from prefect.yaml, `prefect deployment run grpo/iteration` twice
(tiny sort model, vLLM), and a flow run SIGKILLed in the middle of its rollouts, then retried."""

import base64
import importlib.util
import json
import re
import signal
import time
from datetime import datetime
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_stages import TINY

from flows.artifacts import artifact_key
from grpo.record.layout import stage_dir
from grpo.record.storage import NotCommittedError, is_committed, latest_committed, list_attempts, open_storage
from stages import STAGES, StageError, stage_function
from tools.prefect_server import flow_run_processes, prefect_server, process_worker

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]

REPO = Path(__file__).resolve().parent.parent
TINY_VLLM = [o for o in TINY if not o.startswith("rollout.backend")] + ["rollout.backend=vllm"]
RUN_TIMEOUT_S = 420
# Prefect's own log records (worker submissions, flow-run processes, leases), without the server's
# recurring "database is locked" tracebacks of its mark_deployments_ready task (SQLite; harmless)
SLOT_LOG = (
    r"^\d\d:\d\d:\d\d\.\d+ \| \w+ +\| "
    r"(prefect\.(?!.*mark_deployments_ready)|Flow run '|.*(?i:\blease|concurrency slot))"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with prefect_server(tmp_path_factory.mktemp("prefect")) as server:
        yield server


@pytest.fixture(scope="module")
def worker(server):
    """The work pool, the deployment from prefect.yaml (deployed from the repo root), a worker
    started elsewhere: each flow run finds the checkout itself (flows.deploy.work_in_checkout)."""
    server.cli("work-pool", "create", "grpo-pool", "--type", "process", "--overwrite")
    server.cli("--no-prompt", "deploy", "--all", cwd=REPO)
    with process_worker(server, "grpo-pool", cwd=server.home) as worker:
        yield worker


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return (tmp_path_factory.mktemp("e2e") / "store").as_uri()


def deployment_run(server, store: str, **params) -> str:
    """`prefect deployment run grpo/iteration` with storage `store`; returns the flow run id."""
    out = server.cli(
        "deployment",
        "run",
        "grpo/iteration",
        "--params",
        json.dumps(params),
        "--job-variable",
        "env=" + json.dumps({"GRPO_STORAGE": store}),
    ).stdout
    return re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)


def format_states(states: list[dict]) -> str:
    """A flow run's state history, one line a state: timestamp, type, name, lease, message."""
    return "\n".join(
        f"  {s['timestamp']}  {s['type']:<10} {s['name']!r:<27} "
        f"lease={s['state_details'].get('deployment_concurrency_lease_id')}  {s['message'] or ''}"
        for s in states
    )


def running_period(states: list[dict]) -> tuple[datetime, datetime]:
    """A finished run's first RUNNING state and its final state, as the server recorded them."""
    running = [datetime.fromisoformat(s["timestamp"]) for s in states if s["type"] == "RUNNING"]
    assert running, format_states(states)
    return running[0], datetime.fromisoformat(states[-1]["timestamp"])


def test_deployment_is_registered_as_configured(server, worker):
    d = server.api("GET", "/deployments/name/grpo/iteration")
    assert d["entrypoint"] == "flows.grpo:grpo" and d["work_pool_name"] == "grpo-pool"
    assert d["parameters"]["iteration"] == "next"
    assert [s["active"] for s in d["schedules"]] == [False]
    assert d["global_concurrency_limit"]["limit"] == 1
    assert d["concurrency_options"]["collision_strategy"] == "ENQUEUE"
    assert "/" not in json.dumps(d["pull_steps"])  # no machine's path stored: found at run time
    train = server.api("GET", "/deployments/name/grpo/train")  # warm: many iterations in one flow run
    assert train["entrypoint"] == d["entrypoint"] and train["parameters"]["iterations"] == 30
    assert train["global_concurrency_limit"]["limit"] == 1 and train["work_pool_name"] == "grpo-pool"


def test_two_deployment_runs_make_two_iterations_one_after_the_other(server, worker, store):
    params = {"run_id": "e2e", "overrides": TINY_VLLM}
    first, second = deployment_run(server, store, **params), deployment_run(server, store, **params)
    runs = [server.wait_for_flow_run(i, RUN_TIMEOUT_S) for i in (first, second)]
    histories = {i: server.flow_run_states(i) for i in (first, second)}
    diagnosis = "\n".join(
        [
            *(
                f"flow run {i} (created {n}):\n{format_states(histories[i])}"
                for n, i in (("first", first), ("second", second))
            ),
            server.log_tails(pattern=SLOT_LOG),
        ]
    )
    assert [r["state"]["type"] for r in runs] == ["COMPLETED", "COMPLETED"], diagnosis
    # The limit runs them one at a time, not in creation order: two runs that one worker poll
    # picks up race for the slot, and the loser waits (AwaitingConcurrencySlot) for the winner.
    first, second = sorted((first, second), key=lambda i: running_period(histories[i])[0])
    assert running_period(histories[second])[0] >= running_period(histories[first])[1], diagnosis

    storage = open_storage(store)
    learn = [latest_committed(storage, stage_dir(storage, "e2e", k, "learn")) for k in (0, 1)]
    for k in (0, 1):
        assert 0 <= latest_committed(storage, stage_dir(storage, "e2e", k, "eval")).manifest.summary["exact_match"] <= 1
    snapshot1 = latest_committed(storage, stage_dir(storage, "e2e", 1, "snapshot"))
    assert snapshot1.manifest.inputs["policy"].uri == learn[0].uri  # iteration 1 starts from 0's update

    logs = server.logs(first)
    messages = [r["message"] for r in logs]
    assert any(re.fullmatch(r"rollouts 0: 16/16 prompts", m) for m in messages)
    assert {m.split()[0] for m in messages if re.match(r"\w+ iteration 0: committed ", m)} == set(STAGES)
    # the stages' lines, not vLLM's INFO (only its warnings that matter would show)
    assert not any(r["name"].startswith("vllm") and r["level"] < 30 for r in logs)
    # the worker's terminal: no progress bars (transformers' "Loading weights" per checkpoint) between lines
    printed = worker.log.read_text()
    assert "Loading weights" not in printed and "it/s]" not in printed, printed[-3000:]
    published = server.artifacts(first)
    artifacts = {a["key"]: a for a in published}
    key = artifact_key(storage.url, "e2e")  # e2e-<storage hash>: another storage's run e2e has its own
    assert sorted(artifacts) == [f"{key}-progress", f"{key}-report"] and len(published) == 2  # once each
    report = artifacts[f"{key}-report"]["data"]
    assert "report.png" in report  # named, and shown: the plot itself, embedded
    plot = base64.b64decode(re.search(r"\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", report).group(1))
    assert plot.startswith(b"\x89PNG") and len(plot) < 100_000
    (row,) = json.loads(artifacts[f"{key}-progress"]["data"])  # the run's progress: a row per iteration
    assert row["iteration"] == 0 and row["samples"] == 64 and 0 <= row["eval_exact_match"] <= 1


def wait_for_partial_output(server, storage, stage_path: str, name: str, flow_run_id: str) -> str:
    """Poll storage until the newest attempt of a stage has written some bytes of `name`."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        attempts = list_attempts(storage, stage_path)
        path = f"{stage_path}/{attempts[-1]}/{name}" if attempts else None
        if path and storage.exists(path) and storage.fs.size(path) > 0:
            return attempts[-1]
        assert time.monotonic() < deadline, server.flow_run(flow_run_id)["state"]
        time.sleep(0.05)


def test_flow_run_killed_during_rollouts_leaves_no_visible_output_and_retry_completes(server, worker, store):
    storage = open_storage(store)
    rollouts_dir = stage_dir(storage, "kill", 0, "rollouts")
    slow = ["rollout.prompts_per_iteration=32", "rollout.chunk_prompts=1"]  # 32 row groups: seconds of writing
    run_id = deployment_run(server, store, run_id="kill", overrides=TINY_VLLM + slow)

    killed = wait_for_partial_output(server, storage, rollouts_dir, "rollouts.parquet", run_id)
    procs = flow_run_processes(worker)
    assert procs, "no flow-run process under the worker"
    for p in procs:
        for q in [p, *p.children(recursive=True)]:
            q.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=30)
    assert not is_committed(storage, f"{rollouts_dir}/{killed}")
    with pytest.raises(pa.ArrowInvalid):  # really half-written: no Parquet footer yet
        pq.read_metadata(storage.fs.open(f"{rollouts_dir}/{killed}/rollouts.parquet", "rb"))
    assert server.wait_for_flow_run(run_id, 120)["state"]["type"] == "CRASHED"

    with pytest.raises(NotCommittedError):  # readers never see the half-written attempt
        latest_committed(storage, rollouts_dir)
    with pytest.raises(StageError, match="input missing"):
        stage_function("rewards")(storage, "kill", 0)

    server.cli("flow-run", "retry", run_id)
    assert server.wait_for_flow_run(run_id, RUN_TIMEOUT_S)["state"]["type"] == "COMPLETED"
    rollouts = latest_committed(storage, rollouts_dir)
    assert rollouts.attempt_dir.rsplit("/", 1)[1] != killed
    assert not is_committed(storage, f"{rollouts_dir}/{killed}")  # left as it was, never read
    rewards = latest_committed(storage, stage_dir(storage, "kill", 0, "rewards"))
    assert rewards.manifest.inputs["rollouts"].uri == rollouts.uri
    for s in STAGES:
        latest_committed(storage, stage_dir(storage, "kill", 0, s))
