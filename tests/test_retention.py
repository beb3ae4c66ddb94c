"""`grpo gc --retention`: the weights and optimizer state the run's retention settings do not keep
go, on file:// and a real S3 server; tables, manifests and summaries stay, and the run still
answers queries, verifies, reruns its newest stages and resumes to what an uncollected run gives."""

import doctest

import pytest
from test_stages import make_run

import grpo.gc
from flows.cli import main
from grpo.config import RetentionConfig
from grpo.gc import POLICY_PREFIXES, STATE_PREFIXES, plan
from grpo.record.layout import STATE_STAGE, run_dir, stage_dir
from grpo.record.storage import latest_committed, open_storage
from stages.iteration import run_warm

RETENTION = ["retention.keep_last=1", "retention.keep_every=2"]
TABLES = ["rollouts", "rewards", "advantages", "logprobs", "learn_metrics", "eval"]


def test_doctests():
    assert doctest.testmod(grpo.gc).failed == 0


@pytest.fixture
def storage(tmp_path, monkeypatch):
    """file:// only: gc's deletes on a real S3 server are tested in tests/test_gc.py (50 s saved here)."""
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    return open_storage((tmp_path / "store").as_uri())


def listing(storage, run_id) -> dict[str, int]:
    """{path: size} of every file of a run."""
    return {p: i["size"] for p, i in storage.fs.find(run_dir(storage, run_id), detail=True).items()}


def learn(storage, run_id, k):
    return latest_committed(storage, stage_dir(storage, run_id, k, "learn"), verify=False)


def held(storage, run_id, k):
    """The resume state committed after learn k (grpo/record/resume.py)."""
    return latest_committed(storage, stage_dir(storage, run_id, k, STATE_STAGE), verify=False)


def present(storage, run_id, k) -> set[str]:
    """Files of iteration k's committed learn and state that are still there, relative to their attempts."""
    attempts = [c.attempt_dir for c in (learn(storage, run_id, k), held(storage, run_id, k))]
    return {p[len(a) + 1 :] for a in attempts for p in storage.fs.find(a)}


def weights(storage, run_id, k) -> dict[str, str]:
    """{path: sha256} of the policy and optimizer state a learn and the state after it committed."""
    files = learn(storage, run_id, k).manifest.files + held(storage, run_id, k).manifest.files
    return {f.path: f.sha256 for f in files if f.path.startswith(POLICY_PREFIXES + STATE_PREFIXES)}


def cli(storage, capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["--storage", storage.url, *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.slow
def test_retention_collects_weights_and_state_and_the_run_goes_on(storage, capsys):
    for run_id in ("a", "b"):  # b: the same run, never collected
        make_run(storage, run_id, extra=RETENTION)
        for _ in run_warm(storage, run_id, 0, 4):
            pass
    evals = [latest_committed(storage, stage_dir(storage, "a", k, "eval")).manifest.summary for k in range(4)]
    best = max(range(4), key=lambda k: (evals[k]["exact_match"], evals[k]["reward_mean"], k))
    kept = {0, 2, 3, best}  # every 2nd, the last 1, the best eval

    before = listing(storage, "a")
    rc, out, _ = cli(storage, capsys, "gc", "--run", "a", "--retention")
    assert rc == 0 and "nothing removed (dry run)" in out and listing(storage, "a") == before
    assert f"iteration {best}: policy" in out and "iteration 3: policy and optimizer state (the newest learn)" in out
    rc, out, _ = cli(storage, capsys, "gc", "--run", "a", "--retention", "--delete")
    assert rc == 0
    after = listing(storage, "a")
    with capsys.disabled():  # shown with -s
        print(f"\n{storage.url}: run a {sum(before.values())} bytes before gc --retention, {sum(after.values())} after")

    for k in range(4):
        files = present(storage, "a", k)
        assert {"metrics.parquet", "logprobs.parquet", "_manifest.json"} <= files  # tables stay
        state = {f for f in files if f.startswith(STATE_PREFIXES)}
        policy = {f for f in files if f.startswith(POLICY_PREFIXES) and f not in state}
        assert bool(state) == (k == 3), (k, files)  # optimizer state: the newest learn only
        assert bool(policy) == (k in kept), (k, files)
        assert ("collected.json" in files) == (k != 3)

    rc, out, _ = cli(storage, capsys, "status", "--run", "a", "--verify")
    assert rc == 0 and "corrupt x" not in out and "optimizer state of iteration 0, 1, 2" in out
    for table in TABLES:
        rc, out, _ = cli(storage, capsys, "query", "--run", "a", f"SELECT DISTINCT iteration FROM {table} ORDER BY 1")
        assert rc == 0 and out.split()[1:] == ["0", "1", "2", "3"], (table, out)

    # a stage that needs a collected file fails in one line naming it
    rc, _, err = cli(storage, capsys, "stage", "learn", "--run", "a", "--iteration", "2", "--force")
    assert rc == 2 and err.count("\n") == 1 and "iter-0001/state/" in err
    assert "optimizer.pt was collected by `grpo gc --retention`" in err
    # the newest stages rerun
    rc, _, err = cli(storage, capsys, "stage", "eval", "--run", "a", "--iteration", "3", "--force")
    assert rc == 0, err

    # both runs resume one iteration (cold: from the files): the same learn
    for run_id in ("a", "b"):
        rc, _, err = cli(storage, capsys, "run", "--run", run_id)
        assert rc == 0, err
    assert weights(storage, "a", 4) == weights(storage, "b", 4) and weights(storage, "a", 4)

    # iteration 3 is no longer the newest: its state goes, and its policy unless it is the best eval
    rc, out, _ = cli(storage, capsys, "gc", "--run", "a", "--retention", "--delete")
    assert rc == 0 and any(f.startswith("policy/") for f in present(storage, "a", 3)) == (best == 3)
    if best != 3:  # a snapshot of a collected policy fails naming it
        rc, _, err = cli(storage, capsys, "stage", "snapshot", "--run", "a", "--iteration", "4", "--force")
        assert rc == 2 and err.count("\n") == 1 and "iter-0003/learn/" in err and "policy/" in err
        assert "was collected by `grpo gc --retention`" in err
    rc, out, _ = cli(storage, capsys, "status", "--run", "a", "--verify")
    assert rc == 0 and "corrupt x" not in out

    # no rule set (both null): every policy stays, the optimizer state of all but the newest learn goes
    found = plan(storage, "b", retention=RetentionConfig())
    assert {(g.why, g.path) for g in found.garbage} == {("state", held(storage, "b", k).attempt_dir) for k in range(4)}
    assert [line.split(":")[0] for line in found.kept] == [f"iteration {k}" for k in range(5)]
    assert "iteration 0: policy (no retention rule set)" in found.kept
