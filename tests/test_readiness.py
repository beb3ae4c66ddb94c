"""tools/readiness.py, the wait every server and worker of tools/ goes through: ready, exited first, never ready;
and its HTTP probe."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

import pytest

from grpo.runtime.procs import free_port, stop_group
from tools.readiness import answers, wait_ready


class Failed(RuntimeError):
    pass


def started(log, code: str) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def test_it_returns_once_the_probe_is_true(tmp_path):
    proc, calls = started(tmp_path / "log", "import time; time.sleep(60)"), []
    try:
        wait_ready(proc, lambda: calls.append(1) or len(calls) == 3, tmp_path / "log", 60, "sleeper", Failed, 0.01)
    finally:
        stop_group(proc)
    assert len(calls) == 3


def test_a_process_that_exits_first_is_one_line_and_its_log(tmp_path):
    proc = started(tmp_path / "log", "print('no config at /x'); raise SystemExit(3)")
    proc.wait()
    with pytest.raises(Failed) as e:
        wait_ready(proc, lambda: False, tmp_path / "log", 60, "the x server", Failed)
    first, *rest = str(e.value).splitlines()
    assert first == f"the x server exited 3 before it was ready: see why in {tmp_path / 'log'}, which ends:"
    assert rest == ["no config at /x"]


def test_a_process_never_ready_is_one_line_and_its_log(tmp_path):
    proc = started(tmp_path / "log", "print('listening elsewhere', flush=True); import time; time.sleep(60)")
    try:
        with pytest.raises(Failed, match=r"^the x server not ready after 0s: give it a longer timeout") as e:
            wait_ready(proc, lambda: False, tmp_path / "log", 0.05, "the x server", Failed, 0.01)
    finally:
        stop_group(proc)
    assert str(tmp_path / "log") in str(e.value).splitlines()[0]


def test_answers_is_a_200_now(tmp_path):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        assert answers(f"{url}/health") and not answers(f"{url}/starting")
    finally:
        server.shutdown()
        server.server_close()
    assert not answers(f"http://127.0.0.1:{free_port()}/health")  # nothing listens
