"""Forks and rescoring (grpo.record.fork, stages.rescore): a fork takes its parent's history by reference (no copy) and
reuses, by reference, every stage whose config and inputs are the parent's; a rescore scores committed rollouts
again without sampling and says what changed; gc keeps every file a fork references until the fork is deleted."""

import json

import numpy as np
import pandas as pd
import pytest
from test_stages import make_run

from flows.cli import main
from grpo.gc import best_iteration
from grpo.query import query
from grpo.record import resume as state
from grpo.record.fork import fork_of
from grpo.record.identity import lineage_identity, stage_identity
from grpo.record.layout import STAGES, run_dir, run_ids, stage_dir
from grpo.record.storage import file_path, latest_committed, open_storage
from grpo.tracking import track
from schemas.manifest import InputRef, Manifest
from stages.common import load_run
from stages.iteration import run_warm


def listing(storage, run_id) -> dict[str, int]:
    """{path: size} of every file of a run."""
    return {p: i["size"] for p, i in storage.fs.find(run_dir(storage, run_id), detail=True).items()}


def current(storage, run_id, k, stage):
    return latest_committed(storage, stage_dir(storage, run_id, k, stage), verify=False)


def cli(storage, capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["--storage", storage.url, *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    """Run p: 5 iterations of the tiny settings (tests that use it leave p as it is, and check so)."""
    storage = open_storage((tmp_path_factory.mktemp("fork") / "store").as_uri())
    make_run(storage, "p")
    for _ in run_warm(storage, "p", 0, 5):
        pass
    return storage


def test_a_manifest_without_origin_is_written_as_before_and_lineage_identity_leaves_out_the_run():
    m = Manifest("rewards", "r", 0, "attempt-0001-abcdef", "id", {}, "h", {}, [], "v", "t0", "t1")
    assert b"origin" not in m.to_json() and Manifest.from_json(m.to_json(), "x") == m
    ref = InputRef("file:///s/runs/p/iter-0000/rollouts/attempt-0001-aaaaaa", "f" * 64)
    forked = Manifest("rewards", "r", 0, "attempt-0001-abcdef", "id", {}, "h", {}, [], "v", "t0", "t1", origin=ref)
    assert Manifest.from_json(forked.to_json(), "x").origin == ref
    inputs = {"rollouts": ref}
    assert stage_identity("a", 3, "learn", "h", inputs) != stage_identity("b", 3, "learn", "h", inputs)
    same = lineage_identity(3, "learn", "h", {"rollouts": "f" * 64})
    assert same == lineage_identity(3, "learn", "h", {"rollouts": "f" * 64})
    assert same != lineage_identity(3, "learn", "h2", {"rollouts": "f" * 64})
    assert same != lineage_identity(2, "learn", "h", {"rollouts": "f" * 64})


def test_a_fork_at_3_with_gspo_trains_learn_3_on_the_parents_samples_by_reference(history, capsys):
    storage = history
    before = listing(storage, "p")
    rc, out, _ = cli(storage, capsys, "fork", "--from", "p", "--at", "3", "--run", "g", "--set", "learn.loss_type=gspo")
    assert rc == 0 and "none copied" in out
    assert fork_of(storage, "g") == {"parent": "p", "at": 3}
    rc, out, _ = cli(storage, capsys, "run", "--run", "g", "--iterations", "1")
    assert rc == 0
    assert listing(storage, "p") == before  # the parent is untouched

    # storage grows only by the new stages: elsewhere the fork holds manifests (and its run.json), no data
    own = ("/iter-0003/learn/", "/iter-0003/state/", "/iter-0003/eval/")
    grown = {p: n for p, n in listing(storage, "g").items() if not p.endswith(("/_manifest.json", "/run.json"))}
    assert grown and all(any(o in p for o in own) for p in grown), sorted(grown)

    for k in range(4):
        for s in STAGES if k < 3 else ("snapshot", "rollouts", "rewards", "advantages"):
            mine, theirs = current(storage, "g", k, s), current(storage, "p", k, s)
            assert mine.manifest.origin == theirs.ref(), (k, s)  # taken by reference, not recomputed
            assert mine.manifest.inputs.keys() == theirs.manifest.inputs.keys()
            assert all(ref.uri.startswith(storage.uri(run_dir(storage, "g"))) for ref in mine.manifest.inputs.values())
            for f in mine.manifest.files:  # the same files, where they live in p
                entry = theirs.manifest.file(f.path)
                where = entry.uri or storage.uri(file_path(storage, theirs.attempt_dir, entry))
                assert (f.uri, f.sha256, f.size) == (where, entry.sha256, entry.size)
    learn, theirs = current(storage, "g", 3, "learn"), current(storage, "p", 3, "learn")
    assert learn.manifest.origin is None and learn.manifest.config["learn"]["loss_type"] == "gspo"
    assert theirs.manifest.config["learn"]["loss_type"] != "gspo"
    for name in ("rollouts", "advantages"):  # trained on the fork's references of p's rollouts 3 and advantages 3
        assert learn.manifest.inputs[name] == current(storage, "g", 3, name).ref()
    assert (
        learn.manifest.file("policy/model.safetensors").sha256
        != theirs.manifest.file("policy/model.safetensors").sha256
    )

    rc, out, _ = cli(storage, capsys, "status", "--run", "g", "--verify")
    assert rc == 0 and "a fork of run p at iteration 3" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()[:1] in [["2"], ["3"]]}
    assert rows["2"] == ["ref", "x1"] * 6 and rows["3"] == ["ref", "x1"] * 4 + ["ok", "x1"] * 2
    rc, out, _ = cli(storage, capsys, "status", "--run", "p")
    assert rc == 0 and "g (at 3)" in next(line for line in out.splitlines() if line.startswith("forked by: "))
    rc, out, _ = cli(storage, capsys, "report", "--run", "g")
    assert (
        rc == 0
        and "A fork of run p at iteration 3" in storage.read_bytes(f"{run_dir(storage, 'g')}/report.md").decode()
    )
    assert cli(storage, capsys, "init", "--run", "g")[0] == 0  # finishing an init keeps the fork's base, by reference
    assert len(storage.fs.ls(stage_dir(storage, "g", None, "base"))) == 1 and fork_of(storage, "g")["parent"] == "p"


def test_a_fork_with_another_reward_reruns_rewards_and_what_follows(history):
    storage = history
    assert main(["--storage", storage.url, "fork", "--from", "p", "--at", "3", "--run", "h", "--set",
                 "reward.truncated_reward=-1"]) == 0  # fmt: skip
    for _ in run_warm(storage, "h", 3, 1):
        pass
    by_reference = {s: current(storage, "h", 3, s).manifest.origin is not None for s in STAGES}
    assert by_reference == {"snapshot": True, "rollouts": True, "rewards": False, "advantages": False,
                            "learn": False, "eval": False}  # fmt: skip
    assert current(storage, "h", 3, "rewards").manifest.inputs["rollouts"] == current(storage, "h", 3, "rollouts").ref()


def test_fork_and_rescore_refuse_bad_input_in_one_line_and_write_nothing(history, capsys):
    storage = history
    runs = run_ids(storage)
    files = storage.fs.find(storage.path("runs"))
    bad = [
        (["fork", "--from", "p", "--at", "9", "--run", "x"], "--at 9"),
        (["fork", "--from", "nope", "--at", "1", "--run", "x"], "no such run"),
        (["fork", "--from", "p", "--at", "1", "--run", "p"], "exists"),
        (["fork", "--from", "p", "--at", "1", "--run", "x", "--set", "model.hidden_size=32"], "model.hidden_size"),
        (["fork", "--from", "p", "--at", "1", "--run", "x", "--set", "learn.lr=fast"], "learn.lr"),
        (["rescore", "--run", "p", "--set", "learn.lr=1e-3"], "--set learn.lr"),
        (["rescore", "--run", "p", "--iterations", "0:9", "--set", "reward.truncated_reward=-1"], "--iterations 0:9"),
        (["rescore", "--run", "p", "--iterations", "0:1"], "--set"),
        (["rescore", "--run", "p", "--set", "reward.shards=2"], "changes nothing"),
    ]
    for args, field in bad:
        rc, _, err = cli(storage, capsys, *args)
        assert rc == 2 and err.count("\n") == 1 and field in err, (args, err)
    assert run_ids(storage) == runs and storage.fs.find(storage.path("runs")) == files


def expected_changes(storage, run_id: str, k: int, truncated: float) -> tuple[int, set[int]]:
    """(samples whose reward changes, groups whose advantage flips sign) when cut-off responses score
    `truncated`, from the parent's committed tables alone."""
    rollouts = pd.read_parquet(storage.uri(current(storage, run_id, k, "rollouts").path("rollouts.parquet")))
    rewards = pd.read_parquet(storage.uri(current(storage, run_id, k, "rewards").path("rewards.parquet")))
    df = rewards.merge(rollouts[["prompt_id", "sample_index", "finish_reason"]], on=["prompt_id", "sample_index"])
    df["after"] = np.where(df.finish_reason == "length", truncated, df.reward)

    def sign(col):  # of reward - group mean, the sign of a centered or normalized advantage
        centered = df[col] - df.groupby("prompt_id")[col].transform("mean")
        return np.sign(centered.where(centered.abs() > 1e-12, 0.0))

    flipped = set(df.prompt_id[sign("reward") * sign("after") < 0])
    return int((df.after != df.reward).sum()), flipped


def test_rescore_reports_changed_rewards_and_flipped_groups_and_writes_no_rollouts(history, capsys):
    storage = history
    before = listing(storage, "p")
    args = ["rescore", "--run", "p", "--iterations", "0:4", "--set", "reward.truncated_reward=-1", "--as", "r"]
    rc, out, err = cli(storage, capsys, *args)
    assert rc == 0, err
    assert listing(storage, "p") == before
    expected = {k: expected_changes(storage, "p", k, -1.0) for k in range(5)}
    assert sum(n for n, _ in expected.values()) > 0 and any(f for _, f in expected.values())  # something to find
    table = {int(line.split()[0]): line.split() for line in out.splitlines() if line[:9].strip().isdigit()}
    for k, (n, flipped) in expected.items():
        assert table[k][1:4] == [str(n), "of", "64"] and int(table[k][-1]) == len(flipped), (k, table[k])
        if flipped:
            assert f"iteration {k}: advantage sign flipped in groups (prompt_id) " in out
    view = query(storage, "r", "SELECT iteration, list(DISTINCT prompt_id) FILTER (WHERE advantage_flipped) AS f, "
                 "count(*) FILTER (WHERE reward_changed) AS n FROM rescore GROUP BY 1 ORDER BY 1")  # fmt: skip
    assert {row.iteration: (row.n, set(row.f if row.f is not None else [])) for row in view.itertuples()} == expected
    means = query(storage, "r", "SELECT iteration, avg(reward_after) AS a FROM rescore GROUP BY 1 ORDER BY 1")
    for row in means.itertuples():  # the reward mean after: the rescored rewards committed in the fork
        assert row.a == pytest.approx(current(storage, "r", row.iteration, "rewards").manifest.summary["reward_mean"])

    for k in range(5):  # no sampling: the fork's rollouts are p's, by reference
        rollouts = current(storage, "r", k, "rollouts")
        assert rollouts.manifest.origin == current(storage, "p", k, "rollouts").ref()
        assert [p.rsplit("/", 1)[-1] for p in storage.fs.find(stage_dir(storage, "r", k, "rollouts"))] == [
            "_manifest.json"
        ]
    rc, out, _ = cli(storage, capsys, "status", "--run", "r")
    # learn and eval 0 were trained on the old rewards, and every stage of 1-4 descends from such a learn (the
    # rescored rewards of 1-4 score samples of policies the old rewards trained): 2 + 4 x 6 stale cells
    assert rc == 0 and out.count("stale x") == 26 and out.count("ok x2") == 2

    attempts = sorted(p for p in storage.fs.find(run_dir(storage, "r")) if p.endswith("_manifest.json"))
    rc, again, _ = cli(storage, capsys, *args)  # the same rescore again: every stage reused
    assert (
        rc == 0
        and sorted(p for p in storage.fs.find(run_dir(storage, "r")) if p.endswith("_manifest.json")) == attempts
    )


def test_gc_keeps_every_file_forks_reference_and_deleting_them_frees_it(tmp_path, capsys):
    storage = open_storage((tmp_path / "store").as_uri())
    make_run(storage, "p", extra=["retention.keep_last=1"])
    for _ in run_warm(storage, "p", 0, 3):
        pass
    assert cli(storage, capsys, "fork", "--from", "p", "--at", "2", "--run", "f", "--set", "learn.lr=1e-3")[0] == 0
    assert cli(storage, capsys, "run", "--run", "f", "--iterations", "1")[0] == 0
    assert cli(storage, capsys, "fork", "--from", "f", "--at", "3", "--run", "g")[0] == 0  # a fork of a fork
    assert cli(storage, capsys, "stage", "eval", "--run", "p", "--iteration", "1", "--force")[0] == 0  # superseded

    def referenced() -> set[str]:  # every file the forks' manifests list elsewhere
        out = set()
        for run in ("f", "g"):
            for path in storage.fs.find(run_dir(storage, run)):
                if path.endswith("_manifest.json"):
                    manifest = Manifest.from_json(storage.read_bytes(path), path)
                    out |= {f.uri for f in manifest.files if f.uri}
        return out

    needed = referenced()
    assert any("/runs/p/iter-0001/state/" in u and u.endswith("optimizer.pt") for u in needed)
    rc, out, _ = cli(storage, capsys, "gc", "--run", "p", "--retention", "--delete", "--older-than-s", "0")
    assert rc == 0 and "file(s) referenced by run f, g (a fork)" in out and "referenced by run f" in out, out
    assert all(storage.exists(u.removeprefix("file://")) for u in needed)
    for run in ("f", "g"):
        rc, out, _ = cli(storage, capsys, "status", "--run", run, "--verify")
        assert rc == 0 and "corrupt" not in out.split("(xN")[0], out
    assert cli(storage, capsys, "run", "--run", "g", "--iterations", "1")[0] == 0  # g resumes at 3
    assert latest_committed(storage, stage_dir(storage, "g", 3, "learn")).manifest.origin is None

    for run, by in (("p", "f, g"), ("f", "g")):  # a run another references is not deleted
        rc, _, err = cli(storage, capsys, "delete", "--run", run, "--yes")
        assert rc == 2 and err.count("\n") == 1 and f"run {by} references" in err, err
    rc, out, _ = cli(storage, capsys, "delete", "--run", "g")
    assert rc == 0 and "nothing removed (dry run)" in out and "g" in run_ids(storage)
    for run in ("g", "f"):
        assert cli(storage, capsys, "delete", "--run", run, "--yes")[0] == 0
    assert run_ids(storage) == ["p"] and not storage.exists(run_dir(storage, "f"))

    rc, out, _ = cli(storage, capsys, "gc", "--run", "p", "--retention", "--delete", "--older-than-s", "0")
    assert rc == 0
    best = best_iteration(storage, "p", [0, 1, 2])
    for k in (0, 1):  # now collected: optimizer state, and the policy unless the best eval's (keep_last=1)
        learn = current(storage, "p", k, "learn")
        gone = json.loads(storage.read_bytes(f"{learn.attempt_dir}/collected.json"))["files"] if k != best else {}
        held = state.committed_state(storage, "p", learn)
        gone |= json.loads(storage.read_bytes(f"{held.attempt_dir}/collected.json"))["files"]
        assert "optimizer.pt" in gone and ("policy/model.safetensors" in gone) == (k != best), (k, best, gone)
        assert storage.exists(f"{learn.attempt_dir}/policy/model.safetensors") == (k == best)
    assert len(storage.fs.ls(stage_dir(storage, "p", 1, "eval"))) == 1


def test_a_fork_is_a_tracker_run_of_its_own_tagged_with_its_parent_and_fork_point(history, tmp_path):
    import mlflow

    storage, uri = history, f"sqlite:///{tmp_path / 'mlflow.db'}"
    sets = ["--set", "tracking.backend=mlflow", "--set", f"tracking.uri={uri}"]
    assert main(["--storage", storage.url, "fork", "--from", "p", "--at", "2", "--run", "t", *sets]) == 0
    assert track(storage, "t", load_run(storage, "t")) == [0, 1]  # the iterations it holds, as its own
    client = mlflow.tracking.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("grpo-flow").experiment_id])
    assert {k: v for k, v in run.data.tags.items() if k.startswith("grpo.")} == {
        "grpo.run_id": "t",
        "grpo.parent": "p",
        "grpo.fork_at": "2",
    }
    got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward_mean"))
    want = [current(storage, "p", k, "advantages").manifest.summary["reward_mean"] for k in (0, 1)]
    assert [k for k, _ in got] == [0, 1] and [v for _, v in got] == pytest.approx(want)


def test_query_and_report_address_a_parent_and_its_fork_together(history, capsys):
    storage = history
    assert cli(storage, capsys, "fork", "--from", "p", "--at", "4", "--run", "q", "--set", "learn.lr=1e-3")[0] == 0
    sql = "SELECT run, iteration, avg(reward) AS r, count(*) AS n FROM runs.rewards GROUP BY ALL ORDER BY 1, 2"
    rc, out, err = cli(storage, capsys, "query", "--run", "p", "--run", "q", sql)
    assert rc == 0, err
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("p", str(k)) for k in range(5)] + [("q", str(k)) for k in range(4)]
    assert [r[2:] for r in rows if r[0] == "q"] == [r[2:] for r in rows if r[0] == "p"][:4]  # the same samples
    rc, out, _ = cli(storage, capsys, "query", "--run", "p", "--run", "q", 'SELECT count(*) AS n FROM "q".advantages')
    assert rc == 0 and out.split()[1:] == [str(4 * 64)]
    rc, _, err = cli(storage, capsys, "query", "--run", "p", "--run", "runs", "SELECT 1")
    assert rc == 2 and "run runs: a schema of that name is taken" in err

    rc, out, _ = cli(storage, capsys, "report", "--run", "p", "--compare", "q")
    assert rc == 0
    assert storage.read_bytes(f"{run_dir(storage, 'p')}/compare.png").startswith(b"\x89PNG")
    md = storage.read_bytes(f"{run_dir(storage, 'p')}/compare.md").decode()
    assert "- p: 5 iterations" in md and "- q (a fork of p at iteration 4): 4 iterations" in md


@pytest.mark.slow
@pytest.mark.s3
def test_on_s3_a_fork_references_its_parents_objects_and_gc_keeps_them_until_it_is_deleted(
    s3_env, s3_prefix, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    storage = open_storage(s3_prefix)
    make_run(storage, "p")
    for _ in run_warm(storage, "p", 0, 2):
        pass
    assert cli(storage, capsys, "fork", "--from", "p", "--at", "1", "--run", "f", "--set", "learn.lr=1e-3")[0] == 0
    assert cli(storage, capsys, "run", "--run", "f", "--iterations", "1")[0] == 0
    for s in ("snapshot", "rollouts", "rewards", "advantages"):
        assert current(storage, "f", 1, s).manifest.origin == current(storage, "p", 1, s).ref(), s
    assert current(storage, "f", 1, "learn").manifest.origin is None
    held = state.committed_state(storage, "p", current(storage, "p", 0, "learn"))
    optimizer = held.path("optimizer.pt")  # retention keeps only the newest learn's state
    assert cli(storage, capsys, "gc", "--run", "p", "--retention", "--delete", "--older-than-s", "0")[0] == 0
    assert storage.exists(optimizer)  # f's learn 0 is p's, and f's learn 1 continued from its optimizer state
    rc, out, _ = cli(storage, capsys, "status", "--run", "f", "--verify")
    assert rc == 0 and "corrupt" not in out.split("(xN")[0]
    assert cli(storage, capsys, "delete", "--run", "f", "--yes")[0] == 0
    assert cli(storage, capsys, "gc", "--run", "p", "--retention", "--delete", "--older-than-s", "0")[0] == 0
    assert not storage.exists(optimizer)
