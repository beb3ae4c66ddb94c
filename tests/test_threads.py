"""torch's CPU threads in grpo's processes (GRPO_THREADS, `grpo --threads`): applied before any work, recorded in
the learn manifest, a bad value refused in one line; and the oversubscription check the learner runs."""

import doctest
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_stages import TINY

from grpo.runtime import threads
from grpo.runtime.threads import cores, cpu_watch, parse_threads

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("GRPO_", "VLLM_"))} | {"OMP_NUM_THREADS": "1"}


def cli(tmp_path, *args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "--storage", str(tmp_path / "store"), *args],
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def learn_summary(tmp_path, iteration: int) -> dict:
    manifest = next((tmp_path / "store" / "runs" / "t" / f"iter-{iteration:04d}" / "learn").glob("*/_manifest.json"))
    return json.loads(manifest.read_text())["summary"]


def test_doctests():
    assert doctest.testmod(threads).failed == 0


@pytest.mark.slow
def test_the_setting_reaches_the_learner_whatever_torch_would_choose(tmp_path):
    """OMP_NUM_THREADS=1 makes torch's own choice 1; `--threads 2` and GRPO_THREADS=cores/1 override it."""
    assert cli(tmp_path, "init", "--run", "t", *[f"--set={s}" for s in TINY]).returncode == 0
    done = cli(tmp_path, "--threads", "2", "run", "--run", "t")
    assert done.returncode == 0, done.stderr
    assert learn_summary(tmp_path, 0)["threads"] == 2
    assert "cpu_busy_others" in learn_summary(tmp_path, 0)
    done = cli(tmp_path, "run", "--run", "t", env={"GRPO_THREADS": "cores/1"})
    assert done.returncode == 0, done.stderr
    assert learn_summary(tmp_path, 1)["threads"] == cores()


def test_a_bad_setting_is_one_line_naming_it(tmp_path):
    for args, env in ((["--threads", "two"], {}), ([], {"GRPO_THREADS": "cores/0"})):
        done = cli(tmp_path, *args, "status", "--run", "t", env=env)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert "GRPO_THREADS=" in done.stderr and "cores/K" in done.stderr


def test_parse_threads():
    assert parse_threads("1", 2) == 1 and parse_threads("cores/2", 16) == 8 and parse_threads("cores/3", 2) == 1
    for bad in ("0", "-1", "x", "cores/", "cores/0", "2/2", ""):
        with pytest.raises(threads.StageError, match="GRPO_THREADS"):
            parse_threads(bad, 4)


def test_cpu_watch_counts_other_processes_busy_cores():
    """A process spinning beside the watched block shows as about one busy core of others; the block's own
    spinning does not count."""
    spin = "import time\nt = time.time()\nwhile time.time() - t < 4: pass"
    other = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.5)
        with cpu_watch("test") as seen:
            t = time.time()
            while time.time() - t < 1.5:  # this process: one busy core, not counted
                pass
    finally:
        other.kill()
        other.wait()
    assert 0.6 < seen["cpu_busy_others"] < 1.0 + (os.getloadavg()[0] if hasattr(os, "getloadavg") else 1), seen


def test_an_oversubscribed_learner_logs_one_warning(caplog, monkeypatch):
    monkeypatch.setattr(threads, "_busy_s", iter([0.0, 0.0, 2.0 * 1.2 + 1.0]).__next__)  # others: 2 cores
    monkeypatch.setattr(threads.torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with caplog.at_level("WARNING", logger="grpo.runtime.threads"), cpu_watch("learn 3"):
        time.sleep(1.2)
    (record,) = caplog.records
    assert record.getMessage().startswith("learn 3: other processes kept ") and "GRPO_THREADS=1" in record.getMessage()
