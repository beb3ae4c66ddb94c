"""A fixed reward file rescored, and a fork that trains on with it (grpo.scoring.files): the fork holds its own copy
of the file named in `--set reward.functions=...` where its bytes differ from the run's, hashed in its manifest,
and takes everything else from its parent by reference; the parent keeps scoring with its own copy."""

import hashlib

import pytest
from test_stages import make_run

from flows.cli import main
from grpo.query import query
from grpo.record.layout import run_dir, stage_dir
from grpo.record.reward_files import STAGE
from grpo.record.storage import latest_committed, open_storage
from stages.iteration import run_iteration, run_warm

EXACT = "def score(response, ground_truth, prompt):\n    return float(response.split() == ground_truth.split())\n"
FIXED = (  # partial credit: the share of positions right
    "def score(response, ground_truth, prompt):\n"
    "    got, want = response.split(), ground_truth.split()\n"
    "    return sum(a == b for a, b in zip(got, want)) / len(want)\n"
)


def cli(storage, capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["--storage", storage.url, *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def current(storage, run_id, k, stage):
    return latest_committed(storage, stage_dir(storage, run_id, k, stage), verify=False)


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """Run w: 2 iterations scored by a file of exact match; the file is then fixed in place. (storage, the file)"""
    tmp = tmp_path_factory.mktemp("rescore-files")
    reward = tmp / "my_reward.py"
    reward.write_text(EXACT)
    storage = open_storage((tmp / "store").as_uri())
    make_run(storage, "w", extra=[f"reward.functions=[{reward}:score]"])
    for _ in run_warm(storage, "w", 0, 2):
        pass
    return storage, reward


def manifests(storage, run_id) -> list[str]:
    return sorted(p for p in storage.fs.find(run_dir(storage, run_id)) if p.endswith("_manifest.json"))


def test_a_fixed_reward_file_rescores_in_a_fork_that_holds_its_copy(scored, capsys):
    storage, reward = scored
    name = f"reward.functions=[{reward}:score]"
    rc, _, err = cli(storage, capsys, "rescore", "--run", "w", "--set", name)  # the same bytes: nothing to do
    assert rc == 2 and err.count("\n") == 1 and "changes nothing" in err
    parent = manifests(storage, "w")

    reward.write_text(FIXED)  # the fix
    rc, out, err = cli(storage, capsys, "rescore", "--run", "w", "--set", name)
    assert rc == 0, err
    fork = out.split("rescored into run ")[1].split()[0]
    rows = {int(line.split()[0]): line.split() for line in out.splitlines() if line[:9].strip().isdigit()}
    assert set(rows) == {0, 1} and all(int(r[1]) > 0 for r in rows.values()), out  # rewards changed
    changed = query(storage, fork, "SELECT count(*) FILTER (WHERE reward_changed) AS n, max(reward_after) AS m, "
                    "count(*) FILTER (WHERE reward_after NOT IN (0, 1)) AS partial FROM rescore")  # fmt: skip
    assert changed.n[0] > 0 and changed.partial[0] > 0  # partial credit: the fixed file scored them

    held = current(storage, fork, None, STAGE)
    (entry,) = held.manifest.files
    assert entry.sha256 == hashlib.sha256(FIXED.encode()).hexdigest()  # its own copy, hashed
    for k in (0, 1):
        rewards = current(storage, fork, k, "rewards")
        assert rewards.manifest.inputs[STAGE] == held.ref() and "base" not in rewards.manifest.inputs
        assert current(storage, fork, k, "rollouts").manifest.origin == current(storage, "w", k, "rollouts").ref()
    assert manifests(storage, "w") == parent  # the parent: untouched, still its own copy of the exact-match file
    base_copy = [f for f in current(storage, "w", None, "base").manifest.files if f.path.startswith("reward/")]
    assert base_copy[0].sha256 == hashlib.sha256(EXACT.encode()).hexdigest()

    made = manifests(storage, fork)
    rc, again, _ = cli(storage, capsys, "rescore", "--run", "w", "--set", name)  # the same fix again: reused
    assert rc == 0 and again.split("rescored into run ")[1].split()[0] == fork and manifests(storage, fork) == made


def test_a_fork_naming_a_fixed_file_trains_on_with_it(scored, capsys):
    storage, reward = scored
    reward.write_text(FIXED)
    rc, _, err = cli(storage, capsys, "fork", "--from", "w", "--at", "2", "--run", "g", "--set",
                     f"reward.functions=[{reward}:score]")  # fmt: skip
    assert rc == 0, err
    out = run_iteration(storage, "g", 2)
    assert out["rewards"].manifest.inputs[STAGE] == current(storage, "g", None, STAGE).ref()
    partial = query(storage, "g", "SELECT count(*) AS n FROM rewards WHERE iteration = 2 AND reward NOT IN (0, 1)")
    assert partial.n[0] > 0
    rc, _, err = cli(storage, capsys, "fork", "--from", "w", "--at", "2", "--run", "h", "--set", "learn.lr=1e-3")
    assert rc == 0, err  # not named: the parent's copy, by reference through its base
    assert not storage.fs.exists(stage_dir(storage, "h", None, STAGE))
    assert (
        run_iteration(storage, "h", 2)["rewards"].manifest.inputs["base"] == current(storage, "h", None, "base").ref()
    )
