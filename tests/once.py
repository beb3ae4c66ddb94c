"""Test data built once per test run and shared by the pytest-xdist workers: the first worker to ask builds it in the
run's folder (tests/conftest.py's `builds` sets RUN_BUILDS), under a file lock; the others wait for it there, and each
caller gets a copy of its own. Nothing outlives the run (pytest's own temporary folders), so no key but the name:
a test that wants other data names it otherwise."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

RUN_BUILDS = "GRPO_TEST_BUILDS"


def copy_of(name: str, build: Callable[[Path], object], into: Path) -> Path:
    """`into`, holding what `build(folder)` writes in a folder: built once in the run, then copied."""
    shared = os.environ.get(RUN_BUILDS)
    if not shared:  # outside pytest: build in place
        build(into)
        return into
    built = Path(shared, name)
    built.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{built}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a killed builder's process ends
        if not built.exists():
            partial = Path(f"{built}.partial")
            shutil.rmtree(partial, ignore_errors=True)  # a failed build's leftovers
            partial.mkdir()
            build(partial)
            partial.rename(built)  # whole or not there
    shutil.copytree(built, into, dirs_exist_ok=True)
    return into
