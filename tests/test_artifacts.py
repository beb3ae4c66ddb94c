"""The run's progress artifacts (flows/artifacts.py): published beside the flow, never in its way, and once more at
its end with every iteration; what a publish beside the flow raised fails the flow."""

import threading
import time
from types import SimpleNamespace

import pytest
from load import scaled

from flows import artifacts
from flows.artifacts import ProgressTable

STORAGE = SimpleNamespace(url="file:///nowhere")


@pytest.fixture
def published(monkeypatch):
    """The iterations each publish saw (iteration_rows' rows), recorded instead of artifacts; `gate` holds the
    publish under way until set."""
    out, committed, gate = [], [], threading.Event()

    def write_report(storage, run_id, rows):
        assert gate.wait(10)
        out.append([r["iteration"] for r in rows])
        return "report.png", "report.md"

    monkeypatch.setattr(artifacts, "iteration_rows", lambda storage, run_id: list(committed))
    monkeypatch.setattr(artifacts, "write_report", write_report)
    for name in ("create_table_artifact", "create_markdown_artifact", "best_iteration", "headline", "markdown_table"):
        monkeypatch.setattr(artifacts, name, lambda *a, **k: "")
    monkeypatch.setattr(artifacts, "figure_png", lambda *a, **k: b"")
    return out, committed, gate


def test_a_publish_runs_beside_the_flow_and_the_end_publishes_what_came_meanwhile(published):
    out, committed, gate = published
    with ProgressTable(STORAGE, "r", every_s=0) as progress:
        committed.append({"iteration": 0})
        t0, bound_s = time.monotonic(), scaled(1)
        progress.add()  # its plots render beside the flow: add returns at once, not when the gate opens
        assert time.monotonic() - t0 < bound_s and progress.beside.is_alive()
        committed.append({"iteration": 1})
        progress.add()  # one publish at a time: this iteration waits for the end
        gate.set()
    assert out == [[0], [0, 1]]


def test_what_a_publish_beside_the_flow_raised_is_raised_in_the_flow(published, monkeypatch):
    out, committed, gate = published
    monkeypatch.setattr(artifacts, "iteration_rows", lambda storage, run_id: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        with ProgressTable(STORAGE, "r", every_s=0) as progress:
            progress.add()
