"""Helpers for the processes grpo starts and stops: the learner's torchrun, and the local S3 and
Prefect servers of tools/ (their tests, the README and the benchmarks use them)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, n: int = 40, pattern: str | None = None) -> str:
    """The last `n` lines of a log file (those matching `pattern`), or a note that there is none."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return f"<no log at {path}>"
    return "\n".join([line for line in lines if pattern is None or re.search(pattern, line)][-n:])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but not ours
        return True
    return True


def stop_group(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """Stop a process started with start_new_session=True, and everything it started: SIGTERM its
    process group, SIGKILL what is left after `grace_s`, reap it; descendants that left the group
    (a session of their own) are killed too."""
    try:
        import psutil

        family = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except Exception:  # psutil missing, or the process is gone already
        family = []
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        if proc.poll() is None or _group_alive(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
            deadline = time.monotonic() + 5  # the group's other members follow the leader out
            while _group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
    for pid in family:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
