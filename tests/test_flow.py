"""The Prefect flow `grpo` in-process (prefect_test_harness) on the tiny HF config in tmp storage:
commit, reuse, resume after a failed stage with earlier outputs byte-identical, force one stage,
pick up after a CLI rerun of one stage; and once on a real S3 server."""

import errno
import hashlib
import importlib.util
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import get_args, get_type_hints

import pytest
from prefect import flow, task
from prefect.artifacts import Artifact
from prefect.exceptions import ParameterTypeError
from test_learn import F32
from test_stages import TINY

from flows.artifacts import artifact_key
from flows.cli import main
from flows.grpo import grpo, resolve_iteration
from flows.tasks import transient
from grpo.config import load_config
from grpo.record.layout import stage_dir
from grpo.record.storage import is_committed, list_attempts, open_storage
from grpo.scoring import score as scoring
from stages import STAGES, StageError

pytestmark = pytest.mark.equivalence  # run again in CI's bf16 lane (.ci/run)

RUN = "t"


@pytest.fixture(scope="module")
def url(prefect_api, tmp_path_factory):
    """Storage holding run `t` with iteration 0 done by the flow."""
    url = (tmp_path_factory.mktemp("flow") / "store").as_uri()
    out = grpo(run_id=RUN, iteration=0, overrides=TINY, storage_url=url)
    assert list(out) == list(STAGES)
    return url


def attempts(url: str, iteration: int) -> dict[str, list[str]]:
    """stage -> attempt folder names (committed or not), oldest first."""
    storage = open_storage(url)
    return {s: list_attempts(storage, stage_dir(storage, RUN, iteration, s)) for s in STAGES}


def committed_hashes(url: str, iteration: int, names=STAGES) -> dict[str, str]:
    """sha256 of every file in every committed attempt of the given stages."""
    storage = open_storage(url)
    out = {}
    for s in names:
        d = stage_dir(storage, RUN, iteration, s)
        for a in list_attempts(storage, d):
            if is_committed(storage, f"{d}/{a}"):
                for f in sorted(Path(d, a).rglob("*")):
                    if f.is_file():
                        out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def reuse_messages(caplog) -> list[str]:
    """The stages of an iteration that were reused (not the run's base model)."""
    return [r.getMessage() for r in caplog.records if re.match(r"\w+ iteration \d+: reused committed ", r.getMessage())]


def test_flow_commits_every_stage_then_reuses_all(url, caplog):
    storage = open_storage(url)
    for s in STAGES:
        d = stage_dir(storage, RUN, 0, s)
        assert any(is_committed(storage, f"{d}/{a}") for a in list_attempts(storage, d)), s
    before, hashes = attempts(url, 0), committed_hashes(url, 0)
    caplog.set_level(logging.INFO)
    again = grpo(run_id=RUN, iteration=0, storage_url=url)
    assert attempts(url, 0) == before and committed_hashes(url, 0) == hashes  # no new attempt
    assert all(again[s].endswith(before[s][-1]) for s in STAGES)
    assert sorted(m.split()[0] for m in reuse_messages(caplog)) == sorted(STAGES)


@pytest.mark.precision_pinned
def test_failed_stage_resumes_there_and_earlier_outputs_stay_byte_identical(url, monkeypatch, caplog):
    real = scoring.score_batch

    def broken(pool, key, cfg, items, **_):  # iteration 1's first scoring: its rewards stage
        raise RuntimeError("injected reward fault")

    monkeypatch.setattr(scoring, "score_batch", broken)
    state = grpo(run_id=RUN, iteration=1, storage_url=url, return_state=True)
    assert state.is_failed() and "injected reward fault" in state.message
    failed, storage = attempts(url, 1), open_storage(url)
    assert failed["rewards"] and not failed["advantages"]  # a half-written rewards attempt, nothing after
    assert not is_committed(storage, f"{stage_dir(storage, RUN, 1, 'rewards')}/{failed['rewards'][0]}")
    assert resolve_iteration(storage, RUN, "next") == 1
    kept = {**committed_hashes(url, 0), **committed_hashes(url, 1, ["snapshot", "rollouts"])}

    monkeypatch.setattr(scoring, "score_batch", real)
    caplog.set_level(logging.INFO)
    grpo(run_id=RUN, iteration="next", storage_url=url)
    after = attempts(url, 1)
    assert {s for s in STAGES if after[s] != failed[s]} == {"rewards", "advantages", "learn", "eval"}
    assert len(after["rewards"]) == 2  # the failed attempt stays, uncommitted, beside the new one
    assert sorted(m.split()[0] for m in reuse_messages(caplog)) == ["rollouts", "snapshot"]
    now = {**committed_hashes(url, 0), **committed_hashes(url, 1, ["snapshot", "rollouts"])}
    assert now == kept
    assert resolve_iteration(open_storage(url), RUN, "next") == 2


def test_force_stage_reruns_that_stage_and_the_later_ones(url):
    before = attempts(url, 0)
    grpo(run_id=RUN, iteration=0, storage_url=url, force_stage="advantages")
    after = attempts(url, 0)
    assert {s for s in STAGES if after[s] != before[s]} == {"advantages", "learn", "eval"}
    assert all(len(after[s]) == len(before[s]) + 1 for s in ("advantages", "learn", "eval"))
    force_stage = get_type_hints(grpo.fn)["force_stage"]  # the flow's parameter lists the stages, in order
    assert get_args(next(a for a in get_args(force_stage) if a is not type(None))) == STAGES
    with pytest.raises(ParameterTypeError, match="force_stage"):  # checked before anything runs
        grpo(run_id=RUN, iteration=0, storage_url=url, force_stage="reward")


def test_cli_rerun_of_one_stage_then_the_flow_continues_from_there(url, caplog):
    assert main(["--storage", url, "stage", "advantages", "--run", RUN, "--iteration", "0", "--force"]) == 0
    before = attempts(url, 0)
    caplog.set_level(logging.INFO)
    grpo(run_id=RUN, iteration=0, storage_url=url)
    after = attempts(url, 0)
    assert {s for s in STAGES if after[s] != before[s]} == {"learn", "eval"}  # their input changed
    assert sorted(m.split()[0] for m in reuse_messages(caplog)) == ["advantages", "rewards", "rollouts", "snapshot"]


@pytest.mark.s3
def test_flow_on_a_real_s3_server(prefect_api, s3_env, s3_prefix):
    out = grpo(run_id="s3", iteration=0, overrides=TINY, storage_url=s3_prefix)
    assert all(uri.startswith(f"{s3_prefix}/runs/s3/iter-0000/") for uri in out.values())
    assert grpo(run_id="s3", iteration=0, storage_url=s3_prefix) == out  # all reused


@pytest.mark.parametrize(
    "error, retried",
    [
        (OSError("connection reset"), True),
        (TimeoutError("read"), True),
        (FileNotFoundError("gone"), False),
        (StageError("bad input"), False),
    ],
)
@pytest.mark.precision_pinned
def test_only_transient_storage_errors_are_retried(prefect_api, error, retried):
    calls = []

    @task(retries=1, retry_delay_seconds=0, retry_condition_fn=transient)
    def fails_once():
        calls.append(1)
        if len(calls) == 1:
            raise error

    @flow
    def one_task():
        fails_once()

    assert one_task(return_state=True).is_completed() == retried
    assert len(calls) == (2 if retried else 1)


def committed_outputs(url: str, run_id: str, iterations: int) -> dict:
    """Per iteration: the policy version sampled from, the rewards, the new checkpoint's hash, eval."""
    import pandas as pd

    from grpo.record.checkpoint import content_hash
    from grpo.record.storage import latest_committed

    storage, out = open_storage(url), {}
    for k in range(iterations):
        c = {s: latest_committed(storage, stage_dir(storage, run_id, k, s)) for s in STAGES}
        rewards = pd.read_parquet(c["rewards"].path("rewards.parquet")).sort_values(["prompt_id", "sample_index"])
        out[k] = {
            "policy_hash": c["rollouts"].manifest.summary["policy_hash"],
            "rewards": rewards["reward"].tolist(),
            "checkpoint": content_hash(c["learn"]),
            "eval": c["eval"].manifest.summary["exact_match"],
            "logprob_gap": round(c["learn"].manifest.summary["logprob_gap"], 4),
        }
    return out


@pytest.mark.precision_pinned
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_warm_iterations_commit_what_cold_ones_do(prefect_api, tmp_path):
    """Two iterations in one flow run (the vLLM engine reloads weights in place, the learner keeps
    its model and optimizer) against two cold processes of one iteration each: same samples,
    rewards and checkpoints."""
    from grpo.sampling.engines import close_generators

    url = (tmp_path / "store").as_uri()
    vllm = [o for o in TINY if not o.startswith("rollout.backend")] + ["rollout.backend=vllm", F32]
    cli = [sys.executable, "-m", "flows.cli", "--storage", url]
    subprocess.run(cli + ["init", "--run", "cold"] + [a for o in vllm for a in ("--set", o)], check=True)
    for _ in range(2):  # a new process per iteration, like grpo/iteration
        subprocess.run(cli + ["run", "--run", "cold", "--iterations", "1"], check=True)
    try:
        grpo(run_id="warm", iterations=2, overrides=vllm, storage_url=url)
    finally:
        close_generators()
    cold, warm = committed_outputs(url, "cold", 2), committed_outputs(url, "warm", 2)
    assert warm[1]["policy_hash"] == warm[0]["checkpoint"][:16]  # iteration 1 sampled the new policy
    assert warm[0]["checkpoint"] != warm[1]["checkpoint"]
    # the reloaded engine samples from exactly the committed weights (the learner recomputes them)
    assert warm[1]["logprob_gap"] < 1e-4
    assert warm == cold
    progress = json.loads(Artifact.get(f"{artifact_key(url, 'warm')}-progress").data)  # a row per iteration
    assert [(r["iteration"], r["eval_exact_match"]) for r in progress] == [
        (k, round(warm[k]["eval"], 4)) for k in (0, 1)
    ]


ONE_LINE_ERRORS = {  # raised inside the rewards stage -> the flow run's message
    "stage": (
        lambda: StageError("reward.functions my.py:score: returned 'yes' for sample 3,\nnot a number"),
        "reward.functions my.py:score: returned 'yes' for sample 3, not a number",
    ),
    "disk full": (
        lambda: OSError(errno.ENOSPC, "No space left on device", "/data/x.parquet"),
        "no space left on the device writing /data/x.parquet: free space, then rerun (nothing was committed)",
    ),
    "permission": (lambda: PermissionError(errno.EACCES, "Permission denied", "/data/x"), "/data/x: Permission denied"),
    "named stage": (  # the stage's own prefix is not said twice
        lambda: StageError("rewards: 4 samples failed, more than the 3 that reward.max_error_fraction=0.05 allows"),
        "4 samples failed, more than the 3 that reward.max_error_fraction=0.05 allows",
    ),
}


@pytest.mark.precision_pinned
@pytest.mark.parametrize("case", ONE_LINE_ERRORS)
def test_a_stage_error_fails_the_flow_run_with_its_one_line_and_no_traceback(url, monkeypatch, case):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    error, line = ONE_LINE_ERRORS[case]

    def refuse(pool, key, cfg, items, **_):
        raise error()

    monkeypatch.setattr(scoring, "score_batch", refuse)
    run_id = "oneline-" + case.replace(" ", "-")
    state = grpo(run_id=run_id, iteration=0, overrides=TINY, storage_url=url, return_state=True)
    assert state.is_failed()
    assert state.message == f"rewards iteration 0: {line}"
    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    assert logs and not [log.message for log in logs if "Traceback" in log.message]


def test_sharded_stages_run_as_task_runs_per_shard_and_commit_the_rows_of_one(prefect_api, tmp_path):
    import pandas as pd
    from prefect.client.orchestration import get_client

    from grpo.record.layout import shard_stage
    from grpo.record.storage import latest_committed
    from stages.init import init_run
    from stages.iteration import run_iteration

    url = (tmp_path / "store").as_uri()
    chunked = TINY + ["rollout.chunk_prompts=8"]
    out = grpo(
        run_id="sharded", iteration=0, overrides=chunked + ["rollout.shards=2", "reward.shards=2"], storage_url=url
    )
    storage = open_storage(url)
    init_run(storage, "one", load_config(None, chunked))
    one = run_iteration(storage, "one", 0)
    for stage in ("rollouts", "rewards"):
        merged = latest_committed(storage, stage_dir(storage, "sharded", 0, stage))
        assert out[stage] == merged.uri and {"shard-0", "shard-1"} <= set(merged.manifest.inputs)
        table = lambda c: pd.read_parquet(storage.fs.open(c.path(f"{stage}.parquet"), "rb")).drop(columns="run_id")  # noqa: E731
        pd.testing.assert_frame_equal(table(merged), table(one[stage]))
        for k in (0, 1):
            assert list_attempts(storage, stage_dir(storage, "sharded", 0, shard_stage(stage, k, 2)))
    with get_client(sync_client=True) as client:
        names = {t.name for t in client.read_task_runs()}
    assert {"rollouts 0 shard 0", "rollouts 0 shard 1", "rewards 0 shard 1", "rollouts 0"} <= names


@pytest.mark.precision_pinned
def test_s3_without_credentials_fails_the_flow_run_with_the_cli_line_and_no_traceback(
    prefect_api, s3, monkeypatch, tmp_path, request
):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3.region)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookups either
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # an earlier test's filesystem holds its credentials
    request.addfinalizer(s3fs.S3FileSystem.clear_instance_cache)  # and this one none, for later tests
    url = f"s3://{s3.bucket}/nocreds-{tmp_path.name}"
    state = grpo(run_id="nocreds", overrides=TINY, storage_url=url, return_state=True)
    assert state.is_failed()
    assert state.message == "init nocreds: S3: no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    assert not [log.message for log in logs if "Traceback" in log.message]


def test_eval_every_skips_between_due_evals_and_the_flow_calls_last_iteration_is_evaluated(prefect_api, tmp_path):
    from grpo.record.storage import latest_committed

    url = (tmp_path / "store").as_uri()
    grpo(run_id="e", iterations=3, overrides=TINY + ["eval.every=2"], storage_url=url)
    storage = open_storage(url)
    skipped = lambda k: latest_committed(storage, stage_dir(storage, "e", k, "eval")).manifest.summary.get("skipped")  # noqa: E731
    assert [skipped(k) for k in range(3)] == [True, None, None]  # 1: after 2 learns; 2: the call's last
    grpo(run_id="e", iteration=0, storage_url=url)  # a call that ends at iteration 0 evaluates it
    assert skipped(0) is None


@pytest.mark.precision_pinned
def test_a_placed_stage_waits_through_a_task_run_the_server_shows_without_a_state(monkeypatch):
    """Prefect's distributed future raises 'has no state' where the server returns the task run without one, first
    or between two states (seen under load): the flow waits on for the stage rather than failing with it."""
    from types import SimpleNamespace

    from prefect.states import Completed, Running

    import flows.placement as placement

    class Future:
        def __init__(self):
            self.waits = ["ok", "no state", "no state", "done"]
            self.state = Running()

        def wait(self, timeout=None):
            step = self.waits.pop(0)
            if step == "no state":
                raise RuntimeError("Task run 1 has no state which means it hasn't started yet.")
            if step == "done":
                self.state = Completed()

    monkeypatch.setattr(placement.time, "sleep", lambda s: None)
    here = SimpleNamespace(k=0, outcome=lambda stage, states, upstream, shards: [s.name for s in states])
    future = Future()
    assert placement.Placement.wait_tasks(here, "rollouts", [future], None, SimpleNamespace(lost=lambda: None)) == [
        "Completed"
    ]
    assert future.waits == []
