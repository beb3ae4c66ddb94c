"""`grpo config set | show`: a setting that may change changes without repeating the run's config; one that may not
is refused in one line naming it and the fork that trains on with it, and run.json stays as it was."""

import json

import pytest
import yaml
from test_stages import TINY

from flows.cli import main
from grpo.record.layout import run_json
from grpo.record.storage import open_storage


def cli(storage, capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["--storage", storage.url, *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def run(tmp_path, capsys):
    storage = open_storage((tmp_path / "store").as_uri())
    assert cli(storage, capsys, "init", "--run", "r", *[a for kv in TINY for a in ("--set", kv)])[0] == 0
    return storage


def stored(storage) -> dict:
    return json.loads(storage.read_bytes(run_json(storage, "r")))["config"]


def test_a_setting_that_may_change_changes_alone(run, capsys):
    before = stored(run)
    rc, out, err = cli(run, capsys, "config", "set", "--run", "r", "retention.keep_last=5", "eval.every=2")
    assert rc == 0, err
    assert out.strip() == "run r: eval.every 1 -> 2; retention.keep_last None -> 5"
    after = stored(run)
    assert after["retention"]["keep_last"] == 5 and after["eval"]["every"] == 2
    after["retention"]["keep_last"], after["eval"]["every"] = None, 1
    assert after == before  # TINY's settings kept: nothing repeated on the command line
    rc, out, _ = cli(run, capsys, "config", "set", "--run", "r", "retention.keep_last=5")
    assert rc == 0 and "nothing to change" in out
    rc, out, _ = cli(run, capsys, "config", "show", "--run", "r")
    assert rc == 0 and yaml.safe_load(out) == stored(run)


def test_a_setting_results_depend_on_is_refused_in_one_line(run, capsys):
    before = run.read_bytes(run_json(run, "r"))
    for setting, named in (
        ("learn.lr=0.5", "learn.lr"),
        ("learn.lrr=0.5", "unknown setting 'learn.lrr'"),
        ("retention.keep_last=x", "retention.keep_last"),
    ):
        rc, out, err = cli(run, capsys, "config", "set", "--run", "r", setting)
        assert rc == 2 and out == "" and err.count("\n") == 1 and named in err, err
    assert (
        "fork --from r --at K --run NEW --set learn.lr=0.5"
        in cli(run, capsys, "config", "set", "--run", "r", "learn.lr=0.5")[2]
    )
    assert run.read_bytes(run_json(run, "r")) == before
    rc, _, err = cli(run, capsys, "config", "set", "--run", "nope", "eval.every=2")
    assert rc == 2 and "no such run" in err
