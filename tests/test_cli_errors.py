"""Errors from storage, the network, the OS and bad arguments reach the user as one line, exit 2."""

import errno
import socket

import pytest

from flows.cli import main
from grpo.storage import Storage


@pytest.fixture(autouse=True)
def fresh_s3_clients():
    """s3fs caches one client per set of arguments, not per environment: the wrong keys of a test
    must not serve the next test's storage."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


def run(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


def test_bad_iteration_argument(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--storage", str(tmp_path), "stage", "rollouts", "--run", "r", "--iteration", "abc"])
    assert e.value.code == 2
    assert "'abc' is not an iteration: give an integer >= 0 or 'next'" in capsys.readouterr().err


def test_a_run_id_too_long_for_a_file_name(tmp_path, capsys):
    code, err = run(capsys, "--storage", str(tmp_path), "init", "--run", "r" * 300)
    assert code == 2 and len(err.splitlines()) == 1 and "must be a name of 1-128 characters" in err


def test_disk_full_names_the_file_and_commits_nothing(tmp_path, capsys, monkeypatch):
    def full(self, path, data):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(Storage, "write_bytes_atomic", full)
    code, err = run(
        capsys,
        "--storage",
        str(tmp_path),
        "init",
        "--run",
        "r",
        "--set",
        "model.hidden_size=64",
        "--set",
        "model.num_heads=2",
    )
    assert code == 2 and len(err.splitlines()) == 1
    assert "no space left on the device writing" in err and "run.json" in err


def test_s3_endpoint_down_is_one_line(tmp_path, capsys, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    code, err = run(capsys, "--storage", "s3://bucket/prefix", "status", "--run", "r")
    assert code == 2 and len(err.splitlines()) == 1
    assert "S3 endpoint unreachable" in err and "AWS_ENDPOINT_URL" in err


@pytest.mark.s3
def test_s3_wrong_secret_is_one_line(s3, capsys, monkeypatch):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    code, err = run(capsys, "--storage", f"s3://{s3.bucket}/wrong", "status", "--run", "r")
    assert code == 2 and len(err.splitlines()) == 1
    assert "S3 refused the request" in err or "AWS_SECRET_ACCESS_KEY" in err
