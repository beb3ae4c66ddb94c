"""An OpenEnv environment server on 127.0.0.1, as its users run one: uvicorn serving the FastAPI app that
openenv-core's `create_app` makes of their environment, in a process of its own (for the tests, the README's
example and benchmarks/agent_calculator.py).

    with openenv_server("openenv_envs:guess_app", tmp_path, app_dir="tests") as server:
        ...  # rollout.environment=server.url (http://127.0.0.1:<a free port>); server.proc: its process
"""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from grpo.runtime.procs import free_port, stop_group, tied_to_this_process
from tools.readiness import answers, wait_ready


@dataclass(frozen=True)
class Server:
    url: str
    proc: subprocess.Popen


class OpenEnvServerError(RuntimeError):
    """The server exited or did not answer /health in time."""


@contextmanager
def openenv_server(app: str, home: Path, app_dir: str | Path = ".", timeout: float = 120):
    """`python -m uvicorn <app>` on a free port of 127.0.0.1, `app` a `module:attribute` importable from `app_dir`
    (relative to this repository); yields the server (`url`, `proc`) once /health answers; stopped (its process
    group) on exit. Its log is home/openenv-<port>.log."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = home / f"openenv-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                app,
                "--app-dir",
                str(app_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            cwd=Path(__file__).resolve().parents[1],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=tied_to_this_process(),
        )
    url = f"http://127.0.0.1:{port}"
    try:
        what = f"OpenEnv server {app} (/health at {url})"
        wait_ready(proc, lambda: answers(f"{url}/health"), log, timeout, what, OpenEnvServerError, poll_s=0.2)
        yield Server(url, proc)
    finally:
        stop_group(proc)
