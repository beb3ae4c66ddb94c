"""Prefect wiring of the GRPO stages: the flow `grpo` in flows/grpo.py, deployed by prefect.yaml.

Importing this package (before Prefect itself) turns Prefect's usage analytics off in grpo's processes, unless
the environment says otherwise: `python -m flows.grpo` without a server runs an ephemeral API whose telemetry
heartbeat, offline, fails on SQLite's lock with a 130-line traceback, and a first import in a terminal prints a
notice. prefect.toml does the same for `prefect server start` and workers started in the repo root. And the
ephemeral API gets 3 minutes to start, not 20 s: its first start migrates a new SQLite database, which on two
busy cores took longer than 20 s and failed the flow with a timeout.
"""

import os

for _name, _value in (
    ("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
    ("DO_NOT_TRACK", "1"),
    ("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180"),
):
    os.environ.setdefault(_name, _value)
