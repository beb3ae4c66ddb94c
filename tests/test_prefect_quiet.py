"""Prefect quiet where nothing is wrong: the flow without a server succeeds with no traceback and no ERROR line,
and names its flow run after the run and its iteration."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("GRPO_", "VLLM_", "PREFECT_")) and k not in ("DO_NOT_TRACK", "PYTHONPATH")
}


@pytest.mark.slow
def test_the_flow_without_a_server_prints_no_traceback(tmp_path):
    """`python -m flows.grpo` as README says, in a fresh PREFECT_HOME: one iteration of run demo, twice."""
    env = ENV | {"PREFECT_HOME": str(tmp_path / "prefect"), "GRPO_STORAGE": str(tmp_path / "store")}
    env["PYTHONPATH"] = str(ROOT)
    for k in range(2):
        done = subprocess.run(
            [sys.executable, "-m", "flows.grpo"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-4000:]
        assert "Traceback" not in out and "database is locked" not in out, out[-4000:]
        assert "| ERROR" not in out and "anonymous usage" not in out, out[-4000:]
        assert f"Flow run 'demo-{k}'" in out, out[-4000:]  # named after the run and its iteration


def busy_record():
    import logging
    import sqlite3

    try:
        raise sqlite3.OperationalError("database is locked")
    except sqlite3.OperationalError:
        return logging.LogRecord(
            "docket.dependencies", logging.ERROR, "", 0, "↩ [%s] %s", ("4ms", "x()"), sys.exc_info()
        )


@pytest.mark.parametrize("root_level, shown", [("WARNING", False), ("DEBUG", True)])
def test_sqlite_busy_is_quiet_by_default_and_one_debug_line(root_level, shown):
    """A loaded server's retried `database is locked` (docket's Retry logs each try with its traceback): dropped
    at Prefect's default root level, one DEBUG line where the root is at DEBUG (PREFECT_LOGGING_ROOT_LEVEL)."""
    import logging

    from tools.prefect_logging import SqliteBusyOneLine

    root, before = logging.getLogger(), logging.getLogger().level
    root.setLevel(root_level)
    try:
        busy = busy_record()
        assert SqliteBusyOneLine().filter(busy) == shown
    finally:
        root.setLevel(before)
    assert busy.levelname == "DEBUG" and busy.exc_info is None
    assert logging.Formatter().format(busy) == "↩ [4ms] x(): database is locked (SQLite was busy); retried"

    try:
        raise ValueError("something else")
    except ValueError:
        other = logging.LogRecord("docket.dependencies", logging.ERROR, "", 0, "boom", None, sys.exc_info())
    assert SqliteBusyOneLine().filter(other) and other.exc_info is not None and other.levelname == "ERROR"


def test_prefect_toml_settings_hold_in_the_repo_root():
    """What `prefect server start` and workers read in the repo root: analytics off, the logging file with
    the filter on the console (Prefect's own loader, so a file Prefect cannot read fails here)."""
    code = (
        "import logging.config\n"
        "from prefect.settings import get_current_settings\n"
        "from prefect.logging.configuration import load_logging_config\n"
        "s = get_current_settings()\n"
        "config = load_logging_config(s.logging.config_path)\n"
        "logging.config.dictConfig(config)\n"
        "console = logging.getLogger().handlers[0]\n"
        "print(s.server.analytics_enabled, [type(f).__name__ for f in console.filters])\n"
        "import sqlite3\n"
        "try:\n"
        "    raise sqlite3.OperationalError('database is locked')\n"
        "except sqlite3.OperationalError:\n"  # what docket's Retry logs on a busy server, one a second
        "    logging.getLogger('docket.dependencies').error('mark_deployments_ready()', exc_info=True)\n"
    )
    env = ENV | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "False ['SqliteBusyOneLine']", done.stdout
    assert "mark_deployments_ready" not in done.stderr, done.stderr  # quiet by default
    env["PREFECT_LOGGING_ROOT_LEVEL"] = "DEBUG"  # asked for: one line, no traceback
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    said = [line for line in done.stderr.splitlines() if "mark_deployments_ready" in line]
    assert len(said) == 1 and "DEBUG" in said[0] and "Traceback" not in done.stderr, done.stderr[-3000:]
