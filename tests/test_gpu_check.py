"""benchmarks/gpu_check.py at toy size on the CPU, so the script a GPU machine runs cannot rot."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_gpu_check_runs_three_warm_flow_iterations_and_reports(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--tiny"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "PREFECT_HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("iter"))) + 1 :][:3]
    assert [int(row.split()[0]) for row in table] == [0, 1, 2]
    assert all(float(row.split()[1]) > 0 and float(row.split()[3]) > 0 for row in table)  # rollout, learner tok/s
    assert "'dtype': 'bfloat16'" in proc.stdout and "vLLM alone" in proc.stdout and "OK: gap" in proc.stdout
    assert "(full, lora)" in proc.stdout  # the LoRA case ran on the CPU too, within the gap
    assert "fsdp2: skipped, needs 2 GPUs" in proc.stdout
