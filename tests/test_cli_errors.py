"""Errors from storage, the network, the OS and bad arguments reach the user as one line, exit 2."""

import errno
import socket

import pytest

from flows.cli import main
from grpo.record.storage import Storage


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


@pytest.mark.parametrize(
    "settings, says",
    [
        (["lr=1e-3"], ["unknown setting 'lr': did you mean learn.lr or sft.lr?"]),
        (["learn.lrr=1e-3"], ["unknown setting 'learn.lrr': did you mean learn.lr or sft.lr?"]),
        (["vllm.enable_lora=true"], ["unknown setting 'vllm': did you mean rollout.vllm?"]),
        (  # every bad value at once
            ["learn.lr=abc", "rollout.group_size=x", "zzz=1"],
            ["learn.lr: expected a number, got 'abc'", "rollout.group_size: expected an integer", "'zzz'; valid in"],
        ),
        (
            ["rollout.prompts_per_iteration=3", "learn.minibatch_size=16", "learn.microbatch_size=8"],
            ["rollout.prompts_per_iteration x rollout.group_size = 3 x 8 = 24", "learn.minibatch_size (16)"],
        ),
    ],
)
def test_config_errors_suggest_the_setting_and_report_every_bad_value(tmp_path, capsys, settings, says):
    code, err = run(
        capsys, "--storage", str(tmp_path), "init", "--run", "r", *[a for s in settings for a in ("--set", s)]
    )
    assert code == 2 and len(err.splitlines()) == 1
    for text in says:
        assert text in err
    assert not (tmp_path / "runs" / "r").exists()  # nothing written


def test_a_rerun_stage_says_it_did_nothing_and_a_summary_prints_aligned(tmp_path, capsys):
    from test_stages import TINY

    store = ["--storage", str(tmp_path)]
    assert main(store + ["init", "--run", "r", *[a for s in TINY for a in ("--set", s)]]) == 0
    assert main(store + ["stage", "snapshot", "--run", "r", "--iteration", "0"]) == 0
    assert main(store + ["stage", "rollouts", "--run", "r", "--iteration", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    summary = lines[lines.index(next(s for s in lines if s.startswith("rollouts iteration 0: committed "))) + 1 :]
    assert (
        summary[0].startswith("  prompts:") and len({len(s) - len(s.split(":", 1)[1].lstrip()) for s in summary}) == 1
    )
    assert any(
        s.split(":", 1)[1].strip() == f"{float(s.split(':', 1)[1]):.4g}" for s in summary if "stop_fraction" in s
    )
    assert main(store + ["stage", "rollouts", "--run", "r", "--iteration", "0"]) == 0
    out = capsys.readouterr().out
    assert "rollouts iteration 0: already committed (" in out and "nothing to do; --force for a new attempt" in out
