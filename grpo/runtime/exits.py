"""Work a process finishes as its main thread ends, before the interpreter's shutdown stops thread pools.

A background commit (grpo.record.resume) uploads through thread pools and asyncio's executor; once the main thread
has ended, Python first runs threading's exit hooks (concurrent.futures' among them, which refuses new work from
then on: "cannot schedule new futures after interpreter shutdown") and only then joins the other threads and runs
`atexit`. So `atexit` is too late, and the one way in is threading's own hook list, newest first: a function
registered here after concurrent.futures' runs before it. This module is the one shim over that private API
(tests/test_structure.py holds every other module to public ones); where an interpreter lacks it, `atexit` runs the
function instead (late: the work may then fail and is redone by whoever needs it).
"""

from __future__ import annotations

import atexit
import threading
from typing import Callable

_registered: set[Callable[[], None]] = set()


def before_thread_shutdown(fn: Callable[[], None]) -> None:
    """Run `fn` (once, however often registered) as the main thread ends, before thread pools stop."""
    if fn in _registered:
        return
    _registered.add(fn)
    hook = getattr(threading, "_register_atexit", None)  # CPython >= 3.9: what concurrent.futures itself uses
    (hook or atexit.register)(fn)
