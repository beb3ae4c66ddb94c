"""What every learner process runs, in-process or as a torchrun rank (`python -m grpo.learner.rank ARGS`):
build the Learner, train, save; the main process writes the metrics and log-probs tables beside the
checkpoint in a local folder that the learn stage commits."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import torch

from grpo.config import RunConfig, load_config
from grpo.learner.batch import Batch, Scores
from grpo.learner.launch import LAUNCHER_PID
from grpo.learner.loop import train
from grpo.learner.state import STATE_DCP, Learner
from grpo.record.layout import Salt, iteration_seed
from grpo.runtime.procs import die_with_parent
from grpo.runtime.threads import cpu_watch
from schemas import table_file, write_parquet
from schemas.tables import FLOAT_LISTS


def new_learner(
    cfg: RunConfig, iteration: int, policy_dir: str, ref_dir: str, state_dir: str | None, adapter_dir: str | None
) -> Learner:
    return Learner(
        cfg,
        policy_dir,
        ref_dir,
        state_dir,
        shuffle_seed=iteration_seed(cfg.seed, iteration, Salt.LEARNER_SHUFFLE),
        adapter_dir=adapter_dir,
    )


def logprob_columns(run_id: str, iteration: int, batch: Batch, scores: Scores) -> dict:
    """The logprobs table's columns: each sample's old (and reference) log-probs, cut to its response."""
    mask = batch.response_mask.bool()  # (N, T), each row a prefix
    n = len(mask)
    offsets = pa.array(np.concatenate([[0], mask.sum(1).cumsum(0).numpy()]), pa.int32())

    def per_sample(x):  # (N, T) -> N lists of response length; nulls when not computed
        return pa.nulls(n, FLOAT_LISTS) if x is None else pa.ListArray.from_arrays(offsets, x[mask].numpy())

    return {
        "run_id": [run_id] * n,
        "iteration": [iteration] * n,
        "prompt_id": batch.prompt_id,
        "sample_index": batch.sample_index,
        "old_logprobs": per_sample(scores.old_logprobs),
        "ref_logprobs": per_sample(scores.ref_logprobs),
    }


def train_and_save(
    learner: Learner,
    run_id: str,
    iteration: int,
    batch: Batch,
    out_dir: str,
    state_dir: str | None = None,
    shards: bool = True,
) -> dict:
    """`grpo.learner.train`, then (main process) policy/, metrics and log-probs into the local folder out_dir,
    and optimizer.pt, rng.pt (master weights, or every process's dcp/ shards unless `shards` is False) into
    state_dir (out_dir where None). Returns the summary."""
    seed = iteration_seed(learner.cfg.seed, iteration, Salt.LEARNER_TORCH)
    with cpu_watch(f"learn {iteration}", on=learner.device.type == "cpu") as cpu:  # threads, a busy machine
        update = train(learner, run_id, iteration, batch, seed)
    learner.save(out_dir, state_dir, shards)  # every process: under fsdp2 each writes its shards
    if learner.acc.is_main_process:
        disk = fsspec.filesystem("file")  # out_dir is a local folder whatever the storage
        write_parquet(disk, f"{out_dir}/{table_file('learn_metrics')}", "learn_metrics", update.rows)
        write_parquet(
            disk,
            f"{out_dir}/{table_file('logprobs')}",
            "logprobs",
            logprob_columns(run_id, iteration, batch, update.scores),
        )
    learner.acc.wait_for_everyone()
    return {**update.summary, **cpu}


def worker_main(args_path: str) -> None:
    """A torchrun rank: the arguments grpo.learner.launch.learner_args wrote, then the code one process runs;
    it dies with its torchrun (grpo.learner.launch.torchrun_main), killed however."""
    if launcher := os.environ.get(LAUNCHER_PID):
        die_with_parent(signal.SIGKILL, int(launcher))
    args = json.loads(Path(args_path).read_text())
    cfg = load_config(args["config"])
    batch = torch.load(args["batch"], weights_only=False)
    learner = new_learner(
        cfg, args["iteration"], args["policy_dir"], args["ref_dir"], args["state_dir"], args["adapter_dir"]
    )
    later = args.get("shards")  # fsdp2 shards written once the policy is out (the learn commits it meanwhile)
    summary = train_and_save(
        learner, args["run_id"], args["iteration"], batch, args["out_dir"], args.get("state_out"), later is None
    )
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        Path(args["summary"]).write_text(json.dumps(summary))
    if later is not None:
        if rank == 0:
            Path(args["ready"]).touch()  # policy, tables, summary: all written (train_and_save ends in a barrier)
        learner.save_shards(later["dir"])
        if later.get("storage_url"):
            upload_own_shards(later, rank)


def upload_own_shards(later: dict, rank: int) -> None:
    """Upload this rank's files of the local dcp/ folder (DCP names them `__<rank>_<n>.distcp`; rank 0, the
    coordinator, also wrote `.metadata`) into later["to"]/dcp/ on storage, several at once, hashed on the way,
    and leave their sizes, hashes and upload seconds in later["digests"]/rank-<rank>.json for the state commit."""
    from grpo.record.io import put_files
    from grpo.record.storage import open_storage

    local = Path(later["dir"], STATE_DCP)
    mine = sorted(
        p for p in local.iterdir() if p.name.startswith(f"__{rank}_") or (rank == 0 and p.name == ".metadata")
    )
    fs = open_storage(later["storage_url"]).fs
    t0 = time.perf_counter()
    written = put_files(fs, [(str(p), f"{later['to']}/{STATE_DCP}/{p.name}") for p in mine])
    report = {"seconds": time.perf_counter() - t0, "files": {k: list(v) for k, v in written.items()}}
    Path(later["digests"], f"rank-{rank}.json").write_text(json.dumps(report))


def run_then_exit(main, *args) -> None:
    """Run a rank's `main(*args)`, then end the process without Python's finalization: a gloo thread still
    freeing its last collective's tensors needs the interpreter's lock, and one that asks for it while the
    interpreter shuts down calls std::terminate, so a rank whose work was done died of SIGABRT ('terminate
    called without an active exception'; 14 of 60 exits after a two-rank DCP save here). An exception
    propagates (traceback, exit code 1) as before. What the rank wrote is closed or synced by then (torch.save,
    DCP's fsync, write_text); its logs and streams are flushed here."""
    main(*args)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    run_then_exit(worker_main, sys.argv[1])
