"""One formatter and linter for every file (ruff, configured in pyproject.toml): CI fails on a file
that does not read as the rest. Fix with `.venv/bin/ruff format . && .venv/bin/ruff check --fix .`."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff(command):
    assert RUFF.exists(), f"{RUFF} is missing: install the dev extra (./setup.sh does)"
    proc = subprocess.run([str(RUFF), *command, "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
