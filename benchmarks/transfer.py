"""Seconds to commit and to load a checkpoint through S3, the code before and after a change, side by side.

    .venv/bin/python benchmarks/transfer.py --before DIR [--mb 300] [--files 4]

DIR holds the code to compare against (e.g. `git archive <commit> | tar -x -C DIR`). A local SeaweedFS
server (tools/s3server.py) runs for the benchmark; a folder of `--files` safetensors files of random
float16 weights, `--mb` MB in all, plus a config.json, is the checkpoint. For each code, in a fresh process
with an empty GRPO_CACHE:

- commit: a learn attempt (StageWriter), upload_folder of the checkpoint, commit (its files hashed);
- load: what a stage that reads the policy does, in another fresh process and cache: committed_input
  (the attempt's manifest, and before this change every file verified) and local_checkpoint (downloaded).

Each code commits into its own run on the same server; the after code's io counts are printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from tools.s3server import s3_server

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import contextlib, json, sys, time
from grpo.record.checkpoint import local_checkpoint, upload_folder
from grpo.record.layout import stage_dir
from grpo.record.lineage import committed_input
from grpo.record.commit import StageWriter
from grpo.record.storage import open_storage

try:
    from grpo.record.counts import counting_io
except ImportError:  # code from before the io counters
    counting_io = contextlib.nullcontext

what, url, run, folder = sys.argv[1:5]
storage = open_storage(url)
t0 = time.perf_counter()
with counting_io() as io:
    if what == "commit":
        sdir = stage_dir(storage, run, 0, "learn")
        w = StageWriter(storage, sdir, run_id=run, iteration=0, stage="learn", config={}, inputs={})
        upload_folder(w, folder)
        c = w.commit()
        w.close()
    else:
        c = committed_input(storage, run, 0, "learn")
        local_checkpoint(c)
print(json.dumps({"s": time.perf_counter() - t0, "io": io and io.record()}))
"""


def make_checkpoint(folder: Path, mb: int, files: int) -> None:
    """`files` safetensors files of random float16 weights, `mb` MB in all, and a config.json."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    per_file = mb * 10**6 // files // 2  # float16 values a file
    for i in range(files):
        bits = rng.integers(0, 2**16, size=per_file, dtype=np.uint16).view(np.float16)
        save_file({"w": bits}, str(folder / f"model-{i + 1:05d}-of-{files:05d}.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "benchmark"}))


def timed(code: Path, what: str, url: str, run: str, folder: Path, env: dict) -> float:
    with tempfile.TemporaryDirectory() as cache:
        child_env = {**os.environ, **env, "PYTHONPATH": str(code), "GRPO_CACHE": cache, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(
            [sys.executable, "-c", CHILD, what, url, run, str(folder)],
            env=child_env,
            cwd=code,
            capture_output=True,
            text=True,
        )
    if out.returncode:
        raise SystemExit(f"{what} with {code} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, type=Path, help="a folder with the code to compare against")
    ap.add_argument("--mb", type=int, default=300)
    ap.add_argument("--files", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, s3_server(Path(tmp, "s3")) as s3:
        folder = Path(tmp, "checkpoint")
        folder.mkdir()
        make_checkpoint(folder, args.mb, args.files)
        size = sum(p.stat().st_size for p in folder.iterdir())
        url = s3.url("transfer")
        results = {}
        for name, code in [("before", args.before.resolve()), ("after", ROOT)]:
            results[name] = {what: timed(code, what, url, name, folder, s3.env()) for what in ("commit", "load")}
        print(f"checkpoint: {args.files} safetensors files + config.json, {size / 1e6:.0f} MB; local SeaweedFS S3")
        print(f"{'':8}{'before s':>10}{'after s':>10}{'speed-up':>10}")
        for what in ("commit", "load"):
            b, a = results["before"][what]["s"], results["after"][what]["s"]
            print(f"{what:8}{b:10.2f}{a:10.2f}{b / a:9.1f}x")
        for what in ("commit", "load"):
            print(f"after, {what}, io:", json.dumps(results["after"][what]["io"]))


if __name__ == "__main__":
    main()
