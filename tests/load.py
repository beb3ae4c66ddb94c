"""How busy this machine is, measured, for the tests that must give something a wall-clock time: a node's
timeout, a heartbeat's lease, a bound on how long a failure takes to be seen.

A test waits on an event where it can (a file a process writes, a line it prints, kill_points.py); where the code
under test itself judges by time (learn.node_timeout_s, GRPO_HEARTBEAT_S x gc.LEASE_BEATS), the test gives it the
time it would need quiet, times load_factor(): the wall seconds this process takes now per CPU second of work.
It is 1 on an idle core and about 1 + k/cores with k other busy processes (the README's command runs two pytest
workers on 2 cores; a second copy of the suite beside it doubles that), whatever the CPU's speed, so a timeout
stays as generous on a slow loaded machine as on a fast quiet one.

    >>> 1.0 <= load_factor() < 1000
    True
"""

from __future__ import annotations

import time


def load_factor(cpu_s: float = 0.2) -> float:
    """Wall seconds per CPU second of a busy loop in this process, measured over `cpu_s` CPU seconds now; at
    least 1."""
    wall, cpu = time.monotonic(), time.process_time()
    while time.process_time() - cpu < cpu_s:
        sum(range(1000))
    return max(1.0, (time.monotonic() - wall) / (time.process_time() - cpu))


def scaled(seconds: float) -> float:
    """`seconds` (what the wait needs on a quiet machine, with its margin) times the load factor measured now."""
    return seconds * load_factor()
