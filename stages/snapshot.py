"""Stage 1: freeze the policy that iteration k samples from.

Iteration 0 samples from the base model, iteration k from the learner output of
k - 1. Both are committed and immutable already, so the snapshot references
their files (name, size, sha256, URI) instead of copying weights.
"""

from __future__ import annotations

from grpo.checkpoint import CHECKPOINT_PREFIX
from grpo.storage import Committed, Storage
from schemas import FileEntry
from stages.common import check_chain, committed_input, load_run, run_stage


def policy_source(storage: Storage, run_id: str, iteration: int) -> Committed:
    """The committed stage whose checkpoint iteration `iteration` samples from."""
    if iteration == 0:
        return committed_input(storage, run_id, None, "base")
    return committed_input(storage, run_id, iteration - 1, "learn")


def snapshot(storage: Storage, run_id: str, iteration: int, force: bool = False) -> Committed:
    load_run(storage, run_id)  # fails early, naming run.json, if the run does not exist
    source = policy_source(storage, run_id, iteration)
    check_chain(storage, run_id, iteration, "snapshot", {"policy": source})

    def body(writer):
        n_bytes = 0
        for f in source.manifest.files:
            if f.path.startswith(CHECKPOINT_PREFIX):
                writer.reference(
                    f.path, FileEntry(f.path, f.size, f.sha256, uri=f.uri or storage.uri(source.path(f.path)))
                )
                n_bytes += f.size
        return {"source": source.uri, "bytes_referenced": n_bytes}

    return run_stage(
        storage, run_id, iteration, "snapshot", config={}, inputs={"policy": source}, body=body, force=force
    )
