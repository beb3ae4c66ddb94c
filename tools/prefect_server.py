"""A real Prefect server and process worker on 127.0.0.1, for end-to-end tests, benchmarks and trying deployments.

    with prefect_server(tmp / "prefect") as server:           # temporary PREFECT_HOME, SQLite
        server.cli("work-pool", "create", "grpo-pool", "--type", "process", "--overwrite")
        server.cli("--no-prompt", "deploy", "--all", cwd=repo)
        with process_worker(server, "grpo-pool", cwd=repo) as worker:
            server.cli("deployment", "run", "grpo/iteration", "--watch")

Every process runs in its own session and is stopped with its whole process
group (SIGTERM, then SIGKILL), the worker before the server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil

from grpo.runtime.procs import free_port, stop_group, tail
from tools.prefect_logging import SETTINGS_PATH
from tools.readiness import answers, wait_ready

PREFECT = str(Path(sys.executable).with_name("prefect"))


class PrefectServerError(RuntimeError):
    pass


@dataclass
class PrefectServer:
    api_url: str
    home: Path
    env: dict[str, str]
    """Environment for anything that talks to this server (PREFECT_HOME, PREFECT_API_URL, ...)."""

    def cli(
        self, *args: str, cwd: str | Path | None = None, timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess:
        """`prefect <args>` against this server; output captured, failure raises with it."""
        res = subprocess.run(
            [PREFECT, *args],
            cwd=cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )
        if check and res.returncode != 0:
            raise PrefectServerError(
                f"prefect {' '.join(args)} exited {res.returncode}:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
            )
        return res

    def api(self, method: str, path: str, body: dict | None = None):
        """One JSON request to the server's REST API."""
        req = urllib.request.Request(
            f"{self.api_url}{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or "null")

    def flow_run(self, flow_run_id: str) -> dict:
        return self.api("GET", f"/flow_runs/{flow_run_id}")

    def wait_for_flow_run(self, flow_run_id: str, timeout: float, poll_s: float = 2) -> dict:
        """Poll until the flow run reaches a final state; return it. Times out with its state."""
        deadline = time.monotonic() + timeout
        while True:
            run = self.flow_run(flow_run_id)
            if run["state"] and run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                return run
            if time.monotonic() > deadline:
                raise PrefectServerError(f"flow run {flow_run_id} still {run['state']} after {timeout:.0f}s")
            time.sleep(poll_s)

    def flow_run_states(self, flow_run_id: str) -> list[dict]:
        """The flow run's state history (`type`, `name`, `timestamp`, `message`, ...), oldest
        first: the states the server accepted, or set itself when it rejected a proposal."""
        states = self.api("GET", f"/flow_run_states/?flow_run_id={flow_run_id}")
        return sorted(states, key=lambda s: datetime.fromisoformat(s["timestamp"]))

    def log_tails(self, n: int = 80, pattern: str | None = None) -> str:
        """The last `n` lines of the server's log and of every worker's log under PREFECT_HOME;
        with `pattern`, the last `n` of those lines that match it (`re.search`)."""
        return "\n".join(
            f"--- {log.name} (last {n} {'matching ' if pattern else ''}lines)\n{tail(log, n, pattern)}"
            for log in sorted(self.home.glob("*.log"))
        )

    def logs(self, flow_run_id: str) -> list[dict]:
        """The flow run's log records (its tasks' included; `name`, `message`, ...), oldest first."""
        rows, offset = [], 0
        while batch := self.api(
            "POST",
            "/logs/filter",
            {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_ASC", "limit": 200, "offset": offset},
        ):
            rows += batch
            offset += len(batch)
        return rows

    def artifacts(self, flow_run_id: str) -> list[dict]:
        return self.api("POST", "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})


@contextmanager
def prefect_server(home: Path, timeout: float = 180):
    """A `prefect server start` on 127.0.0.1 with SQLite under `home`; yields a PrefectServer."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",  # no client analytics (and no first-run notice)
        "PREFECT_LOGGING_SETTINGS_PATH": SETTINGS_PATH,  # SQLite's retried "database is locked": one line
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_CLI_COLORS": "false",
        "PREFECT_CLI_WRAP_LINES": "false",
    }
    log = home / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        what = f"prefect server (/health at {api_url})"
        wait_ready(proc, lambda: answers(f"{api_url}/health"), log, timeout, what, PrefectServerError)
        yield PrefectServer(api_url=api_url, home=home, env=env)
    finally:
        if "prefect.logging.handlers" in sys.modules:  # this process's run-log lines still queued: sent now, or
            # its log worker retries the stopped server for a minute at exit ("Error logging to API")
            sys.modules["prefect.logging.handlers"].APILogHandler().flush()
        stop_group(proc)


@contextmanager
def process_worker(
    server: PrefectServer, pool: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120
):
    """`prefect worker start --pool <pool>` in `cwd`; yields the Popen (its log file as `.log`)."""
    log = server.home / f"worker-{pool}.log"
    worker_env = {**server.env, **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [PREFECT, "worker", "start", "--pool", pool, "--type", "process"],
            cwd=cwd,
            env=worker_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proc.log = log  # type: ignore[attr-defined]
    try:
        what = f"prefect worker of pool {pool}"
        wait_ready(proc, lambda: "started!" in log.read_text(errors="replace"), log, timeout, what, PrefectServerError)
        yield proc
    finally:
        stop_group(proc)


def flow_run_processes(worker: subprocess.Popen) -> list[psutil.Process]:
    """The worker's child processes that execute flow runs."""
    return [p for p in psutil.Process(worker.pid).children() if "python" in p.name().lower()]
