"""The local SeaweedFS S3 server, and how s3fs / DuckDB / pandas behave against it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.s3

s3fs = pytest.importorskip("s3fs")


def _fs(ep, **kw):
    # skip_instance_cache: s3fs hands back the same (cached) instance for equal
    # args, which would hide cross-client effects
    return s3fs.S3FileSystem(skip_instance_cache=True, **ep.storage_options(), **kw)


def _key(url: str) -> str:
    return url.removeprefix("s3://")


def test_roundtrip_write_list_read_delete(s3, s3_prefix):
    fs = _fs(s3)
    root = _key(s3_prefix)
    fs.pipe_file(f"{root}/a.txt", b"alpha")
    with fs.open(f"{root}/sub/b.bin", "wb") as f:
        f.write(b"\x00\x01" * 1000)
    fs.pipe({f"{root}/sub/c.json": b'{"c": 1}', f"{root}/d.txt": b"delta"})

    assert sorted(fs.ls(root, detail=False)) == sorted([f"{root}/a.txt", f"{root}/d.txt", f"{root}/sub"])
    assert sorted(fs.find(root)) == sorted(
        [f"{root}/a.txt", f"{root}/d.txt", f"{root}/sub/b.bin", f"{root}/sub/c.json"]
    )
    assert fs.cat_file(f"{root}/a.txt") == b"alpha"
    with fs.open(f"{root}/sub/b.bin", "rb") as f:
        assert f.read() == b"\x00\x01" * 1000
    assert fs.info(f"{root}/sub/b.bin")["size"] == 2000
    assert fs.cat_file(f"{root}/a.txt", start=1, end=3) == b"lp"  # ranged GET

    fs.rm(f"{root}/a.txt")
    assert not fs.exists(f"{root}/a.txt")
    fs.rm(f"{root}/sub", recursive=True)
    assert fs.find(root) == [f"{root}/d.txt"]
    fs.rm(root, recursive=True)
    # SeaweedFS quirk (unlike AWS): the emptied prefix can linger as a "directory"
    # (CommonPrefix; exists()/isdir() True) for a while, so only count objects.
    remaining = fs.find(root, detail=True)
    assert [p for p, info in remaining.items() if info["type"] == "file"] == []


def test_credentials_are_enforced(s3):
    wrong = s3fs.S3FileSystem(
        skip_instance_cache=True,
        key=s3.access_key,
        secret="not-the-secret",
        client_kwargs={"endpoint_url": s3.endpoint_url},
    )
    anon = s3fs.S3FileSystem(skip_instance_cache=True, anon=True, client_kwargs={"endpoint_url": s3.endpoint_url})
    for fs in (wrong, anon):
        with pytest.raises(PermissionError):
            fs.ls(s3.bucket)


def test_object_visible_only_after_close(s3, s3_prefix):
    writer, reader = _fs(s3), _fs(s3)
    small, big = _key(s3_prefix) + "/small.bin", _key(s3_prefix) + "/big.bin"

    f = writer.open(small, "wb")
    f.write(b"x" * 100_000)
    f.flush()  # below block size: nothing sent yet
    assert not reader.exists(small)
    f.close()  # single PUT
    assert reader.info(small)["size"] == 100_000

    f = writer.open(big, "wb", block_size=5 * 2**20)
    f.write(os.urandom(11 * 2**20))
    f.flush()  # multipart upload started, parts sent, not completed
    assert not reader.exists(big)
    f.close()  # CompleteMultipartUpload
    assert reader.info(big)["size"] == 11 * 2**20

    # an overwrite in progress does not disturb readers of the old object
    writer.pipe_file(small, b"old")
    f = writer.open(small, "wb")
    f.write(b"new")
    f.flush()
    assert reader.cat_file(small) == b"old"
    f.close()
    assert reader.cat_file(small) == b"new"


def test_listing_cache_and_how_to_avoid_it(s3, s3_prefix):
    """s3fs caches directory listings per instance; another client's writes are
    not seen by ls/glob/exists/info/cat_file of a cached directory until
    refresh/invalidate. Instances with use_listings_cache=False always list."""
    root = _key(s3_prefix)
    cached, nocache, other = _fs(s3), _fs(s3, use_listings_cache=False), _fs(s3)
    other.pipe_file(f"{root}/a", b"a")
    cached.ls(root)
    nocache.ls(root)
    other.pipe_file(f"{root}/b", b"b")

    assert nocache.ls(root, detail=False) == [f"{root}/a", f"{root}/b"]
    assert nocache.cat_file(f"{root}/b") == b"b"
    assert cached.ls(root, detail=False, refresh=True) == [f"{root}/a", f"{root}/b"]
    other.pipe_file(f"{root}/c", b"c")
    cached.invalidate_cache(root)
    assert cached.cat_file(f"{root}/c") == b"c"


def test_env_vars_alone_configure_child_process(s3, s3_prefix):
    """AWS_ENDPOINT_URL etc. are enough for fsspec.url_to_fs / pandas in a child."""
    fs = _fs(s3)
    fs.pipe_file(_key(s3_prefix) + "/hello.txt", b"from parent")
    code = textwrap.dedent(
        f"""
        import fsspec
        fs, path = fsspec.url_to_fs({s3_prefix + "/hello.txt"!r})
        assert fs.cat_file(path) == b"from parent", fs.cat_file(path)
        fs.pipe_file(path + ".reply", b"from child")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3.env())
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    assert fs.cat_file(_key(s3_prefix) + "/hello.txt.reply") == b"from child"


def test_duckdb_reads_parquet_through_registered_s3fs(s3, s3_prefix):
    duckdb = pytest.importorskip("duckdb")
    pd = pytest.importorskip("pandas")
    # DuckDB's httpfs extension cannot be downloaded here: hand it s3fs instead.
    # use_listings_cache=False so globs see files written by other processes.
    fs = _fs(s3, use_listings_cache=False)
    for i in range(3):
        with fs.open(f"{_key(s3_prefix)}/part-{i}.parquet", "wb") as f:
            pd.DataFrame({"i": range(10 * i, 10 * i + 10), "part": i}).to_parquet(f)
    fs.pipe_file(f"{_key(s3_prefix)}/README.txt", b"not parquet")

    con = duckdb.connect()
    con.register_filesystem(fs)
    one = con.sql(f"SELECT count(*), sum(i) FROM read_parquet('{s3_prefix}/part-0.parquet')")
    assert one.fetchall() == [(10, 45)]
    glob = con.sql(f"SELECT count(*), sum(i) FROM read_parquet('{s3_prefix}/*.parquet')")
    assert glob.fetchall() == [(30, 435)]
    files = [f"{s3_prefix}/part-0.parquet", f"{s3_prefix}/part-2.parquet"]
    lst = con.sql(f"SELECT part, count(*) FROM read_parquet({files!r}) GROUP BY 1 ORDER BY 1")
    assert lst.fetchall() == [(0, 10), (2, 10)]

    # DuckDB can write through it too
    con.sql(f"COPY (SELECT 42 AS x) TO '{s3_prefix}/out.parquet' (FORMAT parquet)")
    assert con.sql(f"SELECT x FROM '{s3_prefix}/out.parquet'").fetchall() == [(42,)]
    con.close()


def test_pandas_parquet_with_storage_options(s3, s3_prefix):
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"prompt": ["a", "b"], "reward": [0.5, 1.0]})
    url = f"{s3_prefix}/df.parquet"
    df.to_parquet(url, storage_options=s3.storage_options(), index=False)
    back = pd.read_parquet(url, storage_options=s3.storage_options())
    pd.testing.assert_frame_equal(back, df)


def _port_open(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0


def _weed_pids(workdir) -> list[int]:
    marker = f"-logdir={workdir}/logs".encode()
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        pids.append(int(d))
            except OSError:
                pass
    return pids


@pytest.mark.slow
def test_server_lifecycle_restart_and_cleanup(tmp_path):
    """A second, private server: data survives a restart in the same workdir,
    and stopping leaves no process group and no listening port behind."""
    from tools.s3server import find_weed, s3_server

    if find_weed() is None:
        pytest.skip("weed binary not found")
    with s3_server(tmp_path, bucket="lifecycle") as ep:
        assert ep.endpoint_url.startswith("http://127.0.0.1:")
        _fs(ep).pipe_file("lifecycle/k", b"v")
        first_url = ep.endpoint_url
    assert not _port_open(first_url)

    with s3_server(tmp_path, bucket="lifecycle") as ep:  # bucket already exists: fine
        assert _fs(ep).cat_file("lifecycle/k") == b"v"
        pids = _weed_pids(tmp_path)
        assert len(pids) == 1
        pgid = os.getpgid(pids[0])
        assert pgid != os.getpgid(0)  # own session / process group
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)  # the whole group is gone
    assert not _port_open(ep.endpoint_url)
    assert _weed_pids(tmp_path) == []


def test_started_in_the_background_of_a_script_one_sigint_stops_it(tmp_path):
    """A job started with `&` by a non-interactive shell inherits SIGINT ignored; `python -m tools.s3server` takes
    it back, so one Ctrl-C or `kill -INT` stops it (and its SeaweedFS) as in a terminal, not only a second signal."""
    import signal
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    log = tmp_path / "s3.log"
    script = f"{sys.executable} -m tools.s3server {tmp_path / 'wd'} > {log} 2>&1 & echo $!"
    pid = int(subprocess.run(["bash", "-c", script], cwd=root, capture_output=True, text=True, check=True).stdout)
    try:
        deadline = time.monotonic() + 180
        while "export AWS_ENDPOINT_URL" not in log.read_text():
            assert time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"), log.read_text()
            time.sleep(0.5)
        with open(f"/proc/{pid}/status") as f:  # the shell's rule: the job's SIGINT was ignored at its start
            assert int(next(line for line in f if line.startswith("SigIgn")).split()[1], 16) & 2 == 0
        os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid}") and "State:\tZ" not in open(f"/proc/{pid}/status").read():
            assert time.monotonic() < deadline, "still running after one SIGINT"
            time.sleep(0.5)
    finally:
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGKILL)
