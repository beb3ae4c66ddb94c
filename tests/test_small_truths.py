"""The first hour's small truths (issue 45, item 6): eval.correct names the reward component that counts as correct;
a thread outside a Prefect run (the background state commit) logs without Prefect's UserWarning; the report draws
the behaviour panel only where a run samples stale or corrects for it, a fork's referenced iterations take no
seconds of its own, and compare.md sets the runs' figures side by side."""

import logging
import threading
import warnings

import pytest
from test_stages import make_run

from flows.cli import main
from grpo.query import query
from grpo.record.storage import open_storage
from grpo.report import BEHAVIOR, behavior_drawn, iteration_rows, shown_plots
from stages.iteration import run_iteration, run_warm

REWARDS = (
    "def exact(response, ground_truth, prompt):\n    return float(response.split() == ground_truth.split())\n\n"
    "def five(response, ground_truth, prompt):\n    return float(len(response.split()) == 5)\n"
)


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


def test_eval_correct_names_the_component_that_counts(storage, tmp_path):
    (tmp_path / "r.py").write_text(REWARDS)
    functions = f"reward.functions=[{tmp_path / 'r.py'}:exact, {tmp_path / 'r.py'}:five]"
    make_run(storage, "c", extra=[functions, "eval.correct=five"])
    out = run_iteration(storage, "c", 0)
    rows = query(storage, "c", "SELECT response, exact FROM eval")
    five = [float(len(r.split()) == 5) for r in rows.response]
    assert list(rows.exact) == five and out["eval"].manifest.summary["exact_match"] == pytest.approx(
        sum(five) / len(five)
    )
    make_run(storage, "bad", extra=[functions, "eval.correct=six"])
    with pytest.raises(Exception, match=r"eval.correct='six': the reward has no such component; it has \['exact'"):
        run_iteration(storage, "bad", 0)


def test_a_thread_outside_a_prefect_run_logs_without_prefects_warning():
    from flows.logs import stage_logs_to_prefect

    with warnings.catch_warnings(record=True) as seen, stage_logs_to_prefect():
        warnings.simplefilter("always")
        thread = threading.Thread(target=lambda: logging.getLogger("grpo.stages").info("state 3: committed"))
        thread.start()
        thread.join()
    assert not [w for w in seen if "without a flow run id" in str(w.message)]


def test_the_behaviour_panel_is_drawn_where_a_run_samples_stale_or_corrects(storage):
    make_run(storage, "plain")
    make_run(storage, "stale", extra=["rollout.staleness=1"])
    make_run(storage, "tis", extra=["learn.behavior_correction=tis"])
    assert [behavior_drawn(storage, r) for r in ("plain", "stale", "tis")] == [False, True, True]
    rows = [{"iteration": 0, "reward_mean": 0.5, "behavior_weight_mean": 1.0, "sampler_kl": 0.0}]
    assert BEHAVIOR in [name for name, _ in shown_plots(rows)] and BEHAVIOR not in [
        n for n, _ in shown_plots(rows, False)
    ]


def test_a_forks_referenced_iterations_take_no_seconds_and_compare_md_is_side_by_side(storage, capsys):
    make_run(storage, "p")
    list(run_warm(storage, "p", 0, 2))
    assert (
        main(["--storage", storage.url, "fork", "--from", "p", "--at", "1", "--run", "q", "--set", "learn.lr=1e-3"])
        == 0
    )
    list(run_warm(storage, "q", 1, 1))
    q = iteration_rows(storage, "q")
    assert q[0]["iteration_s"] is None and q[0]["rollouts_s"] is None  # p's, by reference: no time of q's
    assert q[1]["learn_s"] > 0  # its learn ran here (the other stages of 1 reused p's, by reference)
    assert main(["--storage", storage.url, "report", "--run", "p", "--compare", "q"]) == 0
    md = capsys.readouterr().out.split()[-1]
    lines = open(md.removeprefix("file://")).read().splitlines()
    header = next(line for line in lines if line.startswith("| iteration |"))
    assert header == "| iteration | p reward_mean | q reward_mean | p eval_exact_match | q eval_exact_match |"
    table = [line for line in lines if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert len(table) == 2 and all(line.count("|") == 6 for line in table)
