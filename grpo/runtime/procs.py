"""Helpers for the processes grpo starts and stops: the learner's torchrun, and the local S3 and
Prefect servers of tools/ (their tests, the README and the benchmarks use them); on Linux, processes tied
to their parent's life (PR_SET_PDEATHSIG) and the descendants a reward worker reaps (a subreaper)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
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


# ---------------------------------------------------------------- processes tied to this one (Linux)
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
_LIBC = None  # loaded before a fork: a preexec_fn must not dlopen (another thread may hold its lock)


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _prctl(option: int, arg: int) -> bool:
    """prctl(option, arg) on Linux; False elsewhere or where it fails."""
    return sys.platform.startswith("linux") and _libc().prctl(option, arg, 0, 0, 0) == 0


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Have the kernel send this process `sig` when its parent exits (PR_SET_PDEATHSIG; nothing off Linux).
    `parent`: its pid as this process started; if it is gone already (the race before prctl), `sig` now."""
    if _prctl(_PR_SET_PDEATHSIG, int(sig)) and parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def tied_to_this_process(sig: int = signal.SIGTERM):
    """A Popen preexec_fn: the child gets `sig` when this process (the thread that starts it) exits, even by
    SIGKILL; on Linux, else None (no preexec_fn)."""
    if not sys.platform.startswith("linux"):
        return None
    _libc()  # loaded here, before the fork
    parent = os.getpid()
    return lambda: die_with_parent(sig, parent)


def become_subreaper() -> bool:
    """Orphans among this process's descendants become its children, not init's (PR_SET_CHILD_SUBREAPER), so
    `descendants` finds every process they started, however they detached. False off Linux."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def descendants(pid: int, group: bool = False) -> list[int]:
    """Every living process below `pid` (its children, theirs...) and with `group` those of its process group
    `pid` too, from /proc; [] where there is none (or no /proc)."""
    parents: dict[int, list[int]] = {}
    members: list[int] = []
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else []:
        if not entry.name.isdigit() or int(entry.name) == pid:
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                state, ppid, pgrp = f.read().rsplit(b")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if state != b"Z":  # a zombie has exited; only its parent's wait is due
            parents.setdefault(int(ppid), []).append(int(entry.name))
            if group and int(pgrp) == pid:
                members.append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found + [p for p in members if p not in found]


def kill_descendants(pid: int, group: bool = False, rounds: int = 5) -> int:
    """SIGKILL every process `descendants(pid, group)` finds, again while any forks meanwhile; returns how
    many there were."""
    killed: set[int] = set()
    for _ in range(rounds):
        found = [p for p in descendants(pid, group) if p not in killed]
        if not found:
            break
        for p in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        killed.update(found)
    return len(killed)
