"""Stage 5: the GRPO update with Accelerate, writing the next policy checkpoint.

Before any update the snapshot policy scores the rollouts under no_grad (old
log-probs) and, when learn.kl_coef > 0, so does the frozen base model (reference
log-probs); both are stored so an audit can recompute every loss. Then `epochs`
passes over minibatches of whole groups in shuffled order (each prompt's tokens go
through the model once for its G responses: `SharedPromptLM`), gradient
accumulation over microbatches, loss = clipped policy
gradient + kl_coef * KL (grpo.core.grpo_microbatch_step), grad-norm clipping,
AdamW (lr optionally decayed over the run's steps). Optimizer and RNG state are
saved and picked up by the next iteration; when that iteration runs in the same
process (flow `grpo` with `iterations` > 1) it takes the model, optimizer and
reference from memory instead (`WARM`), with the same result.

One process runs in-process; `learn.num_processes > 1` runs the same code under
torchrun (gloo on CPU), rank r taking every r-th group of each minibatch; DDP's
gradient average then equals the one-process gradient for the per-sequence
aggregation modes.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import torch

from grpo import core
from grpo.checkpoint import WEIGHT_SUFFIXES, local_checkpoint, tokenizer_and_config, upload_folder
from grpo.config import LearnConfig, RunConfig
from grpo.storage import Committed, Storage, StageWriter, is_local
from schemas import read_parquet, write_parquet
from schemas.tables import FLOAT_LISTS
from stages.common import StageError, check_chain, committed_input, load_run, log, run_stage
from stages.rollouts import iteration_seed

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


def load_batch(storage: Storage, rollouts_in: Committed, adv_in: Committed, pad_id: int, group_size: int) -> dict:
    """Join rollouts with advantages on (prompt_id, sample_index); keep the kept groups, whole.

    Group g (one prompt, `group_size` samples) holds samples g*G .. g*G+G-1. Returns
    prompt_ids and prompt_mask (P, Lp), one left-padded row per group; response_ids and
    response_mask (N, T) right-padded, N = P * G; sampler_logprobs (N, T); advantages and
    rewards (N,); the keys prompt_id and sample_index (N lists); group_size.
    """
    ro = read_parquet(storage.fs, rollouts_in.path("rollouts.parquet"), "rollouts",
                      columns=KEYS + ["prompt_ids", "response_ids", "sampler_logprobs"])
    ad = read_parquet(storage.fs, adv_in.path("advantages.parquet"), "advantages",
                      columns=KEYS + ["advantage", "reward", "kept"])
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
        raise StageError(f"{rollouts_in.uri}: prompt_id {wrong[0]} does not have rollout.group_size={group_size} "
                         "kept samples of one prompt; the learner scores each prompt once for its whole group")
    responses, lengths = _padded(ro.column("response_ids"), take, pad_id, np.int64)
    sampler, _ = _padded(ro.column("sampler_logprobs"), take, 0.0, np.float32)
    response_mask = np.arange(responses.shape[1]) < lengths[:, None]
    prompt_mask = np.arange(prompts.shape[1]) >= prompts.shape[1] - prompt_len[::group_size, None]
    adv, reward = (ad.column(c).to_numpy()[kept][order] for c in ("advantage", "reward"))
    return {"prompt_ids": torch.from_numpy(prompts[::group_size].copy()),
            "prompt_mask": torch.from_numpy(prompt_mask).long(),
            "response_ids": torch.from_numpy(responses), "response_mask": torch.from_numpy(response_mask).float(),
            "sampler_logprobs": torch.from_numpy(sampler), "group_size": group_size,
            "advantages": torch.from_numpy(adv).float(), "rewards": torch.from_numpy(reward).float(),
            "prompt_id": pid.tolist(), "sample_index": ro_idx[take].tolist()}


class SharedPromptLM(torch.nn.Module):
    """A causal LM scoring the G responses of each prompt with the prompt computed once.

    The prompt's keys and values are computed once per group and shared by its G responses
    (gradients from every response flow back into them), instead of G forwards over the same
    prompt tokens; the logits equal those of a forward over each full sequence. One module, so
    DDP sees a single forward per backward.
    """

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, prompt_ids, prompt_mask, response_ids, response_mask):
        """prompt_ids, prompt_mask (P, Lp) left-padded; response_ids, response_mask (P*G, T)
        right-padded -> logits (P*G, T, V), logits[:, t] predicting response_ids[:, t]."""
        g = response_ids.shape[0] // prompt_ids.shape[0]
        out = self.lm(input_ids=prompt_ids, attention_mask=prompt_mask,
                      position_ids=(prompt_mask.cumsum(1) - 1).clamp_min(0), use_cache=True)
        cache = out.past_key_values
        cache.batch_repeat_interleave(g)  # (P, ...) -> (P*G, ...), differentiable
        first = out.logits[:, -1:].repeat_interleave(g, 0)  # (P*G, 1, V): predicts response token 0
        start = prompt_mask.sum(1).repeat_interleave(g)[:, None]  # (P*G, 1)
        mask = torch.cat([prompt_mask.repeat_interleave(g, 0), response_mask.long()], 1)
        out = self.lm(input_ids=response_ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                      position_ids=start + torch.arange(response_ids.shape[1]))
        return torch.cat([first, out.logits[:, :-1]], 1)


def group_rows(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """Sample rows of `groups`: (P,) -> (P * group_size,), group by group."""
    return (groups[:, None] * group_size + torch.arange(group_size)).reshape(-1)


def forward_logprobs(model, batch: dict, groups: torch.Tensor, with_entropy: bool = False):
    """Per-token log-probs of the responses of `groups` under `model` (a SharedPromptLM).

    groups (P,) -> (P*G, T), rows in group_rows order."""
    rows = group_rows(groups, batch["group_size"])
    labels = batch["response_ids"][rows]
    logits = model(batch["prompt_ids"][groups], batch["prompt_mask"][groups], labels,
                   batch["response_mask"][rows])  # (P*G, T, V)
    logp = core.token_logprobs(logits, labels)
    return (logp, core.token_entropy(logits)) if with_entropy else logp


@torch.no_grad()
def score(model, batch: dict, chunk_groups: int, groups: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probs (N, T) of every response (of `groups`, default all) under `model`, `chunk_groups`
    groups a forward."""
    model.eval()
    groups = torch.arange(len(batch["prompt_ids"])) if groups is None else groups
    return torch.cat([forward_logprobs(model, batch, c) for c in groups.split(chunk_groups)])


# ---------------------------------------------------------------- training

def minibatch_step(model, batch: dict, groups: torch.Tensor, lcfg: LearnConfig, accum: int,
                   max_tokens: int) -> dict[str, float]:
    """Forward/backward over this rank's `groups` in microbatches. Returns summed metrics."""
    totals: dict[str, float] = {}
    g = batch["group_size"]
    for mb_groups in groups.split(max(1, lcfg.microbatch_size // g)):
        mb = group_rows(mb_groups, g)
        mask = batch["response_mask"][mb]
        logp, entropy = forward_logprobs(model, batch, mb_groups, with_entropy=True)
        ref = batch["ref_logprobs"]
        loss, metrics = core.grpo_microbatch_step(
            logp, mask, gradient_accumulation_steps=accum, loss_type=lcfg.loss_type, agg_mode=lcfg.agg_mode,
            raw_rewards=batch["rewards"][mb, None], advantages=batch["advantages"][mb, None],
            old_logprobs=batch["old_logprobs"][mb], ref_logprobs=None if ref is None else ref[mb],
            kl_coef=lcfg.kl_coef, kl_estimator=lcfg.kl_estimator, clip_eps=lcfg.clip_eps,
            clip_eps_high=lcfg.clip_eps_high, max_tokens=max_tokens, sampler_logprobs=batch["sampler_logprobs"][mb],
            importance_correction=lcfg.importance_correction, tis_cap=lcfg.tis_cap)
        metrics["loss/total"] = loss.detach() * accum
        metrics["actor/entropy"] = core.masked_mean(entropy.detach(), mask)
        for k, v in metrics.items():  # extremes over microbatches, means of the rest
            reduce = max if k.endswith("_max") else min if k.endswith("_min") else None
            totals[k] = reduce(totals.get(k, float(v)), float(v)) if reduce else totals.get(k, 0.0) + float(v) / accum
    return totals


def optimizer_steps(opt) -> int:
    """Optimizer steps taken over the whole run: AdamW's own count, carried in optimizer.pt."""
    steps = [int(s["step"]) for s in opt.state.values() if "step" in s]
    return max(steps, default=0)


def logprob_columns(run_id: str, iteration: int, batch: dict) -> dict:
    """The logprobs table's columns: each sample's old (and reference) log-probs, cut to its response."""
    mask = batch["response_mask"].bool()  # (N, T), each row a prefix
    n = len(mask)
    offsets = pa.array(np.concatenate([[0], mask.sum(1).cumsum(0).numpy()]), pa.int32())

    def per_sample(x):  # (N, T) -> N lists of response length; nulls when not computed
        return pa.nulls(n, FLOAT_LISTS) if x is None else pa.ListArray.from_arrays(offsets, x[mask].numpy())
    return {"run_id": [run_id] * n, "iteration": [iteration] * n, "prompt_id": batch["prompt_id"],
            "sample_index": batch["sample_index"], "old_logprobs": per_sample(batch["old_logprobs"]),
            "ref_logprobs": per_sample(batch["ref_logprobs"])}


def _metric_row(run_id, iteration, step, epoch, m, grad_norm, lr, n_tokens, gap) -> dict:
    return {"run_id": run_id, "iteration": iteration, "step": step, "epoch": epoch,
            "loss": m["loss/total"], "pg_loss": m.get("loss/pg", 0.0), "kl": m.get("loss/kl"),  # None: no reference
            "clip_frac": m.get("actor/clip_frac", 0.0), "entropy": m["actor/entropy"], "grad_norm": grad_norm,
            "ratio_mean": m.get("actor/ratio_mean", 1.0), "ratio_min": m.get("actor/ratio_min", 1.0),
            "ratio_max": m.get("actor/ratio_max", 1.0), "logprob_gap": gap, "lr": lr, "n_tokens": n_tokens}


def _epoch_means(rows: list[dict]) -> str:
    """'loss -0.01 kl 0.002 clip_frac 0.12 ...': means over an epoch's metric rows (kl only if measured)."""
    keys = ["loss", "kl", "clip_frac", "entropy", "grad_norm"]
    means = {k: sum(r[k] for r in rows) / len(rows) for k in keys if rows and rows[0][k] is not None}
    return " ".join(f"{k} {v:.4g}" for k, v in means.items())


class Learner:
    """The policy being trained, its AdamW state, the shuffling RNG and the frozen reference
    (loaded only when learn.kl_coef > 0: nothing else reads it).

    Built from checkpoint folders (and the previous iteration's optimizer.pt and rng.pt); a warm
    run keeps it in memory for the next iteration instead (`WARM`), which then trains exactly as
    one built from the committed files would.
    """

    def __init__(self, cfg: RunConfig, iteration: int, policy_dir: str, ref_dir: str, state_dir: str | None):
        from accelerate import Accelerator
        from transformers import AutoModelForCausalLM
        self.cfg = cfg
        self.acc = Accelerator(cpu=not torch.cuda.is_available())
        lcfg = cfg.learn
        model = SharedPromptLM(AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32))
        self.ref = None
        if lcfg.kl_coef > 0:
            self.ref = SharedPromptLM(AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)).eval()
        # fused: one kernel for all parameters (4x faster steps on CPU for small models)
        opt = torch.optim.AdamW(model.parameters(), lr=lcfg.lr, betas=lcfg.betas, weight_decay=lcfg.weight_decay,
                                fused=True)
        self.shuffle = torch.Generator().manual_seed(iteration_seed(cfg.seed, iteration, salt=4))
        if state_dir:  # continue exactly where the previous iteration ended
            opt.load_state_dict(torch.load(f"{state_dir}/optimizer.pt", weights_only=True))
            self.shuffle.set_state(torch.load(f"{state_dir}/rng.pt", weights_only=True)["shuffle"])
        self.model, self.opt = self.acc.prepare(model, opt)


class WarmLearners:
    """At most one Learner kept after a committed `learn`, keyed by that commit's URI.

    The next iteration's learn takes it when its `previous` input is that commit, with the same
    reference model and learn config; anything else (a forced rerun, another run, a failed
    step that left the model half-updated) builds a fresh Learner from the committed files.
    """

    def __init__(self):
        self._key: tuple | None = None
        self._learner: Learner | None = None

    @staticmethod
    def key(cfg: RunConfig, learn_uri: str, reference_uri: str) -> tuple:
        return learn_uri, reference_uri, json.dumps(cfg.to_dict()["learn"], sort_keys=True)

    def keep(self, key: tuple, learner: Learner) -> None:
        self._key, self._learner = key, learner

    def take(self, key: tuple) -> Learner | None:
        learner = self._learner if key == self._key else None
        self._key = self._learner = None  # taken or stale: either way not reusable again
        return learner


WARM = WarmLearners()


def train(learner: Learner, run_id: str, iteration: int, batch: dict, out_dir: str) -> dict:
    """Run the update and write policy/, optimizer.pt, rng.pt, metrics and log-probs rows into out_dir.

    Every process runs this; only the main process writes. Returns the summary.
    """
    cfg, lcfg, acc, model, opt = learner.cfg, learner.cfg.learn, learner.acc, learner.model, learner.opt
    torch.manual_seed(iteration_seed(cfg.seed, iteration, salt=3))
    g = batch["group_size"]
    t0 = time.perf_counter()
    batch["old_logprobs"] = score(acc.unwrap_model(model), batch, max(1, lcfg.microbatch_size // g))
    batch["ref_logprobs"] = None if learner.ref is None else score(learner.ref, batch, max(1, lcfg.microbatch_size // g))
    score_s, update_s = time.perf_counter() - t0, 0.0
    mask = batch["response_mask"]
    gap = float(core.masked_mean((batch["sampler_logprobs"] - batch["old_logprobs"]).abs(), mask))
    if lcfg.max_logprob_gap is not None and gap > lcfg.max_logprob_gap:
        raise StageError(f"learn iteration {iteration}: the sampler's log-probs differ from the snapshot's by "
                         f"{gap:.4g} a token on average (> learn.max_logprob_gap={lcfg.max_logprob_gap}): the sampler "
                         "may have served other weights; nothing committed. Rerun rollouts (--force)")
    shuffle = learner.shuffle
    model.train()

    # whole groups are shuffled and split: a minibatch is minibatch_size / G prompts with all their samples
    n, n_groups, world, rank = len(batch["response_ids"]), len(batch["prompt_ids"]), acc.num_processes, acc.process_index
    per_step = lcfg.minibatch_size // g
    accum = max(1, lcfg.minibatch_size // world // lcfg.microbatch_size)
    max_tokens = cfg.rollout.max_tokens  # Dr.GRPO's constant divisor: the response budget
    rows, step = [], 0
    for epoch in range(lcfg.epochs):
        order = torch.randperm(n_groups, generator=shuffle)
        for start in range(0, n_groups - per_step + 1, per_step):
            groups = order[start:start + per_step]
            t0 = time.perf_counter()
            m = minibatch_step(model, batch, groups[rank::world], lcfg, accum, max_tokens)
            m = {k: float(v) for k, v in zip(m, acc.reduce(torch.tensor(list(m.values())), "mean"))}
            if not all(math.isfinite(v) for v in m.values()):
                raise StageError(f"learn iteration {iteration} step {step}: non-finite loss {m}; nothing committed")
            grad_norm = float(acc.clip_grad_norm_(model.parameters(), lcfg.max_grad_norm))
            if not math.isfinite(grad_norm):
                raise StageError(f"learn iteration {iteration} step {step}: non-finite grad norm; nothing committed")
            lr = core.linear_decay_lr(lcfg.lr, optimizer_steps(opt), lcfg.lr_decay_steps)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            opt.zero_grad(set_to_none=True)
            update_s += time.perf_counter() - t0
            n_tok = int(mask[group_rows(groups, g)].sum())
            rows.append(_metric_row(run_id, iteration, step, epoch, m, grad_norm, lr, n_tok, gap))
            step += 1
        if acc.is_main_process:  # one line an epoch; every step's metrics go to metrics.parquet
            epoch_rows = [r for r in rows if r["epoch"] == epoch]
            log.info("learn iteration %d: epoch %d/%d, %d steps, %s", iteration, epoch + 1, lcfg.epochs,
                     len(epoch_rows), _epoch_means(epoch_rows))

    bad = [name for name, p in acc.unwrap_model(model).named_parameters() if not bool(torch.isfinite(p).all())]
    if not bad:  # finite weights can still be huge (a huge lr): the first group's log-probs must be finite too
        probe = score(acc.unwrap_model(model), batch, 1, groups=torch.arange(1))
        bad = [] if bool(torch.isfinite(probe[batch["response_mask"][:probe.shape[0]].bool()]).all()) else \
            ["log-probs of the new weights"]
    if bad:  # never commit weights the sampler cannot sample from
        raise StageError(f"learn iteration {iteration}: non-finite weights after {step} steps ({', '.join(bad[:3])}); "
                         f"nothing committed; lower learn.lr (now {lcfg.lr})")
    if acc.is_main_process:
        out = Path(out_dir)
        acc.unwrap_model(model).lm.save_pretrained(out / "policy", safe_serialization=True)
        torch.save(opt.state_dict(), out / "optimizer.pt")
        torch.save({"shuffle": shuffle.get_state(), "torch": torch.get_rng_state()}, out / "rng.pt")
        disk = fsspec.filesystem("file")  # out_dir is a local folder whatever the storage
        write_parquet(disk, str(out / "metrics.parquet"), "learn_metrics", rows)
        write_parquet(disk, str(out / "logprobs.parquet"), "logprobs", logprob_columns(run_id, iteration, batch))
    acc.wait_for_everyone()
    last = rows[-1] if rows else {}
    return {"steps": step, "samples": n, "loss": last.get("loss"), "kl": last.get("kl"),
            "clip_frac": last.get("clip_frac"), "grad_norm": last.get("grad_norm"), "logprob_gap": gap,
            "world_size": world, "score_s": score_s, "update_s": update_s,
            "tokens": sum(r["n_tokens"] for r in rows)}


# ---------------------------------------------------------------- stage

def carry_checkpoint_files(policy_dir: str, out_dir: str) -> list[str]:
    """Copy what save_pretrained does not write (tokenizer files, chat_template.jinja, special tokens,
    a hub model's extras) from the snapshot into the new checkpoint: every later stage and the user
    load the trained policy exactly like the base. Weights are never carried: the new ones are."""
    written = {f.name for f in Path(out_dir).iterdir()}
    carried = []
    for f in sorted(Path(policy_dir).iterdir()):
        if f.is_file() and f.name not in written and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copyfile(f, f"{out_dir}/{f.name}")
            carried.append(f.name)
    return carried


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_distributed(args: dict, nproc: int) -> dict:
    """Run `train` under torchrun; forward its output lines to the log; return rank 0's summary."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(args, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", "-m", "stages.learn", f.name]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    tail = []
    for line in proc.stdout:
        log.info("learn[torchrun] %s", line.rstrip())
        tail = (tail + [line])[-20:]
    if proc.wait() != 0:
        raise StageError(f"learn under torchrun exited with {proc.returncode}:\n{''.join(tail)}")
    return json.loads(Path(args["summary"]).read_text())


def _worker_main(args_path: str) -> None:
    args = json.loads(Path(args_path).read_text())
    from grpo.config import load_config
    cfg = load_config(args["config"])
    batch = torch.load(args["batch"], weights_only=False)
    learner = Learner(cfg, args["iteration"], args["policy_dir"], args["ref_dir"], args["state_dir"])
    summary = train(learner, args["run_id"], args["iteration"], batch, args["out_dir"])
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args["summary"]).write_text(json.dumps(summary))


def learn(storage: Storage, run_id: str, iteration: int, force: bool = False) -> Committed:
    cfg = load_run(storage, run_id)
    inputs = {"snapshot": committed_input(storage, run_id, iteration, "snapshot"),
              "reference": committed_input(storage, run_id, None, "base"),
              "rollouts": committed_input(storage, run_id, iteration, "rollouts"),
              "advantages": committed_input(storage, run_id, iteration, "advantages")}
    if iteration > 0:
        inputs["previous"] = committed_input(storage, run_id, iteration - 1, "learn")
    check_chain(storage, run_id, iteration, "learn", inputs)
    in_process = cfg.learn.num_processes == 1
    learner: Learner | None = None

    def body(writer: StageWriter) -> dict:
        nonlocal learner
        policy_dir = local_checkpoint(inputs["snapshot"])
        pad_id = tokenizer_and_config(inputs["snapshot"])[1].pad_token_id or 0
        batch = load_batch(storage, inputs["rollouts"], inputs["advantages"], pad_id, cfg.rollout.group_size)
        if len(batch["response_ids"]) < cfg.learn.minibatch_size:
            raise StageError(f"learn: {len(batch['response_ids'])} kept samples, fewer than learn.minibatch_size "
                             f"({cfg.learn.minibatch_size}); lower it or turn off advantage.filter_zero_variance")
        if "previous" in inputs and in_process:  # the model and optimizer the previous iteration left in memory
            learner = WARM.take(WARM.key(cfg, inputs["previous"].uri, inputs["reference"].uri))
        with tempfile.TemporaryDirectory() as tmp:
            state_dir = None
            if "previous" in inputs and learner is None:
                state_dir = f"{tmp}/state"
                os.makedirs(state_dir)
                for name in ("optimizer.pt", "rng.pt"):
                    storage.fs.get_file(inputs["previous"].path(name), f"{state_dir}/{name}")
            local = is_local(storage.fs)  # local storage: write into the attempt itself, no copy of the model
            out_dir = writer.attempt_dir if local else f"{tmp}/out"
            os.makedirs(out_dir, exist_ok=True)
            ref_dir = local_checkpoint(inputs["reference"])
            if in_process:
                learner = learner or Learner(cfg, iteration, policy_dir, ref_dir, state_dir)
                summary = train(learner, run_id, iteration, batch, out_dir)
            else:
                torch.save(batch, f"{tmp}/batch.pt")
                summary = _run_distributed({"config": cfg.to_dict(), "run_id": run_id, "iteration": iteration,
                                            "batch": f"{tmp}/batch.pt", "policy_dir": policy_dir,
                                            "ref_dir": ref_dir, "state_dir": state_dir, "out_dir": out_dir,
                                            "summary": f"{tmp}/summary.json"},
                                           cfg.learn.num_processes)
            carry_checkpoint_files(policy_dir, f"{out_dir}/policy")
            if not local:
                upload_folder(writer, out_dir, prefix="")  # policy/, optimizer.pt, rng.pt, metrics and logprobs
        return summary

    config = {"seed": cfg.seed, "learn": cfg.to_dict()["learn"]}
    out = run_stage(storage, run_id, iteration, "learn", config=config, inputs=inputs, body=body, force=force)
    if learner is not None:  # ran in this process and committed: keep it for iteration k + 1
        WARM.keep(WARM.key(cfg, out.uri, inputs["reference"].uri), learner)
    return out


if __name__ == "__main__":
    _worker_main(sys.argv[1])
