"""The first hour, as a new user meets it through the `grpo` CLI in a fresh process: progress a person can
read in a terminal and none in a pipe, a status that tells running attempts from failed ones, and runs
that say where their model is."""

import os
import pty
import re
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from load import load_factor
from test_stages import TINY

from grpo.config import load_config
from grpo.record.commit import StageWriter
from grpo.record.layout import stage_dir
from grpo.record.storage import open_storage
from stages import stage_function
from tests.doc_pages import DOCS

FAST = TINY + ["rollout.chunk_prompts=4"]  # 16 prompts: 4 chunks, 4 progress lines
ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("GRPO_", "VLLM_"))}


def grpo(tmp_path, *args, env=None) -> tuple[int, str, str]:
    """`grpo --storage tmp_path/store ...` with its output piped: (exit code, stdout, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "--storage", str(tmp_path / "store"), *args],
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stdout, proc.stderr


def grpo_in_terminal(tmp_path, *args) -> tuple[int, str]:
    """The same in a pseudo-terminal, as a person at a shell sees it: (exit code, all it wrote)."""
    main, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "--storage", str(tmp_path / "store"), *args],
        env=ENV,
        stdin=child,
        stdout=child,
        stderr=child,
    )
    os.close(child)
    out, deadline = b"", time.monotonic() + 300
    while time.monotonic() < deadline:
        if not select.select([main], [], [], deadline - time.monotonic())[0]:
            break  # no output until the deadline: a hang
        try:
            chunk = os.read(main, 4096)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    if proc.poll() is None and time.monotonic() >= deadline:
        proc.kill()
    return proc.wait(timeout=60), out.decode()


def init(tmp_path, *extra) -> None:
    code, _, err = grpo(tmp_path, "init", "--run", "t", *[f"--set={s}" for s in FAST + list(extra)])
    assert code == 0, err


@pytest.mark.slow
def test_progress_shows_in_a_terminal_and_never_in_a_pipe(tmp_path):
    init(tmp_path)
    code, screen = grpo_in_terminal(tmp_path, "run", "--run", "t")
    assert code == 0, screen
    for line in ("rollouts 0: 4/16 prompts", "rollouts 0: 12/16 prompts", "learn 0: 1/2 steps"):
        assert f"\r{line}\x1b[K" in screen, screen  # one line, rewritten in place
    assert "\r\x1b[K" in screen  # and erased once the stage is done
    assert "newest policy: iteration 0, file://" in screen

    code, out, err = grpo(tmp_path, "run", "--run", "t")
    assert code == 0 and err == "", err
    assert "prompts" not in out and "\r" not in out and "\x1b" not in out
    lines = out.splitlines()
    assert lines[0].split() == ["iteration", "reward", "eval", "exact", "elapsed", "s"]
    assert lines[1].split()[0] == "1"
    run = (tmp_path / "store" / "runs" / "t").as_uri()
    assert lines[2].startswith(f"newest policy: iteration 1, {run}/iter-0001/learn/attempt-0001-")
    exported = tmp_path / "store" / "runs" / "t" / "exports" / "iter-0001"  # grpo ran outside tmp_path: absolute
    assert lines[3].endswith(f" export --run t   # into {exported}")

    # the README's way to the trained model: export (under the run), then transformers loads and generates with it
    code, out, err = grpo(tmp_path, "export", "--run", "t")
    assert code == 0 and out.strip() == f"the policy of iteration 1 of run t: {exported}", err
    load = (  # as README.md shows it
        "from transformers import pipeline; "
        "print(pipeline('text-generation', 'store/runs/t/exports/iter-0001')('sort 3 1 4 1 5 :', max_new_tokens=5))"
    )
    proc = subprocess.run([sys.executable, "-c", load], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "generated_text" in proc.stdout, proc.stderr[-2000:]


def test_the_readme_config_files_are_valid_configs():
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS, re.S)
    assert blocks
    for block in blocks:
        load_config(yaml.safe_load(textwrap.dedent(block)))  # a ConfigError names the field


@pytest.mark.slow
def test_a_running_attempt_shows_as_running_until_it_fails_or_stops_beating(tmp_path, monkeypatch):
    init(tmp_path)
    beat_s = 0.5 * load_factor()  # 3 beats missed on a loaded machine are not a stopped writer
    monkeypatch.setenv("GRPO_HEARTBEAT_S", f"{beat_s:.3f}")
    storage = open_storage((tmp_path / "store").as_uri())
    row = lambda out: next(line for line in out.splitlines() if line.split()[0] == "0").split()  # noqa: E731

    def writer():
        return StageWriter(
            storage,
            stage_dir(storage, "t", 0, "snapshot"),
            run_id="t",
            iteration=0,
            stage="snapshot",
            config={},
            inputs={},
        )

    w = writer()  # a snapshot being written right now (its heartbeat beats)
    code, out, err = grpo(tmp_path, "status", "--run", "t")
    assert code == 0, err
    assert row(out)[:2] == ["0", "running"], out
    assert "+Nr: attempts running now" in out
    w.close()  # it failed
    code, out, _ = grpo(tmp_path, "status", "--run", "t")
    assert row(out)[:3] == ["0", "failed", "x1"], out

    w = writer()
    w._heartbeat.stop()  # its process was killed: no close, no more beats
    time.sleep(4 * beat_s)  # 4 intervals: more than the 3 that count as running
    code, out, _ = grpo(tmp_path, "status", "--run", "t")
    assert row(out)[:3] == ["0", "failed", "x2"], out


def test_a_run_that_does_not_exist_is_one_line_naming_the_runs_that_do(tmp_path):
    code, out, err = grpo(tmp_path, "run", "--run", "nope")
    assert code == 2 and out == "" and err.count("\n") == 1  # no table header first
    assert "no such run (there are no runs here yet); create it with `grpo init --run nope`" in err
    init(tmp_path)
    for command in ("run", "status", "report"):
        code, out, err = grpo(tmp_path, command, "--run", "nope")
        assert code == 2 and out == "" and "no such run (the runs here are t)" in err, (command, err)


@pytest.mark.slow
def test_learner_processes_relay_their_progress(tmp_path):
    """A 2-process learner's rank 0 prints its progress; the learn stage logs it as progress (a terminal
    line without -v; see above) instead of passing it on as torchrun's output."""
    init(tmp_path, "learn.num_processes=2")
    storage = open_storage((tmp_path / "store").as_uri())
    for stage in ("snapshot", "rollouts", "rewards", "advantages"):
        stage_function(stage)(storage, "t", 0)
    code, _, err = grpo(tmp_path, "-v", "stage", "learn", "--run", "t", "--iteration", "0")
    assert code == 0 and "grpo.progress learn 0: 1/2 steps" in err, err
    assert "grpo-progress" not in err
