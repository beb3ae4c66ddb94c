"""The stages' and vLLM's log records in the Prefect run log."""

from __future__ import annotations

import logging
from contextlib import contextmanager

from prefect.logging.handlers import APILogHandler

from grpo.runtime.quiet import HarmlessFilter, quiet_libraries

FORWARDED_LOGGERS = ("grpo", "vllm")


@contextmanager
def stage_logs_to_prefect():
    """Send the stages' and vLLM's log records to the Prefect run log while the flow runs; libraries quiet
    as in the CLI (no progress bars between the worker's lines)."""
    quiet_libraries()  # VLLM_CONFIGURE_LOGGING=0 among them: else importing vLLM drops our handler
    added = []
    for name in FORWARDED_LOGGERS:
        logger = logging.getLogger(name)
        if any(isinstance(h, APILogHandler) for h in logger.handlers):
            continue  # already sent (PREFECT_LOGGING_EXTRA_LOGGERS names it)
        handler = APILogHandler()
        if name == "vllm":  # the run log carries vLLM's warnings that matter, not its INFO
            handler.addFilter(HarmlessFilter())
        added.append((logger, handler, logger.level))
        logger.addHandler(handler)
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
    try:
        yield
    finally:
        for logger, handler, level in added:
            logger.removeHandler(handler)
            logger.setLevel(level)
