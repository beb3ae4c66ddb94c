"""Torch's CPU threads in every grpo process (GRPO_THREADS), and a warning when the learner had to share them.

torch starts one thread per core. Where several processes share the cores (two stage workers on one machine,
a process pool's flow runs, `pytest -n 2`) their threads spin-wait against each other: on a shared 2-core
machine the same forced learn took 15-16.5 s of `update_s` with torch's default threads and 2.2-2.8 s with
one. GRPO_THREADS fixes the count: `N`, or `cores/K` (the machine's cores shared by K processes, at least
one each); unset, torch's own. `grpo --threads`, `python -m flows.grpo`, the flow under a worker and
`flows.stage_worker --threads` apply it before any work; learner processes under torchrun keep one each.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
import time
from contextlib import contextmanager

from grpo.errors import StageError

ENV = "GRPO_THREADS"
SHARED_MACHINE = "cores/2"
"""The default of a process that expects to share its machine with another busy grpo process: a stage worker
(README: one for the sampler and learner, one for the CPU stages), a placed stage's flow run."""
log = logging.getLogger("grpo.runtime.threads")


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_threads(text: str, n_cores: int) -> int:
    """The thread count a GRPO_THREADS value asks for on a machine of `n_cores` cores.

    >>> parse_threads("3", 8), parse_threads("cores/2", 8), parse_threads("cores/4", 2), parse_threads("cores", 6)
    (3, 4, 1, 6)
    """
    what, slash, share = text.strip().partition("/")
    try:
        if what == "cores" and (k := int(share) if slash else 1) >= 1:
            return max(1, n_cores // k)
        if what != "cores" and not slash and int(what) >= 1:
            return int(what)
    except ValueError:
        pass
    raise StageError(
        f"{ENV}={text!r} (or --threads): give a number of threads >= 1, or cores/K for the cores shared by K processes"
    )


def apply_threads(default: str | None = None) -> None:
    """Set torch's CPU threads from GRPO_THREADS, else from `default` (a GRPO_THREADS value; None leaves
    torch's); the count is exported as GRPO_THREADS so the grpo processes this one starts use it too. Where torch
    is not loaded yet, the count is set the moment it loads: a command that never needs torch (`grpo status`)
    does not pay its import (seconds)."""
    text = os.environ.get(ENV) or default
    if not text:
        return
    n = parse_threads(text, cores())
    os.environ[ENV] = str(n)
    if "torch" in sys.modules:
        _set_torch_threads(sys.modules["torch"], n)
    elif not any(isinstance(f, _OnTorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnTorchImport())


def _set_torch_threads(torch, n: int) -> None:
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


class _OnTorchImport(importlib.abc.MetaPathFinder):
    """Finds torch as Python would, and sets its threads (GRPO_THREADS, as it is then) once its import ends."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once; and the lookup below must not find this finder again
        spec = importlib.util.find_spec("torch")
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if text := os.environ.get(ENV):
                _set_torch_threads(module, parse_threads(text, cores()))

        spec.loader.exec_module = exec_module
        return spec


def oversubscribed(threads: int, others: float, n_cores: int) -> bool:
    """Whether `threads` torch threads had to share the cores: other processes kept `others` cores busy
    meanwhile and the threads wanted more than the rest by half a core. One thread is left alone: it gets
    a fair share, not the spin-waiting of several.

    >>> oversubscribed(2, 1.8, 2), oversubscribed(2, 0.3, 2), oversubscribed(1, 1.8, 2), oversubscribed(8, 2.0, 16)
    (True, False, False, False)
    """
    return threads > 1 and threads + others > n_cores + 0.5


@contextmanager
def cpu_watch(what: str, on: bool = True):
    """Around a CPU-bound step (the learner's update on a CPU): yields a dict that holds, on exit, `threads`
    (torch's) and `cpu_busy_others` (cores other processes kept busy meanwhile: the machine's busy time less
    this process's, over the wall time), and logs one warning line when the machine was oversubscribed."""
    out: dict = {}
    if not on or _busy_s() is None:  # not Linux: no /proc/stat
        yield out
        return
    t0, own0, busy0 = time.perf_counter(), _own_s(), _busy_s()
    yield out
    wall = time.perf_counter() - t0
    import torch  # loaded by now: the block ran the learner

    own, busy = _own_s() - own0, _busy_s() - busy0
    threads, n_cores = torch.get_num_threads(), os.cpu_count() or 1
    others = max(busy - own, 0.0) / wall if wall > 0 else 0.0
    out.update(threads=threads, cpu_busy_others=round(others, 2))
    if wall > 1 and oversubscribed(threads, others, n_cores):
        log.warning(
            f"{what}: other processes kept {others:.1f} of the machine's {n_cores} cores busy while it ran "
            f"{threads} torch threads, which then wait on each other (several times slower); set {ENV}=1 or "
            f"cores/K for K processes sharing the machine (docs/setup.md)"
        )


def _own_s() -> float:
    """CPU seconds of this process, all its threads."""
    t = os.times()
    return t.user + t.system


def _busy_s() -> float | None:
    """CPU seconds the machine's cores spent busy since boot, all processes (Linux's /proc/stat); None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal (guest time is in user already)
    return sum(fields[:3] + fields[5:8]) / os.sysconf("SC_CLK_TCK")
