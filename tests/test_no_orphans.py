"""No process outlives the stage that started it: what a reward function starts is killed as its job ends and
counted; torchrun and its ranks die with a stage killed by SIGKILL; a rank killed by a signal is named."""

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from test_stages import TINY, make_run

from grpo.config import load_config
from grpo.record.storage import open_storage
from grpo.runtime.procs import descendants
from stages import StageError, stage_function
from stages.init import init_run

ROOT = Path(__file__).resolve().parents[1]
MARKER = f"grpo-orphan-test-{uuid.uuid4().hex}"  # this session's, not an earlier one's

SPAWN = f"""
import itertools, os, subprocess, sys

_n = itertools.count()

def spawn(response, ground_truth, prompt):
    if next(_n) < 2:  # the first two samples: a child, and a daemon (double fork, a session of its own)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "{MARKER}"])
        if (pid := os.fork()) == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(300)", "{MARKER}"])
            os._exit(0)
        os.waitpid(pid, 0)
    return 1.0
"""


def marked() -> list[int]:
    """Processes whose command line holds MARKER."""
    found = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and MARKER.encode() in Path(f"/proc/{entry.name}/cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_processes_a_reward_function_leaves_are_killed_counted_and_named(storage, tmp_path, caplog):
    (tmp_path / "spawn.py").write_text(SPAWN)
    extra = [
        "rollout.prompts_per_iteration=4",
        "learn.minibatch_size=16",
        "learn.microbatch_size=16",
        f"reward.functions=[{tmp_path / 'spawn.py'}:spawn]",
    ]
    init_run(storage, "o", load_config(None, TINY + extra))
    stage_function("snapshot")(storage, "o", 0)
    stage_function("rollouts")(storage, "o", 0)
    caplog.set_level(logging.WARNING)
    try:
        out = stage_function("rewards")(storage, "o", 0)
        assert marked() == []  # the daemons lived on with PPID 1 before
        assert out.manifest.summary["processes_left"] == 4 and out.manifest.summary["errors"] == 0
        assert "reward function spawn left 4 processes running" in caplog.text
    finally:
        for pid in marked():
            os.kill(pid, signal.SIGKILL)


def learn_ready(storage, run_id: str, extra=()) -> None:
    make_run(storage, run_id, extra=["learn.num_processes=2", *extra])
    for s in ["snapshot", "rollouts", "rewards", "advantages"]:
        stage_function(s)(storage, run_id, 0)


def hook_dir(tmp_path, body: str) -> Path:
    """A sitecustomize every python the learn stage starts loads: `body` runs in torchrun's ranks."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("import os, signal, time\nif os.environ.get('RANK'):\n" + body)
    return hook


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
@pytest.mark.parametrize("killed", ["stage", "torchrun"])
def test_learner_processes_die_with_the_stage_or_torchrun_killed_by_sigkill(storage, tmp_path, killed):
    """The stage (or its torchrun) is SIGKILLed while the ranks train: they are gone within seconds, not
    alive until their next write to a closed pipe."""
    learn_ready(storage, "p")
    hook = hook_dir(
        tmp_path, "    import grpo.learner.loop\n    grpo.learner.loop.train = lambda *a, **k: time.sleep(300)\n"
    )
    script = (
        "from grpo.record.storage import open_storage\nfrom stages import stage_function\n"
        f"stage_function('learn')(open_storage({storage.url!r}), 'p', 0)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{hook}:{ROOT}"}
    stage = subprocess.Popen([sys.executable, "-c", script], env=env)
    family: list[int] = []
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and stage.poll() is None:
            family = descendants(stage.pid)
            ranks = [p for p in family if _cmdline(p).endswith(b".json") and _parent(p) != stage.pid]
            if len(ranks) == 2:
                break
            time.sleep(0.5)
        assert len(ranks) == 2, f"no ranks started (stage exit {stage.poll()})"
        time.sleep(2)  # into train (sleeping)
        family = descendants(stage.pid)
        torchrun = {_parent(p) for p in ranks}
        assert len(torchrun) == 1 and torchrun != {stage.pid}
        os.kill(stage.pid if killed == "stage" else torchrun.pop(), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and [p for p in family if _alive(p)]:
            time.sleep(0.2)
        assert not [p for p in family if _alive(p)], f"still running after 10 s: {family}"
    finally:
        for p in [stage.pid, *family]:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        stage.wait()


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
    except OSError:
        return 0


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ")
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    """pid runs (a zombie has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named_with_its_signal(storage, tmp_path, monkeypatch):
    """Rank 1 is SIGKILLed in its first minibatch: the stage's error names rank 1 and SIGKILL, as torchrun
    reported them, not only rank 0's closed connection."""
    learn_ready(storage, "k")
    hook = hook_dir(
        tmp_path,
        "    if os.environ['RANK'] == '1':\n"
        "        import grpo.learner.loop\n"
        "        grpo.learner.loop.minibatch_step = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n",
    )
    monkeypatch.setenv("PYTHONPATH", f"{hook}:{ROOT}")
    with pytest.raises(StageError) as e:
        stage_function("learn")(storage, "k", 0)
    first = str(e.value).splitlines()[0]
    assert "rank 1 was killed: Signal 9 (SIGKILL) received by PID" in first, str(e.value)[-3000:]
    assert "rank 0 was killed" not in first  # torchrun's SIGTERM to the survivor is no news
