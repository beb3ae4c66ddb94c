"""Stage 5: the GRPO update (grpo.learner) on an iteration's rollouts, writing the next policy checkpoint.

This stage joins the rollouts with their advantages into a `Batch` of whole groups, frees the
GPU of the sampler (vLLM sleeps, or closes: rollout.keep_engine), runs the update and commits
policy/, optimizer.pt, rng.pt (and master.safetensors for a narrower-than-float32 base), the
metrics of every step and the old (and reference) log-probs, so an audit can recompute every
loss. When the next iteration runs in the same process (flow `grpo` with `iterations` > 1) it
takes the model, optimizer and reference from memory (`WARM`) instead, with the same result. The KL
reference is the base model or, with learn.ref_update_every, an earlier iteration's committed snapshot
(reference_source): a warm learner loads it when it moves, a cold one reads the same files. With
rollout.staleness S >= 1 the update still starts from learn k - 1's policy (start_policy); the rollouts came
from learn k - 1 - S's, which learn.behavior_correction corrects for.

One process runs in-process; `learn.num_processes > 1` runs the same code under torchrun (gloo on
CPU, NCCL on GPUs; grpo/learner/launch.py), rank r taking every r-th group of each minibatch, on one machine
or on learn.nodes machines that meet through storage (grpo/learner/nodes.py; this stage is node 0).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np
import torch

from grpo.checkpoint import (
    adapter_checkpoint,
    carry_checkpoint_files,
    download_verified,
    local_checkpoint,
    policy_folders,
    tokenizer_and_config,
    upload_folder,
)
from grpo.config import RunConfig
from grpo.identity import config_hash, section, stage_identity
from grpo.layout import STATE_PREFIXES
from grpo.learner import Batch, Learner, launch, nodes
from grpo.learner.rank import new_learner, train_and_save
from grpo.lineage import check_chain, check_policy, committed_input, frozen_version, reference_iteration
from grpo.sampling.engines import release_accelerator
from grpo.storage import Committed, StageWriter, Storage, is_local
from schemas import read_parquet, table_file
from stages.common import StageError, load_run, measured, run_stage

KEYS = ["prompt_id", "sample_index"]


# ---------------------------------------------------------------- data


def _padded(column, rows: np.ndarray, fill, dtype, left: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """List column -> (len(rows), longest) array of the chosen rows, right- (or left-) padded, and lengths."""
    arr = column.combine_chunks()
    offsets = arr.offsets.to_numpy()
    values = arr.flatten().to_numpy(zero_copy_only=False)
    offsets = offsets - offsets[0]
    starts, lengths = offsets[rows], offsets[rows + 1] - offsets[rows]
    width = max(int(lengths.max(initial=0)), 1)
    pos = np.arange(width)
    keep = pos < lengths[:, None]  # (R, W): where a row's values go, right-padded
    out = np.full((len(rows), width), fill, dtype=dtype)
    out[keep] = values[(starts[:, None] + pos)[keep]]
    if left:  # roll each row right by its padding
        out = out[np.arange(len(rows))[:, None], (pos - (width - lengths[:, None])) % width]
    return out, lengths


def load_batch(storage: Storage, rollouts_in: Committed, adv_in: Committed, pad_id: int, group_size: int) -> Batch:
    """Join rollouts with advantages on (prompt_id, sample_index); keep the kept groups, whole."""
    ro = read_parquet(
        storage.fs,
        rollouts_in.read_path(table_file("rollouts")),
        "rollouts",
        columns=KEYS + ["prompt_ids", "response_ids", "sampler_logprobs"],
    )
    ad = read_parquet(
        storage.fs,
        adv_in.read_path(table_file("advantages")),
        "advantages",
        columns=KEYS + ["advantage", "reward", "kept"],
    )
    kept = ad.column("kept").to_numpy()
    ad_pid, ad_idx = (ad.column(c).to_numpy()[kept] for c in KEYS)
    ro_pid, ro_idx = (ro.column(c).to_numpy() for c in KEYS)
    width = int(max(ro_idx.max(initial=0), ad_idx.max(initial=0))) + 1
    ro_key, ad_key = ro_pid * width + ro_idx, ad_pid * width + ad_idx  # one int per (prompt_id, sample_index)
    if len(np.unique(ro_key)) != len(ro_key):
        raise StageError(f"{rollouts_in.uri}: a (prompt_id, sample_index) appears twice")
    if not np.isin(ad_key, ro_key).all():
        raise StageError(f"{adv_in.uri}: advantages name samples missing from the rollouts of {rollouts_in.uri}")
    order = np.argsort(ad_key)  # kept samples in (prompt_id, sample_index) order
    ad_key = ad_key[order]
    take = np.argsort(ro_key)[np.searchsorted(np.sort(ro_key), ad_key)]  # their rollout rows
    prompts, prompt_len = _padded(ro.column("prompt_ids"), take, pad_id, np.int64, left=True)
    pid = ro_pid[take]
    uniq, counts = np.unique(pid, return_counts=True)  # pid is sorted: a prompt's samples are contiguous
    wrong = uniq[counts != group_size]
    if not len(wrong):  # and they share one prompt
        same = (prompts.reshape(-1, group_size, prompts.shape[1]) == prompts[::group_size, None]).all((1, 2))
        wrong = uniq[~same]
    if len(wrong):
        raise StageError(
            f"{rollouts_in.uri}: prompt_id {wrong[0]} does not have rollout.group_size={group_size} "
            "kept samples of one prompt; the learner scores each prompt once for its whole group"
        )
    responses, lengths = _padded(ro.column("response_ids"), take, pad_id, np.int64)
    sampler, _ = _padded(ro.column("sampler_logprobs"), take, 0.0, np.float32)
    response_mask = np.arange(responses.shape[1]) < lengths[:, None]
    prompt_mask = np.arange(prompts.shape[1]) >= prompts.shape[1] - prompt_len[::group_size, None]
    adv, reward = (ad.column(c).to_numpy()[kept][order] for c in ("advantage", "reward"))
    return Batch(
        prompt_ids=torch.from_numpy(prompts[::group_size].copy()),
        prompt_mask=torch.from_numpy(prompt_mask).long(),
        response_ids=torch.from_numpy(responses),
        response_mask=torch.from_numpy(response_mask).float(),
        sampler_logprobs=torch.from_numpy(sampler),
        group_size=group_size,
        advantages=torch.from_numpy(adv).float(),
        rewards=torch.from_numpy(reward).float(),
        prompt_id=pid.tolist(),
        sample_index=ro_idx[take].tolist(),
    )


class WarmLearners:
    """At most one Learner kept after a committed `learn`, keyed by that commit's URI.

    The next iteration's learn takes it when its `previous` input is that commit, with the same
    learn config; anything else (a forced rerun, another run, a failed step that left the model
    half-updated) builds a fresh Learner from the committed files. The reference is not part of the
    key: a learner taken loads the iteration's reference when it holds another (Learner.use_reference;
    learn.ref_update_every moves it).
    On a GPU the kept learner waits in CPU memory, leaving the GPU to the sampler.
    Change the key only with tests test_warm_iterations_commit_what_cold_ones_do and
    test_optimizer_state_carries_to_next_iteration in view.
    """

    def __init__(self):
        self._key: tuple | None = None
        self._learner: Learner | None = None

    @staticmethod
    def key(cfg: RunConfig, learn_uri: str) -> tuple:
        return learn_uri, json.dumps(cfg.to_dict()["learn"], sort_keys=True)

    def keep(self, key: tuple, learner: Learner) -> None:
        learner.to("cpu")
        self._key, self._learner = key, learner

    def take(self, key: tuple) -> Learner | None:
        learner = self._learner if key == self._key else None
        self._key = self._learner = None  # taken or stale: either way not reusable again
        if learner is not None:
            learner.to(learner.acc.device)
        return learner


WARM = WarmLearners()


def is_state_file(path: str) -> bool:
    """Whether a learn attempt's file is resume state the next learn reads (not the policy or a table)."""
    return path.startswith(STATE_PREFIXES)


# ---------------------------------------------------------------- stage


def reference_source(storage: Storage, run_id: str, iteration: int, every: int | None) -> Committed:
    """The committed checkpoint the KL of `iteration` is measured against: the base model, or the snapshot of
    reference_iteration (the policy that iteration sampled from, as committed: a cold resume reads the same)."""
    at = reference_iteration(iteration, every)
    return (
        committed_input(storage, run_id, None, "base")
        if at is None
        else committed_input(storage, run_id, at, "snapshot")
    )


def learn_inputs(storage: Storage, cfg: RunConfig, run_id: str, iteration: int) -> dict[str, Committed]:
    """The stage's inputs (snapshot, reference, rollouts, advantages, the previous learn), checked current."""
    inputs = {
        "snapshot": committed_input(storage, run_id, iteration, "snapshot"),
        "reference": reference_source(storage, run_id, iteration, cfg.learn.ref_update_every),
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
    (grpo.identity.LEARN_PLACEMENT: one node or several train the same update) and settings added later at
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


def checkpoint_folders(storage: Storage, inputs: dict[str, Committed], tmp: str, state: bool) -> dict[str, str | None]:
    """The local folders a Learner is built from (new_learner's arguments); with `state`, the previous
    learn's optimizer state, rng and master weights downloaded into `tmp` (checked against its manifest)."""
    state_dir = None
    if "previous" in inputs and state:
        state_dir = f"{tmp}/state"
        os.makedirs(state_dir)
        names = [f.path for f in inputs["previous"].manifest.files if is_state_file(f.path)]
        download_verified(inputs["previous"], {name: f"{state_dir}/{name}" for name in names})
    policy_dir, adapter_dir = start_policy(storage, inputs)  # LoRA: the adapters learn k - 1 left
    ref_dir = local_checkpoint(inputs["reference"])
    return {"policy_dir": policy_dir, "ref_dir": ref_dir, "state_dir": state_dir, "adapter_dir": adapter_dir}


def start_policy(storage: Storage, inputs: dict[str, Committed]) -> tuple[str, str | None]:
    """(checkpoint folder, LoRA adapter folder or None) the update starts from: the policy learn k - 1 committed
    (what its warm learner holds), read from the snapshot where the snapshot froze it (rollout.staleness 0, and
    iteration 0: the base), else from that learn (a stale snapshot froze an older policy)."""
    snap, previous = inputs["snapshot"], inputs.get("previous")
    if previous is None or frozen_version(storage, snap) == previous.manifest.iteration:
        return local_checkpoint(snap), adapter_checkpoint(snap)
    return policy_folders(previous, inputs.get("base"))[1:]


@measured
def learn(storage: Storage, run_id: str, iteration: int, force: bool = False, node_rank: int = 0) -> Committed:
    """The stage; with learn.nodes > 1 this is node 0, and `node_rank` r >= 1 joins it as node r
    (grpo.learner.nodes)."""
    cfg = load_run(storage, run_id)
    if node_rank:
        return join_learn(storage, cfg, run_id, iteration, node_rank, force)
    inputs = learn_inputs(storage, cfg, run_id, iteration)
    in_process = cfg.learn.num_processes == 1
    learner: Learner | None = None

    def body(writer: StageWriter) -> dict:
        nonlocal learner
        batch = read_batch(storage, cfg, inputs)
        release_accelerator(cfg.rollout.keep_engine)  # the sampler sleeps (or closes) while the learner runs
        if "previous" in inputs and in_process:  # the model and optimizer the previous iteration left in memory
            learner = WARM.take(WARM.key(cfg, inputs["previous"].uri))
        warm = learner is not None
        with tempfile.TemporaryDirectory() as tmp:
            folders = checkpoint_folders(storage, inputs, tmp, state=not warm)
            local = is_local(storage.fs)  # local storage: write into the attempt itself, no copy of the model
            out_dir = writer.attempt_dir if local else f"{tmp}/out"
            os.makedirs(out_dir, exist_ok=True)
            if in_process:
                learner = learner or new_learner(cfg, iteration, **folders)
                learner.use_reference(folders["ref_dir"])  # a warm learner's may be another (ref_update_every)
                summary = train_and_save(learner, run_id, iteration, batch, out_dir)
            else:
                args = launch.learner_args(cfg, run_id, iteration, batch, folders, out_dir, tmp)
                lc = cfg.learn
                summary = (
                    nodes.lead(writer, args, lc, run_id, iteration)
                    if lc.nodes > 1
                    else launch.run_distributed(args, lc.num_processes)
                )
            if cfg.learn.lora is None:
                carry_checkpoint_files(folders["policy_dir"], f"{out_dir}/policy")
            if not local:  # policy/ or adapter/, optimizer.pt or dcp/, rng.pt, (master,) metrics, logprobs
                upload_folder(writer, out_dir, prefix="")
        return {**summary, "warm_learner": warm}  # taken from memory, not built from the committed files

    config = stage_config(cfg)
    out = run_stage(storage, run_id, iteration, "learn", config=config, inputs=inputs, body=body, force=force)
    if learner is not None:  # ran in this process and committed: keep it for iteration k + 1
        WARM.keep(WARM.key(cfg, out.uri), learner)
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
        folders = checkpoint_folders(storage, inputs, tmp, state=True)
        return launch.learner_args(cfg, run_id, iteration, batch, folders, out_dir, tmp)

    refs = {k: v.ref() for k, v in inputs.items()}
    identity = stage_identity(run_id, iteration, "learn", config_hash(stage_config(cfg)), refs)
    return nodes.join(storage, run_id, iteration, node_rank, cfg.learn, identity, prepare, force)
