"""Stage 1: freeze the policy that iteration k samples from.

Iteration k samples the learner output of k - 1 - S (rollout.staleness S, 0 by default: k - 1), the base model
(or the warm start, `grpo sft`, where the config sets sft) while that is negative (grpo.record.lineage.policy_version);
the manifest records which (`policy_version`), and lineage refuses a snapshot of any other. Both are committed and
immutable already, so the snapshot references their files (name, size, sha256, URI) instead of copying weights. A LoRA
learn commits only its adapters: the snapshot then references the base's policy/ and that learn's adapter/.
"""

from __future__ import annotations

from grpo.record.checkpoint import ADAPTER_PREFIX, CHECKPOINT_PREFIX, checkpoint_files
from grpo.record.lineage import (
    check_chain,
    check_policy,
    committed_input,
    first_policy,
    policy_version,
    version_of,
)
from grpo.record.storage import Committed, Storage
from schemas import FileEntry
from stages.common import load_run, measured, run_stage


def policy_source(storage: Storage, run_id: str, iteration: int, staleness: int, warm_start: bool = False) -> Committed:
    """The committed stage whose checkpoint (or adapters) iteration `iteration` samples from: learn k-1-S's, or
    before it the base, or with `warm_start` (the config's sft) the warm start's (stages/sft.py)."""
    version = policy_version(iteration, staleness)
    if version < 0:
        return first_policy(storage, run_id, warm_start)
    return committed_input(storage, run_id, version, "learn")


@measured
def snapshot(storage: Storage, run_id: str, iteration: int, force: bool = False) -> Committed:
    cfg = load_run(storage, run_id)  # fails early, naming run.json, if the run does not exist
    inputs = {"policy": policy_source(storage, run_id, iteration, cfg.rollout.staleness, cfg.sft is not None)}
    version = version_of(inputs["policy"])
    check_policy(run_id, iteration, "snapshot", version, cfg.rollout.staleness)
    sources = {CHECKPOINT_PREFIX: inputs["policy"]}
    if checkpoint_files(inputs["policy"], ADAPTER_PREFIX):  # LoRA: the base's weights, the learn's adapters
        inputs["base"] = committed_input(storage, run_id, None, "base")
        sources = {CHECKPOINT_PREFIX: inputs["base"], ADAPTER_PREFIX: inputs["policy"]}
    check_chain(storage, run_id, iteration, "snapshot", inputs)

    def body(writer):
        n_bytes = 0
        for prefix, source in sources.items():
            for f in source.manifest.files:
                if f.path.startswith(prefix):
                    writer.reference(
                        f.path, FileEntry(f.path, f.size, f.sha256, uri=f.uri or storage.uri(source.path(f.path)))
                    )
                    n_bytes += f.size
        return {"source": inputs["policy"].uri, "policy_version": version, "bytes_referenced": n_bytes}

    return run_stage(storage, run_id, iteration, "snapshot", config={}, inputs=inputs, body=body, force=force)
