"""Placement, checked before anything commits and shown as it ran: a pool or deployment a placement names that
Prefect lacks fails the flow in one line naming what to create, with nothing written; a placed stage's dispatch is
recorded, and `grpo timeline` tells its start-up (waiting for its flow run's process) apart from its work."""

import types

import pytest
from test_stages import TINY, make_run

from flows.cli import main
from flows.grpo import grpo
from grpo.record import dispatches
from grpo.record.layout import run_dir
from grpo.record.storage import open_storage
from grpo.report import stage_times
from stages.iteration import run_iteration


def test_a_placement_naming_a_missing_deployment_fails_before_anything_commits(prefect_api, tmp_path):
    url = (tmp_path / "store").as_uri()
    state = grpo(run_id="apart", overrides=TINY + ["rollout.staleness=1"], storage_url=url,
                 placement={"learn": "gpu", "rewards": "warm"}, return_state=True)  # fmt: skip
    assert state.is_failed() and "\n" not in state.message
    assert state.message.startswith("placement: learn on pool 'gpu': no deployment grpo-stage/gpu;")
    assert "prefect work-pool create gpu --type process" in state.message and "deploy/placement" in state.message
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("_manifest.json"))
    storage = open_storage(url)
    assert not storage.exists(run_dir(storage, "apart"))  # no run.json, no base: nothing committed


def test_a_placed_stage_is_recorded_as_sent_and_the_timeline_draws_its_start_up(tmp_path, capsys, monkeypatch):
    import prefect.deployments

    from flows.placement import Placement

    storage = open_storage((tmp_path / "store").as_uri())
    cfg = make_run(storage, "t")
    dispatches.note_sent(storage, "t", 0, "learn")  # as the flow does when it sends learn 0 to its pool
    run_iteration(storage, "t", 0)
    rows = {r["stage"]: r for r in stage_times(storage, "t")}
    assert 0 <= rows["learn"]["sent"] < rows["learn"]["start"] and "sent" not in rows["rollouts"]
    assert main(["--storage", storage.url, "timeline", "--run", "t"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[-2:] == ["start-up", "s"]
    learn = next(line.split() for line in out if line.split()[1:2] == ["learn"])
    assert float(learn[-1]) == pytest.approx(rows["learn"]["start"] - rows["learn"]["sent"], abs=0.06)
    assert next(line.split() for line in out if line.split()[1:2] == ["rollouts"])[-1] == "-"

    sent = []  # the flow records a stage as it sends it to its pool
    monkeypatch.setattr(
        prefect.deployments, "run_deployment", lambda *a, **k: sent.append(a) or types.SimpleNamespace(id=1)
    )
    monkeypatch.setattr(Placement, "wait_flow_runs", lambda self, stage, runs, *_: "done")
    before = dispatches.sent_times(storage, "t")[0, "learn"]
    assert Placement({"eval": "gpu"}, storage, "t", 1, cfg)("eval", "file:///learn") == "done" and sent
    after = dispatches.sent_times(storage, "t")
    assert after[0, "learn"] == before and after[1, "eval"] >= before


def test_a_stage_sent_to_the_stage_workers_is_named_as_here(prefect_api, tmp_path):
    """A task run of the stage workers is `eval 1` (or `rollouts 1 shard 0`), as the flow's own are, not Prefect's
    `eval-2`: sent, and read back from the API before any worker takes it."""
    from prefect.client.orchestration import get_client

    from flows.placement import Placement

    storage = open_storage((tmp_path / "store").as_uri())
    cfg = make_run(storage, "w")
    at = Placement({"eval": "warm", "rollouts": "warm"}, storage, "w", 1, cfg)
    sent = [at.delay("eval", "file:///learn", None), at.delay("rollouts", "file:///snapshot", 0)]
    with get_client(sync_client=True) as client:
        assert [client.read_task_run(f.task_run_id).name for f in sent] == ["eval 1", "rollouts 1 shard 0"]
