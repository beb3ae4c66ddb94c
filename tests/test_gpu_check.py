"""benchmarks/gpu_check.py at toy size on the CPU, so the script a GPU machine runs cannot rot."""

import importlib.util
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what the GPU machine lacks: the hf/no-flow path must run without any of them
ABSENT_ON_GPU = ("prefect", "vllm", "duckdb", "s3fs", "datasets", "math_verify", "latex2sympy2_extended", "antlr4")


def run_check(tmp_path, *args: str, hidden: tuple[str, ...] = ()) -> str:
    """gpu_check.py --tiny's stdout (it must exit 0); `hidden` modules fail to import, as if not installed
    (None in sys.modules: `import` raises, importlib.util.find_spec answers None, forked workers inherit it)."""
    code = (
        f"import runpy, sys; sys.modules.update(dict.fromkeys({hidden!r})); "
        "runpy.run_path('benchmarks/gpu_check.py', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "--tiny", *args],  # sys.argv[1:] are the script's arguments
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PREFECT_HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def tables(stdout: str) -> list[list[list[str]]]:
    """Each case's table: per iteration, its row's fields."""
    lines = stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("iter")]
    return [
        [row.split() for row in itertools.takewhile(lambda r: r[:4].strip().isdigit(), lines[i + 1 :])] for i in starts
    ]


def assert_iterations(table: list[list[str]], n: int) -> None:
    assert [int(row[0]) for row in table] == list(range(n))
    assert all(float(row[1]) > 0 and float(row[3]) > 0 for row in table)  # rollout, learner tok/s


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.slow
def test_gpu_check_runs_warm_flow_iterations_and_reports(tmp_path):
    out = run_check(tmp_path, "--iterations", "2")  # a GPU runs 3; 2 show the warm reload (CI time)
    assert_iterations(tables(out)[0], 2)
    assert "'dtype': 'bfloat16'" in out and "vLLM alone" in out and "OK: gap" in out
    assert "(full, lora)" in out  # the LoRA case ran on the CPU too, within the gap
    assert "fsdp2: skipped, needs 2 GPUs" in out
    # TRL's side of the comparison runs against the TRL installed (dev extra), in float32 without Liger on a CPU
    assert re.search(r"TRL [\d.]+ GRPOTrainer, float32 on the CPU, no Liger .*: learner \d+ tok/s", out), out[-3000:]


@pytest.mark.slow
def test_gpu_check_runs_with_transformers_sampling_and_no_prefect(tmp_path):
    """--backend hf --no-flow: what a GPU machine without vLLM or Prefect runs."""
    out = run_check(tmp_path, "--backend", "hf", "--no-flow", "--cases", "full", "lora", hidden=ABSENT_ON_GPU)
    found = tables(out)
    assert len(found) == 2
    for table in found:
        assert_iterations(table, 3)
    assert "'backend': 'hf'" in out and "vLLM alone: not measured (--backend hf)" in out
    assert "OK: gap" in out and "(full, lora)" in out
    # issue 34: token-budget microbatches, the device's kernels, the extra iteration's learn profiled, TRL's line
    assert out.count("learner kernels: {'attention': ['flash_attention', 'math'], 'logprobs': 'torch'}") == 2
    assert "policy forward/backward" in out and "host syncs" in out
    assert "TRL: not measured (it does not import here: ModuleNotFoundError: import of datasets halted" in out
