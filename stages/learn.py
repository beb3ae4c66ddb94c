"""Stage 5: the GRPO update (grpo.learner) on an iteration's rollouts, writing the next policy checkpoint.

This stage joins the rollouts with their advantages into a `Batch` of whole groups, frees the GPU of the sampler
where they share it (vLLM sleeps, or closes: rollout.keep_engine; not where learn.device and rollout.device are
apart: grpo/devices.py), runs the update and commits policy/ (or adapter/), the metrics of every step and the old
(and reference) log-probs, so an audit can recompute every loss; the resume state (optimizer.pt, rng.pt,
master.safetensors for a narrower-than-float32 base) follows in a commit of its own, off the critical path
(grpo/record/resume.py). When the next iteration runs in the same process (flow `grpo` with `iterations` > 1) it
takes the model, optimizer and reference from memory (`WARM`) instead, with the same result. The KL reference is
the base model or, with learn.ref_update_every, an earlier iteration's committed snapshot (reference_source): a warm
learner loads it when it moves, a cold one reads the same files. With rollout.staleness S >= 1 the update still
starts from learn k - 1's policy (start_policy); the rollouts came from learn k - 1 - S's, which
learn.behavior_correction corrects for.

One process runs in-process; `learn.num_processes > 1` runs the same code under torchrun (gloo on CPU, NCCL on GPUs;
grpo/learner/launch.py), rank r taking every r-th group of each minibatch, on one machine or on learn.nodes machines
that meet through storage (grpo/learner/nodes.py; this stage is node 0).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from grpo import devices
from grpo.config import RunConfig
from grpo.learner import Batch, Learner, launch, nodes
from grpo.learner.rank import new_learner, train_and_save
from grpo.learner.warm import WARM
from grpo.record import resume as state
from grpo.record.checkpoint import (
    ADAPTER_PREFIX,
    CHECKPOINT_PREFIX,
    adapter_checkpoint,
    carry_checkpoint_files,
    keep_written,
    local_checkpoint,
    policy_folders,
    staging_folder,
    tokenizer_and_config,
    upload_folder,
)
from grpo.record.commit import StageWriter
from grpo.record.counts import is_local
from grpo.record.digests import sha256_local
from grpo.record.identity import config_hash, section, stage_identity
from grpo.record.lineage import check_chain, check_policy, committed_input, frozen_version, reference_policy
from grpo.record.storage import Committed, Storage
from grpo.sampling.engines import release_accelerator
from stages.common import StageError, load_run, measured, run_stage
from stages.learn_data import load_batch

log = logging.getLogger("grpo.stages")


def reference_source(storage: Storage, run_id: str, iteration: int, cfg: RunConfig) -> Committed:
    """The committed checkpoint the KL of `iteration` is measured against (grpo.record.lineage.reference_policy): with
    full fine-tuning and a warm start (sft), the SFT model before the first refresh; LoRA: the base, adapters off."""
    warm_start = cfg.sft is not None and cfg.learn.lora is None
    return reference_policy(storage, run_id, iteration, cfg.learn.ref_update_every, warm_start)


def learn_inputs(storage: Storage, cfg: RunConfig, run_id: str, iteration: int) -> dict[str, Committed]:
    """The stage's inputs (snapshot, reference, rollouts, advantages, the previous learn), checked current."""
    inputs = {
        "snapshot": committed_input(storage, run_id, iteration, "snapshot"),
        "reference": reference_source(storage, run_id, iteration, cfg),
        "rollouts": committed_input(storage, run_id, iteration, "rollouts"),
        "advantages": committed_input(storage, run_id, iteration, "advantages"),
    }
    if iteration > 0:
        inputs["previous"] = committed_input(storage, run_id, iteration - 1, "learn")
    if iteration > 0 and cfg.rollout.staleness and cfg.learn.lora is not None:  # start_policy: the base's weights
        inputs["base"] = committed_input(storage, run_id, None, "base")
    check_policy(run_id, iteration, "learn", frozen_version(storage, inputs["snapshot"]), cfg.rollout.staleness)
    check_chain(storage, run_id, iteration, "learn", inputs)
    return inputs


def stage_config(cfg: RunConfig) -> dict:
    """What the stage's identity covers: the seed and the learn section, less where its processes run
    (grpo.record.identity.LEARN_PLACEMENT: one node or several train the same update) and settings added later at
    their defaults."""
    return {"seed": cfg.seed, "learn": section(cfg, "learn")}


def read_batch(storage: Storage, cfg: RunConfig, inputs: dict[str, Committed]) -> Batch:
    pad_id = tokenizer_and_config(inputs["snapshot"])[1].pad_token_id or 0
    batch = load_batch(storage, inputs["rollouts"], inputs["advantages"], pad_id, cfg.rollout.group_size)
    if len(batch.response_ids) < cfg.learn.minibatch_size:
        raise StageError(
            f"learn: {len(batch.response_ids)} kept samples, fewer than learn.minibatch_size "
            f"({cfg.learn.minibatch_size}); lower it, turn off advantage.filter_zero_variance or "
            "raise rollout.max_sampling_rounds (dynamic sampling found fewer groups with signal)"
        )
    return batch


def checkpoint_folders(
    storage: Storage, cfg: RunConfig, inputs: dict[str, Committed], tmp: str, state: bool
) -> dict[str, str | None]:
    """The local folders a Learner is built from (new_learner's arguments); with `state`, the previous
    learn's optimizer state, rng and master weights in `tmp` (checked against their manifest, or replayed)."""
    state_dir = None
    if "previous" in inputs and state:
        state_dir = previous_state(storage, cfg, inputs["previous"], tmp)
    policy_dir, adapter_dir = start_policy(storage, inputs)  # LoRA: the adapters learn k - 1 left
    ref_dir = local_checkpoint(inputs["reference"])
    return {"policy_dir": policy_dir, "ref_dir": ref_dir, "state_dir": state_dir, "adapter_dir": adapter_dir}


def previous_state(storage: Storage, cfg: RunConfig, learned: Committed, tmp: str) -> str:
    """A local folder holding the resume state learn `learned` left: committed (grpo.record.resume), or, where its
    commit never came (a writer killed between the two commits, learn.state_every), replayed."""
    k, run_id = learned.manifest.iteration, learned.manifest.run_id
    return state.read(storage, run_id, learned, f"{tmp}/state-{k}") or replayed_state(storage, cfg, learned, tmp)


def replayed_state(storage: Storage, cfg: RunConfig, learned: Committed, tmp: str) -> str:
    """Learn `learned`'s state made again: its update run once more from its committed inputs and the state
    before it (itself replayed where missing), each file of the policy it writes checked against the committed
    one, and committed (grpo.record.resume); the local folder holding it."""
    k, run_id = learned.manifest.iteration, learned.manifest.run_id
    log.info("learn iteration %s: its resume state is not committed; replaying its update to make it", k)
    inputs = learn_inputs(storage, cfg, run_id, k)
    work = f"{tmp}/replay-{k}"
    os.makedirs(work)
    folders = checkpoint_folders(storage, cfg, inputs, work, state=True)
    out_dir, held = f"{work}/out", f"{work}/held"
    u = Update(cfg, run_id, k, read_batch(storage, cfg, inputs), folders, out_dir, held, work)
    LAUNCHERS[launcher(cfg, k, replay=True)](u)
    committed = {f.path: f.sha256 for f in learned.manifest.files}
    for f in sorted(p for p in Path(out_dir).rglob("*") if p.is_file() and p.suffix != ".parquet"):
        name = f.relative_to(out_dir).as_posix()
        if committed.get(name) != sha256_local(str(f)):
            raise StageError(
                f"learn iteration {k}: replaying its update to rebuild the resume state its commit lacks wrote "
                f"{name} unlike {learned.uri} (a learner that does not repeat itself here); rerun from there with "
                f"`grpo stage learn --run {run_id} --iteration {k} --force`"
            )
    state.commit_now(storage, stage_config(cfg), run_id, learned, held)
    return state.read(storage, run_id, learned, f"{tmp}/state-{k}")


def remake_state(storage: Storage, run_id: str, iteration: int, force: bool = False) -> Committed:
    """`grpo stage state`: learn `iteration`'s resume state, committed, or with `force` (a damaged one) replayed."""
    cfg, learned = load_run(storage, run_id), committed_input(storage, run_id, iteration, "learn")
    if force or state.committed_state(storage, run_id, learned) is None:
        with tempfile.TemporaryDirectory() as tmp:
            replayed_state(storage, cfg, learned, tmp)
    return state.committed_state(storage, run_id, learned)


@dataclass
class Update:
    """One learn's update as its launcher runs it: a learner built from `folders` (or `learner`, kept warm in this
    process) trains on `batch`, writing policy and tables into `out_dir` and the resume state into `held`."""

    cfg: RunConfig
    run_id: str
    iteration: int
    batch: Batch
    folders: dict
    out_dir: str
    held: str | None
    tmp: str
    learner: Learner | None = None  # in this process: the learner that trained (kept for the next iteration)
    writer: StageWriter | None = None  # learn.nodes > 1: the attempt the nodes meet in
    shards: state.Shards | None = None  # fsdp2 under torchrun: the state attempt its ranks write their shards into

    def args(self, **kw) -> dict:
        return launch.learner_args(self.cfg, self.run_id, self.iteration, self.batch, self.folders, self.out_dir,
                                   self.tmp, **kw)  # fmt: skip


def in_process(u: Update) -> dict:
    u.learner = u.learner or new_learner(u.cfg, u.iteration, **u.folders)
    u.learner.use_reference(u.folders["ref_dir"])  # a warm learner's may be another (ref_update_every)
    return train_and_save(u.learner, u.run_id, u.iteration, u.batch, u.out_dir, u.held)


def on_nodes(u: Update) -> dict:  # every node writes its shards of the state into the learn's attempt (nodes.lead)
    return nodes.lead(u.writer, u.args(), u.cfg.learn, u.run_id, u.iteration)


def under_torchrun(u: Update) -> dict:
    return launch.run_distributed(u.args(state_out=u.held), u.cfg.learn.num_processes)


def under_torchrun_with_shards(u: Update) -> dict:
    """Returns once the policy is written, the ranks going on with their shards into u.shards' attempt."""
    args = u.args(state_out=u.held)
    ranks = launch.Torchrun({**args, "shards": u.shards.target(), "ready": u.shards.ready}, u.cfg.learn.num_processes)
    u.shards.hand_in(ranks)
    ranks.until_ready()
    return ranks.summary()


LAUNCHERS = {"process": in_process, "nodes": on_nodes, "torchrun": under_torchrun, "shards": under_torchrun_with_shards}
"""How a learn's update runs, by `launcher`: in this process, on learn.nodes machines, under torchrun on this one,
or under torchrun with its fsdp2 shards written after the policy (grpo.record.resume.Shards)."""


def launcher(cfg: RunConfig, iteration: int, replay: bool = False) -> str:
    """The LAUNCHERS key of learn `iteration`; a replay (of a state its commit lacks) runs on this machine alone and
    writes its state whole."""
    if cfg.learn.nodes > 1 and not replay:
        return "nodes"
    if cfg.learn.num_processes == 1:
        return "process"
    return "shards" if state.shards_later(cfg, iteration) and not replay else "torchrun"


def start_policy(storage: Storage, inputs: dict[str, Committed]) -> tuple[str, str | None]:
    """(checkpoint folder, LoRA adapter folder or None) the update starts from: the policy learn k - 1 committed
    (what its warm learner holds), read from the snapshot where the snapshot froze it (rollout.staleness 0, and
    iteration 0: the base), else from that learn (a stale snapshot froze an older policy)."""
    snap, previous = inputs["snapshot"], inputs.get("previous")
    if previous is None or frozen_version(storage, snap) == previous.manifest.iteration:
        return local_checkpoint(snap), adapter_checkpoint(snap)
    return policy_folders(previous, inputs.get("base"))[1:]


@dataclass
class Left:
    """What a learn's body leaves to the stage once it has committed (or failed)."""

    learner: Learner | None = None  # the update ran in this process: kept warm for iteration k + 1
    held: str | None = None  # the resume state, committed apart after the policy (grpo.record.resume)
    made: str | None = None  # on object storage: the folder the policy was written to, kept in this machine's cache
    shards: state.Shards | None = None  # fsdp2 ranks writing their shards while the policy commits


@measured
def learn(storage: Storage, run_id: str, iteration: int, force: bool = False, node_rank: int = 0) -> Committed:
    """The stage; with learn.nodes > 1 this is node 0, and `node_rank` r >= 1 joins it as node r
    (grpo.learner.nodes)."""
    cfg = load_run(storage, run_id)
    if node_rank:
        return join_learn(storage, cfg, run_id, iteration, node_rank, force)
    inputs, how, config = learn_inputs(storage, cfg, run_id, iteration), launcher(cfg, iteration), stage_config(cfg)
    shared = not devices.apart(cfg)  # the learner runs on the sampler's device: they take turns on it
    left = Left()

    def body(writer: StageWriter) -> dict:
        state.settled()  # this process's commit of the state before: one at a time (a failed one: replayed)
        batch = read_batch(storage, cfg, inputs)
        if shared:  # the sampler sleeps (or closes) while the learner runs on its device
            release_accelerator(cfg.rollout.keep_engine)
        if "previous" in inputs and how == "process":  # the model and optimizer the previous iteration left in memory
            left.learner = WARM.take(WARM.key(cfg, inputs["previous"].uri))
        warm = left.learner is not None
        with tempfile.TemporaryDirectory() as tmp:
            folders = checkpoint_folders(storage, cfg, inputs, tmp, state=not warm)
            local = is_local(storage.fs)  # local storage: write into the attempt itself, no copy of the model
            left.made = None if local else staging_folder()
            out_dir = writer.attempt_dir if local else left.made
            # the resume state on the cache's disk, where grpo.record.resume keeps it (nodes: in the learn's attempt)
            left.held = staging_folder() if how != "nodes" else None
            left.shards = state.Shards(storage, config, run_id, iteration, left.held) if how == "shards" else None
            u = Update(
                cfg, run_id, iteration, batch, folders, out_dir, left.held, tmp, left.learner, writer, left.shards
            )
            summary = LAUNCHERS[how](u)
            left.learner = u.learner
            if cfg.learn.lora is None:
                carry_checkpoint_files(folders["policy_dir"], f"{out_dir}/policy")
            if not local:  # policy/ or adapter/, metrics, logprobs (and, several nodes, the state)
                upload_folder(writer, out_dir, prefix="")
        return {**summary, "warm_learner": warm}  # taken from memory, not built from the committed files

    try:  # this thread's CUDA device the learner's (a sampler may hold another in this process)
        with devices.current(devices.learner_device(cfg.learn) if how == "process" else None):
            out = run_stage(storage, run_id, iteration, "learn", config=config, inputs=inputs, body=body, force=force)
    except BaseException:
        if left.shards is not None:
            left.shards.close()
        for folder in filter(None, (left.held, left.made)):
            shutil.rmtree(folder, ignore_errors=True)
        raise
    if left.made is not None:  # the next learn and a sampler on this machine read the policy without a download
        prefix = ADAPTER_PREFIX if cfg.learn.lora else CHECKPOINT_PREFIX
        keep_written(out, f"{left.made}/{prefix.rstrip('/')}", prefix)
        shutil.rmtree(left.made, ignore_errors=True)
    if left.held is not None and state.due(cfg, iteration):  # the policy is committed: the state follows, meanwhile
        state.commit_later(storage, config, run_id, out, left.held, left.shards)
    elif left.held is not None:
        shutil.rmtree(left.held)
    if left.learner is not None:  # ran in this process and committed: keep it for iteration k + 1
        WARM.keep(WARM.key(cfg, out.uri), left.learner, offload=shared)
    return out


def join_learn(storage: Storage, cfg: RunConfig, run_id: str, iteration: int, node_rank: int, force: bool) -> Committed:
    """Node `node_rank` of the learn stage's nodes: the same inputs, read as node 0 reads them."""
    nodes.check_rank(cfg.learn, node_rank)
    deadline = time.monotonic() + cfg.learn.node_timeout_s
    while True:  # a node started before the iteration's earlier stages committed waits for them
        try:
            inputs = learn_inputs(storage, cfg, run_id, iteration)
            break
        except StageError as e:
            if not str(e).startswith("input missing") or time.monotonic() > deadline:
                raise
            time.sleep(nodes.POLL_S)

    def prepare(tmp: str, out_dir: str) -> dict:
        batch = read_batch(storage, cfg, inputs)
        release_accelerator(cfg.rollout.keep_engine)
        folders = checkpoint_folders(storage, cfg, inputs, tmp, state=True)
        return launch.learner_args(cfg, run_id, iteration, batch, folders, out_dir, tmp)

    refs = {k: v.ref() for k, v in inputs.items()}
    identity = stage_identity(run_id, iteration, "learn", config_hash(stage_config(cfg)), refs)
    return nodes.join(storage, run_id, iteration, node_rank, cfg.learn, identity, prepare, force)
