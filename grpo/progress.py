"""Progress inside a stage, for people watching: `rollouts 3: 128/256 prompts`, `learn 3: step 5/16`.

A stage calls `progress(...)` after each piece of long work (or a `Progress` as its parts end, at most every
few seconds: the rollouts stage's prompts as their samples end inside a chunk); that is a log record on `grpo.progress`
(INFO), so `-v` and Prefect's run log show it as lines like any other. `grpo` in a terminal shows it
as one line on stderr, rewritten in place and erased when the work is done (`TerminalLine`); piped
or redirected output gets none of it. A learner process under torchrun prints it to its stdout with
PREFIX instead (no logging there); grpo.learner.launch turns such lines back into `progress` calls.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TextIO

log = logging.getLogger("grpo.progress")
PREFIX = "grpo-progress: "
TO_STDOUT = "GRPO_PROGRESS_STDOUT"  # set in torchrun's workers by grpo.learner.launch


def progress(what: str, done: int, total: int, unit: str = "") -> None:
    """`what: done/total unit`, e.g. progress("rollouts 3", 128, 256, "prompts")."""
    text = f"{what}: {done}/{total}" + (f" {unit}" if unit else "")
    if os.environ.get(TO_STDOUT):
        print(PREFIX + text, flush=True)
    else:
        log.info(text, extra={"progress_done": done >= total})


class Progress:
    """progress() of one piece of work of `total` units: `report(done)` at the end of each part, always shown;
    `report.part(done)` as units end within a part, shown at most every `every_s` seconds (a sampler calls it
    at every decoding step).

    >>> report = Progress("rollouts 3", 256, "prompts", every_s=60)
    >>> report.part(5), report.part(9), report(128), report.shown
    (None, None, None, 128)
    """

    def __init__(self, what: str, total: int, unit: str = "", every_s: float = 2.0):
        self.what, self.total, self.unit, self.every_s = what, total, unit, every_s
        self.shown, self.at = 0, time.monotonic()

    def __call__(self, done: int) -> None:
        progress(self.what, done, self.total, self.unit)
        self.shown, self.at = done, time.monotonic()

    def part(self, done: int) -> None:
        if done > self.shown and time.monotonic() - self.at >= self.every_s:
            self(done)

    def end(self) -> None:
        """The work is done: said (and a terminal's line erased) where a part was shown, else nothing."""
        if 0 < self.shown < self.total:
            self(self.total)


def relay(line: str) -> bool:
    """A worker's stdout line: re-emit it as progress and return True when it is one.

    >>> relay("grpo-progress: learn 3: step 5/16"), relay("loss 0.3")
    (True, False)
    """
    if not line.startswith(PREFIX):
        return False
    log.info(line[len(PREFIX) :].rstrip(), extra={"progress_done": _done(line)})
    return True


def _done(line: str) -> bool:
    counts = line.rsplit(": ", 1)[-1].split()[0]
    done, _, total = counts.partition("/")
    return done == total


class TerminalLine(logging.Handler):
    """Shows each progress record as the one line at the bottom of a terminal, erased when done."""

    def __init__(self, stream: TextIO = sys.stderr):
        super().__init__(logging.INFO)
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        text = "" if getattr(record, "progress_done", False) else record.getMessage()
        self.stream.write(f"\r{text}\033[K")  # \033[K: erase the rest of the line
        self.stream.flush()


def show_in_terminal(stream: TextIO = sys.stderr) -> bool:
    """Show progress on `stream` when it is a terminal; returns whether it does."""
    if not stream.isatty() or any(isinstance(h, TerminalLine) for h in log.handlers):
        return False
    log.addHandler(TerminalLine(stream))
    log.setLevel(logging.INFO)
    return True
