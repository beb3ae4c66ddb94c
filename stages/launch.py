"""Starting learner processes: torchrun on this machine, one process per device (gloo on CPU, NCCL on
GPUs), each running `worker_main`, the same update code as one process runs in-process.

stages/learn.py writes the arguments (config, batch, checkpoint folders, output folder) to a file, calls
`run_distributed`, and commits what rank 0 and the others wrote once every process has exited cleanly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from grpo.procs import free_port
from stages.common import StageError, log


def run_distributed(args: dict, nproc: int) -> dict:
    """Run `train` under torchrun; forward its output lines to the log; return rank 0's summary."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(args, f)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "stages.launch",
        f.name,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
    )
    tail = []
    for line in proc.stdout:
        log.info("learn[torchrun] %s", line.rstrip())
        tail = (tail + [line])[-20:]
    if proc.wait() != 0:
        raise StageError(f"learn under torchrun exited with {proc.returncode}:\n{''.join(tail)}")
    return json.loads(Path(args["summary"]).read_text())


def worker_main(args_path: str) -> None:
    args = json.loads(Path(args_path).read_text())
    from grpo.config import load_config
    from stages.learn import new_learner, train_and_save  # the same code as in one process

    cfg = load_config(args["config"])
    batch = torch.load(args["batch"], weights_only=False)
    learner = new_learner(
        cfg, args["iteration"], args["policy_dir"], args["ref_dir"], args["state_dir"], args["adapter_dir"]
    )
    summary = train_and_save(learner, args["run_id"], args["iteration"], batch, args["out_dir"])
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args["summary"]).write_text(json.dumps(summary))


if __name__ == "__main__":
    worker_main(sys.argv[1])
