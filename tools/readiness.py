"""Waiting for a server or worker that tools/ started to be ready: one loop for all of them, whose failure is
one line naming the process and what to do, then the end of its log."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from grpo.runtime.procs import tail


def answers(url: str) -> bool:
    """Whether a GET of `url` answers 200 now (refused, timed out or another status: not yet)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:  # URLError and HTTPError among them
        return False


def wait_ready(
    proc: subprocess.Popen,
    probe: Callable[[], bool],
    log: Path,
    timeout_s: float,
    what: str,
    error: type[Exception] = RuntimeError,
    poll_s: float = 0.5,
) -> None:
    """Return once `probe()` is true, asked every `poll_s`; raise `error` naming `what` if `proc` exits first or
    `timeout_s` passes, with the last lines of its `log`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise error(
                f"{what} exited {proc.returncode} before it was ready: see why in {log}, which ends:\n{tail(log)}"
            )
        if probe():
            return
        if time.monotonic() > deadline:
            raise error(
                f"{what} not ready after {timeout_s:.0f}s: give it a longer timeout on a loaded machine, "
                f"else see why in {log}, which ends:\n{tail(log)}"
            )
        time.sleep(poll_s)
