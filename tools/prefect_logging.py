"""Prefect's logging for the servers and workers grpo-flow starts: Prefect's own configuration
(tools/prefect_logging.yml, named by prefect.toml and tools/prefect_server.py) with this filter on the console."""

from __future__ import annotations

import logging

SETTINGS_PATH = __file__.removesuffix(".py") + ".yml"


class SqliteBusyOneLine(logging.Filter):
    """A record raised by SQLite's "database is locked" becomes one line, without its traceback.

    A Prefect server on SQLite runs `mark_deployments_ready` after each worker's poll in a transaction that
    reads, then writes; SQLite refuses the write while another connection writes, and Prefect's task queue
    (docket) retries the task, logging each try as an ERROR with a 120-line traceback (with four workers
    polling, one a second; 66 in 17 minutes of one run). Nothing is lost, so a retried try is a DEBUG line, shown
    only where the logger is at DEBUG (`PREFECT_LOGGING_ROOT_LEVEL=DEBUG`); any other record keeps its level.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or "database is locked" not in str(error):
            return True
        record.msg, record.args = f"{record.getMessage()}: database is locked (SQLite was busy)", None
        record.exc_info, record.exc_text = None, None
        if record.name == "docket.dependencies":  # docket's Retry: the task runs again
            record.msg += "; retried"
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True
