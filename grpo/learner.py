"""The learner: the policy model, the GRPO update loop and its state; no storage.

`train` takes one iteration's `Batch` (the kept samples, grouped by prompt) and a `Learner`
(policy, AdamW, shuffling RNG, frozen reference), and runs the update:
1. the snapshot policy scores the rollouts under no_grad (old log-probs) and, when kl_coef > 0,
   so does the reference (both returned, so an audit can recompute every loss);
2. `epochs` passes over minibatches of whole groups in shuffled order, gradient accumulation
   over microbatches, loss = clipped policy gradient + kl_coef * KL (grpo.core), grad-norm
   clipping, AdamW with lr optionally decayed over the run's steps.
Rank r of a multi-process run (torchrun) takes every r-th group of each minibatch; DDP's
gradient average then equals the one-process gradient for the per-sequence aggregation modes.

Precision and memory, as on a GPU: the weights and AdamW state stay float32 (master weights);
learn.mixed_precision=bf16 runs the forwards under bf16 autocast (backward follows; the default `auto` does
where the device computes bf16 natively, autocast_precision); checkpoints are
written in the base model's dtype, with the float32 master weights beside them when that dtype
is narrower, so the next iteration resumes exactly. Log-probs never materialize float32
(B, T, V) logits (grpo.core.chunked_token_logprobs); learn.gradient_checkpointing recomputes
the transformer blocks' activations in backward. Every tensor lives on the accelerator's device.

stages/learn.py joins the data, hands a warm Learner from one iteration to the next, launches
torchrun and commits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from grpo import core, sharding
from grpo.checkpoint import checkpoint_dtype
from grpo.config import LearnConfig, RunConfig
from grpo.errors import StageError
from grpo.progress import progress

log = logging.getLogger("grpo.learner")
MASTER_WEIGHTS = "master.safetensors"  # float32 weights, written when the checkpoint's dtype is narrower
ADAPTER_DIR = "adapter"  # a LoRA learn's policy: peft's adapter files (the base is the run's base model)
STATE_DCP = "dcp"  # learn.sharding=fsdp2: every process's shards of the weights and AdamW state


class LearnError(StageError):
    """The update cannot be committed: non-finite loss, gradients or weights, or a sampler gap."""


@dataclass(frozen=True)
class Batch:
    """One iteration's kept samples, whole groups in (prompt_id, sample_index) order.

    Group g (one prompt, G = group_size samples) holds samples g*G .. g*G+G-1; P groups, N = P*G.
    """

    prompt_ids: Tensor  # (P, Lp) long, left-padded: one row per group
    prompt_mask: Tensor  # (P, Lp) long
    response_ids: Tensor  # (N, T) long, right-padded
    response_mask: Tensor  # (N, T) float, each row a prefix of ones
    sampler_logprobs: Tensor  # (N, T) the sampler's log-prob of each sampled token
    advantages: Tensor  # (N,)
    rewards: Tensor  # (N,)
    group_size: int
    prompt_id: list[int]  # (N,) the keys of each sample, for the log-probs table
    sample_index: list[int]

    def to(self, device) -> Batch:
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if torch.is_tensor(getattr(self, f.name))
            },
        )

    def rows(self, groups: Tensor) -> Tensor:
        """Sample rows of `groups`: (P',) -> (P' * G,), group by group."""
        g = self.group_size
        return (groups[:, None] * g + torch.arange(g, device=groups.device)).reshape(-1)


class PolicyLM(torch.nn.Module):
    """A causal LM giving the per-token log-probs (and entropy) of each group's G responses.

    Shared prompt (the default): the prompt's keys and values are computed once per group and
    shared by its G responses (gradients from every response flow back into them), instead of
    G forwards over the same prompt tokens. With gradient checkpointing the training forward
    goes over each full sequence instead (checkpointing keeps no KV cache to share); scoring
    under no_grad still shares the prompt. Both give the same log-probs and gradients. One
    module, so DDP sees a single forward per backward.
    """

    def __init__(
        self, lm, logprob_chunk: int = 4096, full_sequences_in_training: bool = False, padding_free: bool = False
    ):
        super().__init__()
        self.lm, self.logprob_chunk, self.full_sequences_in_training = lm, logprob_chunk, full_sequences_in_training
        self.padding_free = padding_free

    @property
    def causal(self):
        """The transformers causal LM (inside a peft wrapper, its adapters injected in place)."""
        return self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm

    def adapter_disabled(self):
        """Context: the base model alone (LoRA's frozen reference); a no-op context without adapters."""
        return self.lm.disable_adapter() if hasattr(self.lm, "disable_adapter") else contextlib.nullcontext()

    def forward(self, prompt_ids, prompt_mask, response_ids, response_mask, with_entropy: bool = False):
        """prompt_ids, prompt_mask (P, Lp) left-padded; response_ids, response_mask (P*G, T)
        right-padded -> log-probs (P*G, T) of response_ids and their entropy (or None)."""
        full = self.full_sequences_in_training and self.training and torch.is_grad_enabled()
        if not full and (packing := self._packing(prompt_ids, response_mask)) is not None:
            return self._packed(prompt_ids, prompt_mask, response_ids, response_mask.bool(), packing, with_entropy)
        hidden = (self._full_sequences if full else self._shared_prompt)(
            prompt_ids, prompt_mask, response_ids, response_mask
        )
        return core.chunked_token_logprobs(
            hidden, self.causal.get_output_embeddings(), response_ids, self.logprob_chunk, with_entropy
        )

    def _prompt(self, prompt_ids, prompt_mask):
        """The base model over each group's left-padded prompt (P, Lp), once: its last hidden state and its keys and
        values (the cache the group's responses attend to)."""
        return self.causal.base_model(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=(prompt_mask.cumsum(1) - 1).clamp_min(0),
            use_cache=True,
        )

    def _shared_prompt(self, prompt_ids, prompt_mask, response_ids, response_mask) -> Tensor:
        """Hidden states (P*G, T, H), [:, t] predicting response_ids[:, t]."""
        g = response_ids.shape[0] // prompt_ids.shape[0]
        out = self._prompt(prompt_ids, prompt_mask)
        cache = out.past_key_values
        cache.batch_repeat_interleave(g)  # (P, ...) -> (P*G, ...), differentiable
        first = out.last_hidden_state[:, -1:].repeat_interleave(g, 0)  # (P*G, 1, H): predicts response token 0
        start = prompt_mask.sum(1).repeat_interleave(g)[:, None]  # (P*G, 1)
        mask = torch.cat([prompt_mask.repeat_interleave(g, 0), response_mask.long()], 1)
        out = self.causal.base_model(
            input_ids=response_ids,
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            position_ids=start + torch.arange(response_ids.shape[1], device=start.device),
        )
        return torch.cat([first, out.last_hidden_state[:, :-1]], 1)

    def _packing(self, prompt_ids, response_mask) -> Packing | None:
        """The rows packing would use, when padding_free, the attention takes a mask of our own and packing
        saves at least PACK_MIN_SAVING of the rows; else None (one row per response)."""
        if not self.padding_free or self.causal.config._attn_implementation not in ("sdpa", "eager"):
            return None
        lengths = response_mask.sum(1).long().tolist()
        packing = pack_responses(lengths, len(lengths) // len(prompt_ids), response_mask.shape[1])
        return packing if len(packing.row_group) <= (1 - PACK_MIN_SAVING) * len(lengths) else None

    def _packed(self, prompt_ids, prompt_mask, response_ids, mask, packing: Packing, with_entropy: bool):
        """forward() with each group's responses packed into shared rows (pack_responses): each row's cache is its
        group's prompt, each response attends to that prompt and to its own tokens, and the LM head sees only the
        real tokens (M of them). Same log-probs (N, T) and entropy as one row per response, to float rounding."""
        n, t = mask.shape
        g, width, rows = n // len(prompt_ids), packing.width, len(packing.row_group)
        out = self._prompt(prompt_ids, prompt_mask)
        cache = out.past_key_values
        cache.batch_select_indices(packing.row_group)  # (P, ...) -> (R, ...), differentiable
        offset = torch.arange(t, device=mask.device).expand(n, t)[mask]  # (M,) each real token's place in its response
        sample = torch.arange(n, device=mask.device)[:, None].expand(n, t)[mask]  # (M,) and its response
        cell = packing.start.to(mask.device)[sample] + offset  # (M,) its flat place row * width + column
        seg = -1 - torch.arange(rows * width, device=mask.device)  # padding cells: a segment each, alone
        seg[cell] = sample
        ids = response_ids.new_zeros(rows * width).index_put((cell,), response_ids[mask])
        prompt_len = prompt_mask.sum(1)  # (P,)
        pos = prompt_len.new_zeros(rows * width).index_put((cell,), prompt_len[sample // g] + offset)
        seg = seg.view(rows, width)
        causal = torch.ones(width, width, dtype=torch.bool, device=mask.device).tril()
        attend = torch.cat(  # (R, 1, width, Lp + width): the group's prompt, then its own tokens causally
            [
                prompt_mask[packing.row_group].bool()[:, None, None, :].expand(rows, 1, width, prompt_mask.shape[1]),
                ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None],
            ],
            -1,
        )
        if self.causal.config._attn_implementation == "eager":  # eager adds the mask to the scores
            attend = torch.zeros(attend.shape, device=mask.device).masked_fill(~attend, torch.finfo(torch.float32).min)
        hidden = self.causal.base_model(
            input_ids=ids.view(rows, width),
            attention_mask=attend,
            past_key_values=cache,
            use_cache=True,
            position_ids=pos.view(rows, width),
        ).last_hidden_state.reshape(rows * width, -1)
        # token 0 is predicted by the prompt's last hidden state, token k > 0 by the cell before it
        prompt_last = out.last_hidden_state[:, -1].to(hidden.dtype)  # (P, H)
        before = torch.where(offset == 0, rows * width + sample // g, cell - 1)  # (M,)
        logp, entropy = core.chunked_token_logprobs(
            torch.cat([hidden, prompt_last])[before][None],
            self.causal.get_output_embeddings(),
            response_ids[mask][None],
            self.logprob_chunk,
            with_entropy,
        )
        zeros = torch.zeros(n, t, device=mask.device, dtype=logp.dtype)
        return zeros.masked_scatter(mask, logp[0]), None if entropy is None else zeros.masked_scatter(mask, entropy[0])

    def _full_sequences(self, prompt_ids, prompt_mask, response_ids, response_mask) -> Tensor:
        """Same hidden states from one forward over each sample's prompt + response, no cache."""
        g, width = response_ids.shape[0] // prompt_ids.shape[0], prompt_ids.shape[1]
        mask = torch.cat([prompt_mask.repeat_interleave(g, 0), response_mask.long()], 1)
        out = self.causal.base_model(
            input_ids=torch.cat([prompt_ids.repeat_interleave(g, 0), response_ids], 1),
            attention_mask=mask,
            position_ids=(mask.cumsum(1) - 1).clamp_min(0),
            use_cache=False,
        )
        return out.last_hidden_state[:, width - 1 : width - 1 + response_ids.shape[1]]  # the last prompt token on


PACK_MIN_SAVING = 0.1  # pack a microbatch's responses when that leaves out at least this share of its rows


@dataclass(frozen=True)
class Packing:
    """Where a microbatch's responses sit when each group's share rows (learn.padding_free)."""

    row_group: Tensor  # (R,) long: the group (prompt) whose responses fill row r
    start: Tensor  # (N,) long: row * width + column of each response's first token
    width: int  # tokens a row holds: the microbatch's longest response


def pack_responses(lengths: list[int], group_size: int, width: int) -> Packing:
    """First-fit decreasing of each group's responses into rows of `width` tokens, a row holding one group's.

    lengths (N,), group g's responses at g*G .. g*G+G-1.

    >>> p = pack_responses([5, 2, 3, 1, 4, 4], group_size=3, width=5)
    >>> p.row_group.tolist(), p.start.tolist()
    ([0, 0, 1, 1], [0, 8, 5, 14, 10, 15])
    """
    row_group, start = [], [0] * len(lengths)
    for g in range(len(lengths) // group_size):
        members = range(g * group_size, (g + 1) * group_size)
        free: list[list[int]] = []  # [row, tokens left] of this group's rows
        for i in sorted(members, key=lambda i: -lengths[i]):
            fit = next((f for f in free if f[1] >= lengths[i]), None)
            if fit is None:
                fit = [len(row_group), width]
                row_group.append(g)
                free.append(fit)
            start[i] = fit[0] * width + width - fit[1]
            fit[1] -= lengths[i]
    return Packing(torch.tensor(row_group, dtype=torch.long), torch.tensor(start, dtype=torch.long), width)


def forward_logprobs(model, batch: Batch, groups: Tensor, with_entropy: bool = False):
    """Per-token log-probs (P'*G, T) of the responses of `groups` (P',) under `model` (a PolicyLM),
    rows in Batch.rows order, and their entropy (or None); 0 past each response's end.

    No compute on the batch's padding beyond these groups' own: the forward sees only the columns from
    their longest prompt's first token to their longest response's last (the batch is padded to its
    longest of each). Positions come from the masks, so the log-probs are the same."""
    rows = batch.rows(groups)
    prompt_mask, response_mask = batch.prompt_mask[groups], batch.response_mask[rows]
    lp, width = prompt_mask.shape[1], batch.response_ids.shape[1]
    start = lp - max(1, int(prompt_mask.sum(1).max()))  # left padding every prompt of these groups has
    end = max(1, int(response_mask.sum(1).max()))  # right padding every response has
    logp, entropy = model(
        batch.prompt_ids[groups, start:],
        prompt_mask[:, start:],
        batch.response_ids[rows, :end],
        response_mask[:, :end],
        with_entropy=with_entropy,
    )
    pad, kept = (0, width - end), response_mask[:, :end]  # (P'*G, end) -> (P'*G, T)
    return F.pad(logp * kept, pad), None if entropy is None else F.pad(entropy * kept, pad)


@torch.no_grad()
def score(model, batch: Batch, chunk_groups: int, groups: Tensor | None = None) -> Tensor:
    """Log-probs (N, T) of every response (of `groups`, default all) under `model`, `chunk_groups`
    groups a forward."""
    model.eval()
    groups = torch.arange(len(batch.prompt_ids), device=batch.prompt_ids.device) if groups is None else groups
    return torch.cat([forward_logprobs(model, batch, c)[0] for c in groups.split(chunk_groups)])


@dataclass(frozen=True)
class Scores:
    """The log-probs every minibatch's loss compares against, computed before the first update."""

    old_logprobs: Tensor  # (N, T) the snapshot policy's, without gradient
    ref_logprobs: Tensor | None  # (N, T) the frozen reference's; None without a KL penalty
    # (N,) rows whose old log-probs the first minibatch's own forward gives (the policy is still the
    # snapshot's then: no scoring pass for them); their old_logprobs rows are filled by that step
    pending: Tensor | None = None
    # (N,) learn.old_logprobs=auto: rows settled after that forward, before the first step (settle_deferred):
    # the sampler's log-probs where the pending rows show them equal to the learner's, else scored then
    deferred: Tensor | None = None


def minibatch_step(
    model, batch: Batch, scores: Scores, groups: Tensor, lcfg: LearnConfig, accum: int, max_tokens: int, autocast
) -> dict[str, float]:
    """Forward/backward over this rank's `groups` in microbatches. Returns metrics: the extremes
    (`*_max`, `*_min`) over microbatches, the rest summed / accum."""
    totals: dict[str, float] = {}
    # longest responses together: each microbatch's forward pads only to its own longest (forward_logprobs)
    longest = batch.response_mask[batch.rows(groups)].sum(1).view(len(groups), -1).amax(1)
    groups = groups[longest.argsort(descending=True, stable=True)]
    for mb_groups in groups.split(max(1, lcfg.process_microbatch // batch.group_size)):
        mb = batch.rows(mb_groups)
        mask = batch.response_mask[mb]
        with autocast():
            logp, entropy = forward_logprobs(model, batch, mb_groups, with_entropy=True)
        if scores.pending is not None and bool(scores.pending[mb].all()):  # pi_old = pi_theta, before any step
            scores.old_logprobs[mb] = logp.detach().to(scores.old_logprobs.dtype)
        ref = scores.ref_logprobs
        loss, metrics = core.grpo_microbatch_step(
            logp,
            mask,
            gradient_accumulation_steps=accum,
            loss_type=lcfg.loss_type,
            agg_mode=lcfg.agg_mode,
            raw_rewards=batch.rewards[mb, None],
            advantages=batch.advantages[mb, None],
            old_logprobs=scores.old_logprobs[mb],
            ref_logprobs=None if ref is None else ref[mb],
            kl_coef=lcfg.kl_coef,
            kl_estimator=lcfg.kl_estimator,
            clip_eps=lcfg.clip_eps,
            clip_eps_high=lcfg.clip_eps_high,
            dual_clip_c=lcfg.dual_clip_c,
            max_tokens=max_tokens,
            sampler_logprobs=batch.sampler_logprobs[mb],
            importance_correction=lcfg.importance_correction,
            tis_cap=lcfg.tis_cap,
        )
        metrics["loss/total"] = loss.detach() * accum
        metrics["actor/entropy"] = core.masked_mean(entropy, mask)
        for k, v in metrics.items():
            reduce = _EXTREMES.get(k.rsplit("_", 1)[-1])
            totals[k] = reduce(totals.get(k, float(v)), float(v)) if reduce else totals.get(k, 0.0) + float(v) / accum
    return totals


_EXTREMES = {"max": max, "min": min}  # metric key suffix -> how microbatches (and ranks) combine


def reduce_across_ranks(acc, metrics: dict[str, float]) -> dict[str, float]:
    """One process's metrics -> every process's: `*_max` / `*_min` by max / min, the rest by mean."""
    if acc.num_processes == 1:
        return metrics
    import torch.distributed as dist

    ops = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}  # the suffixes of _EXTREMES
    groups: dict[str, list[str]] = {}
    for k in metrics:
        suffix = k.rsplit("_", 1)[-1]
        groups.setdefault(suffix if suffix in ops else "mean", []).append(k)
    out = {}
    for op, keys in groups.items():
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=acc.device)
        if op == "mean":
            t = acc.reduce(t, "mean")
        else:
            dist.all_reduce(t, ops[op])
        out.update(zip(keys, t.tolist()))
    return {k: out[k] for k in metrics}


def optimizer_steps(opt) -> int:
    """Optimizer steps taken over the whole run: AdamW's own count, carried in optimizer.pt."""
    steps = [int(s["step"]) for s in opt.state.values() if "step" in s]
    return max(steps, default=0)


class Learner:
    """The policy being trained (float32 master weights, or frozen base + float32 LoRA adapters), its
    AdamW state, the shuffling RNG and the frozen reference (loaded only when learn.kl_coef > 0: nothing
    else reads it; with LoRA it is the base with the adapters switched off, no second copy; the base, or
    with learn.ref_update_every a snapshot, swapped by use_reference).

    Built from checkpoint folders (and the previous iteration's optimizer.pt or dcp/, rng.pt and master
    weights); a warm run keeps it in memory for the next iteration instead, which then trains exactly as
    one built from the committed files would. learn.sharding=fsdp2 shards it across processes
    (grpo.sharding); the same code runs on every process.
    """

    def __init__(
        self,
        cfg: RunConfig,
        policy_dir: str,
        ref_dir: str,
        state_dir: str | None,
        shuffle_seed: int,
        adapter_dir: str | None = None,
    ):
        from accelerate import Accelerator
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        lcfg = cfg.learn
        # mixed precision by torch.autocast, not Accelerator(mixed_precision=...): Accelerate's state is one per
        # process and refuses a second setting, and a warm process may serve runs with either
        self.acc = Accelerator(cpu=not torch.cuda.is_available())
        self.precision = dict(zip(("autocast", "why"), autocast_precision(lcfg.mixed_precision, self.acc.device)))
        self.save_dtype = checkpoint_dtype(ref_dir)  # checkpoints keep the base model's dtype
        self.sharded = lcfg.sharding == "fsdp2"
        self.lora = lcfg.lora is not None
        # LoRA: the base is frozen and stays in its own dtype; only the adapters (float32) train
        lm = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=self.save_dtype if self.lora else torch.float32)
        if not self.lora and state_dir and Path(state_dir, MASTER_WEIGHTS).exists():  # the last update, unrounded
            from safetensors.torch import load_model

            load_model(lm, f"{state_dir}/{MASTER_WEIGHTS}")
        if lcfg.gradient_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora:
            lm = with_adapter(lm, lcfg.lora, adapter_dir, seed=shuffle_seed)
        model = PolicyLM(
            lm,
            lcfg.logprob_chunk,
            full_sequences_in_training=lcfg.gradient_checkpointing,
            padding_free=lcfg.padding_free,
        )
        world, device = self.acc.num_processes, self.acc.device
        shard = self.sharded and world > 1
        self.ref, self.ref_dir = None, None
        self.use_reference(ref_dir)
        if shard:
            sharding.fully_shard_policy(model.to(device), world, device)
        # fused: one kernel for all parameters (4x faster steps on CPU for small models)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=lcfg.lr, betas=lcfg.betas, weight_decay=lcfg.weight_decay, fused=True)
        self.shuffle = torch.Generator().manual_seed(shuffle_seed)
        if state_dir:  # continue exactly where the previous iteration ended
            if Path(state_dir, STATE_DCP).exists():  # sharded state, written at any world size
                sharding.load_state(model.to(device), opt, f"{state_dir}/{STATE_DCP}", trainable_only=self.lora)
            else:
                opt.load_state_dict(torch.load(f"{state_dir}/optimizer.pt", weights_only=True, map_location="cpu"))
            self.shuffle.set_state(torch.load(f"{state_dir}/rng.pt", weights_only=True)["shuffle"])
        if self.sharded:  # no DDP wrapper: FSDP2 (or, on one process, nothing) averages the gradients
            self.model, self.opt = model.to(device), opt
        else:
            self.model, self.opt = self.acc.prepare(model, opt)

    def use_reference(self, ref_dir: str) -> None:
        """Make the checkpoint in ref_dir the frozen reference, loading it unless it is the one held (a warm
        learner's moves with learn.ref_update_every). Only with kl_coef > 0 and no LoRA is there a model to
        load: LoRA's reference is the base with the adapters off."""
        lcfg, world, device = self.cfg.learn, self.acc.num_processes, self.acc.device
        if lcfg.kl_coef == 0 or self.lora or ref_dir == self.ref_dir:
            return
        from transformers import AutoModelForCausalLM

        self.ref = None  # the old reference goes before the new one loads
        ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).requires_grad_(False)
        self.ref = PolicyLM(ref, lcfg.logprob_chunk, padding_free=lcfg.padding_free).eval().to(device)
        if self.sharded and world > 1:
            sharding.fully_shard_policy(self.ref, world, device)
        self.ref_dir = ref_dir

    def autocast(self):
        """The forwards' precision: bf16 autocast where learn.mixed_precision resolves to bf16, else as the
        weights."""
        bf16 = self.precision["autocast"] == "bf16"
        return torch.autocast(self.acc.device.type, dtype=torch.bfloat16, enabled=bf16)

    def reference_scores(self, batch: Batch, chunk_groups: int) -> Tensor | None:
        """The frozen reference's log-probs (N, T); None without a KL penalty."""
        if self.cfg.learn.kl_coef == 0:
            return None
        if self.ref is not None:
            return score(self.ref, batch, chunk_groups)
        policy = self.acc.unwrap_model(self.model)
        with policy.adapter_disabled():  # LoRA: the base model is the reference
            return score(policy, batch, chunk_groups)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradients' global norm to max_norm; returns the norm before clipping."""
        if not self.sharded:
            return float(self.acc.clip_grad_norm_(self.model.parameters(), max_norm))
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return sharding.total_norm(torch.nn.utils.clip_grad_norm_(trainable, max_norm))

    def to(self, device) -> None:
        """Move the model, the reference and AdamW's state (off the GPU while a sampler uses it)."""
        for module in (self.acc.unwrap_model(self.model), self.ref):
            if module is not None:
                module.to(device)
        for state in self.opt.state.values():
            for k, v in state.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    state[k] = v.to(device)
        if device == "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def save(self, out_dir: str) -> None:
        """Every process calls this. Into the local folder out_dir: policy/ (HF checkpoint in the base
        model's dtype) or, with LoRA, adapter/ (peft's adapter_model.safetensors + adapter_config.json);
        the optimizer state (optimizer.pt, or dcp/ with every process's shards under fsdp2); rng.pt; and,
        when the checkpoint's dtype is narrower than float32 and nothing else keeps them, the float32
        master weights (master.safetensors)."""
        out, policy = Path(out_dir), self.acc.unwrap_model(self.model)
        main = self.acc.is_main_process
        state = sharding.full_state_dict(policy, trainable_only=self.lora) if self.sharded else None
        if main and state is not None:  # gathered whole: a tied weight comes back once per name
            aliases = _aliases(policy)
            state = {k.removeprefix("lm."): v for k, v in state.items() if k not in aliases}
        if main:
            (self._save_adapter if self.lora else self._save_policy)(policy.lm, state, out)
        if self.sharded:
            sharding.save_state(policy, self.opt, out / STATE_DCP, trainable_only=self.lora)
        elif main:
            torch.save(self.opt.state_dict(), out / "optimizer.pt")
        if main:
            torch.save({"shuffle": self.shuffle.get_state(), "torch": torch.get_rng_state()}, out / "rng.pt")

    @staticmethod
    def _save_adapter(lm, state: dict | None, out: Path) -> None:
        """adapter/: the trained adapters alone (megabytes), loadable on the base with peft."""
        lm.peft_config["default"].base_model_name_or_path = None  # a local cache path: not part of the policy
        lm.save_pretrained(out / ADAPTER_DIR, state_dict=state)
        (out / ADAPTER_DIR / "README.md").unlink(missing_ok=True)  # peft's model-card template

    def _save_policy(self, lm, state: dict | None, out: Path) -> None:
        """policy/: every weight in the base model's dtype, tied weights saved once."""
        from safetensors.torch import save_model

        if self.save_dtype == torch.float32:
            lm.save_pretrained(out / "policy", safe_serialization=True, state_dict=state)
            return
        source = lm.state_dict() if state is None else state
        cast: dict[int, torch.Tensor] = {}  # one copy per storage: tied weights stay tied (saved once)
        narrow = {k: cast.setdefault(v.data_ptr(), v.to(self.save_dtype)) for k, v in source.items()}
        lm.save_pretrained(out / "policy", safe_serialization=True, state_dict=narrow)
        config = json.loads((out / "policy/config.json").read_text())
        config["dtype"] = str(self.save_dtype).removeprefix("torch.")
        (out / "policy/config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if state is None:  # sharded: dcp/ holds the float32 weights
            save_model(lm, str(out / MASTER_WEIGHTS))


def _aliases(module: torch.nn.Module) -> set[str]:
    """Names of parameters that are another name's parameter (tied weights), all but the first."""
    first: dict[int, str] = {}
    return {n for n, p in module.named_parameters(remove_duplicate=False) if first.setdefault(id(p), n) != n}


def with_adapter(lm, lora, adapter_dir: str | None, seed: int):
    """`lm` with LoRA adapters (peft): those of adapter_dir, trainable, or new ones (A drawn from `seed`,
    B zero: the policy starts as the base). lora: grpo.config.LoraConfig."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model

    if adapter_dir:
        return PeftModel.from_pretrained(lm, adapter_dir, is_trainable=True)
    peft_config = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(lm, peft_config)


@dataclass(frozen=True)
class Update:
    """What `train` returns: the summary, a metrics row per optimizer step, and the scores."""

    summary: dict
    rows: list[dict]
    scores: Scores  # on the CPU


class PiOld(NamedTuple):
    """What an OLD_LOGPROBS function gives before the first step."""

    old: Tensor  # (N, T) the old log-probs known so far
    pending: Tensor | None  # (N,) rows the first minibatch's forward fills (Scores.pending)
    deferred: Tensor | None  # (N,) rows settle_deferred settles after that forward (Scores.deferred)
    source: dict | None  # the learn manifest's `old_logprobs`; None: settle_deferred says


def _score_rows(learner: Learner, batch: Batch, chunk_groups: int, rows: Tensor, old: Tensor) -> None:
    """old[rows] (N, T) scored now by the policy, `rows` (N,) bool covering whole groups."""
    groups = rows.view(len(batch.prompt_ids), -1)[:, 0].nonzero()[:, 0]
    if len(groups):
        model = learner.acc.unwrap_model(learner.model)
        old[batch.rows(groups)] = score(model, batch, chunk_groups, groups=groups).to(old.dtype)


def _first_rows(batch: Batch, first: Tensor) -> Tensor:
    """(N,) bool: the rows of the groups `first` (P',), the first minibatch's."""
    rows = torch.zeros(len(batch.response_ids), dtype=torch.bool, device=batch.response_ids.device)
    rows[batch.rows(first)] = True
    return rows


def _recomputed(learner: Learner, batch: Batch, chunk_groups: int, first: Tensor) -> PiOld:
    """pi_old as the snapshot's policy scores the batch now, before the first step, but for the rows left for
    the first minibatch's forward to give. That forward runs the snapshot's weights too, so the groups `first`
    (P',) of the first minibatch are not scored here (TRL skips the whole pass when an iteration takes one
    step) unless the training forward is not the scoring one (dropout on)."""
    pending = _first_rows(batch, first[:0] if active_dropout(learner.acc.unwrap_model(learner.model)) else first)
    old = torch.zeros_like(batch.sampler_logprobs)
    _score_rows(learner, batch, chunk_groups, ~pending, old)
    return PiOld(old, pending if pending.any() else None, None, {"source": "recomputed"})


def _from_sampler(learner: Learner, batch: Batch, chunk_groups: int, first: Tensor) -> PiOld:
    """pi_old as the sampler reported it, no forward pass."""
    return PiOld(batch.sampler_logprobs, None, None, {"source": "sampler"})


def _auto(learner: Learner, batch: Batch, chunk_groups: int, first: Tensor) -> PiOld:
    """No pass yet: the first minibatch's forward gives its rows, and the rest wait for settle_deferred (Scores.
    deferred); recompute's pass where that forward is not the scoring one (dropout on)."""
    if active_dropout(learner.acc.unwrap_model(learner.model)) or not len(first):
        return _recomputed(learner, batch, chunk_groups, first)
    pending = _first_rows(batch, first)
    return PiOld(torch.zeros_like(batch.sampler_logprobs), pending, ~pending, None)


OLD_LOGPROBS: dict[str, Callable[[Learner, Batch, int, Tensor], PiOld]] = {
    "recompute": _recomputed,
    "sampler": _from_sampler,
    "auto": _auto,
}
"""learn.old_logprobs -> where pi_old comes from (grpo.variants.OldLogprobs)."""

SAMPLER_MAX_DIFF = 1e-3
"""learn.old_logprobs=auto takes the sampler's log-probs as pi_old when none of the first minibatch's tokens differs
from the learner's own by more than this (a ratio off by 0.1% at most, against clip ranges of 20%): the sampler
then runs the learner's numerics (measured: the transformers backend and vLLM on a CPU, both float32, within 1e-6
at the demo's size); a bf16 sampler beside a float32 learner differs by more, and the rest is scored."""


def settle_deferred(learner: Learner, batch: Batch, scores: Scores, checked: Tensor, chunk_groups: int) -> tuple:
    """After the first minibatch's forward and backward, before its step (the weights are still the snapshot's):
    the deferred rows' old log-probs, the sampler's when the `checked` rows (N,) (the first minibatch's, filled)
    match them within SAMPLER_MAX_DIFF, else scored now. Returns (scores, {source, max_diff})."""
    diff = float(((batch.sampler_logprobs - scores.old_logprobs).abs() * batch.response_mask)[checked].max())
    old, rows = scores.old_logprobs, scores.deferred
    if diff <= SAMPLER_MAX_DIFF:
        old[rows] = batch.sampler_logprobs[rows].to(old.dtype)
        source = "sampler"
    else:
        with learner.autocast():
            _score_rows(learner, batch, chunk_groups, rows, old)
        learner.model.train()  # score() left it in eval mode
        source = "recomputed"
    return dataclasses.replace(scores, deferred=None), {"source": source, "max_diff": diff}


def active_dropout(model: torch.nn.Module) -> bool:
    """Whether a training forward differs from a scoring one: a dropout module or a config's dropout rate
    (attention dropout is a float handed to the attention kernel) above 0."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    configs = [m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "to_dict")]
    return any(
        isinstance(v, float) and v > 0 and k.endswith(("dropout", "pdrop"))
        for c in configs
        for k, v in c.to_dict().items()
    )


def _fill_pending(acc, scores: Scores) -> Scores:
    """After the first minibatch: every process's share of its pending rows, on every process."""
    if scores.pending is None:
        return scores
    if acc.num_processes > 1:  # each process filled its own groups' rows; the others are still 0 there
        scores.old_logprobs[scores.pending] = acc.reduce(scores.old_logprobs[scores.pending], "sum")
    return dataclasses.replace(scores, pending=None)


def train(learner: Learner, run_id: str, iteration: int, batch: Batch, torch_seed: int) -> Update:
    """Run the update in place on `learner` (every process runs this). Raises LearnError, having
    left the learner half-updated, when the result must not be committed."""
    cfg, lcfg, acc, model, opt = learner.cfg, learner.cfg.learn, learner.acc, learner.model, learner.opt
    torch.manual_seed(torch_seed)
    batch = batch.to(acc.device)
    g, chunk = batch.group_size, max(1, lcfg.process_microbatch // batch.group_size)
    # whole groups are shuffled and split: a minibatch is minibatch_size / G prompts with all their samples
    n_groups, world, rank = len(batch.prompt_ids), acc.num_processes, acc.process_index
    per_step = lcfg.minibatch_size // g
    order = torch.randperm(n_groups, generator=learner.shuffle).to(acc.device)  # epoch 0's
    t0 = time.perf_counter()
    with learner.autocast():
        old, pending, deferred, source = OLD_LOGPROBS[lcfg.old_logprobs](
            learner, batch, chunk, order[:per_step] if per_step <= n_groups else order[:0]
        )
        scores = Scores(old, learner.reference_scores(batch, chunk), pending, deferred)
    score_s, update_s = time.perf_counter() - t0, 0.0
    mask = batch.response_mask
    gap = None if scores.pending is not None else sampler_gap(batch, scores, iteration, lcfg.max_logprob_gap)
    model.train()

    accum = max(1, lcfg.minibatch_size // world // lcfg.process_microbatch)
    max_tokens = cfg.rollout.max_tokens  # Dr.GRPO's constant divisor: the response budget
    rows, step = [], 0
    for epoch in range(lcfg.epochs):
        if epoch:
            order = torch.randperm(n_groups, generator=learner.shuffle).to(acc.device)
        for start in range(0, n_groups - per_step + 1, per_step):
            groups = order[start : start + per_step]
            t0 = time.perf_counter()
            m = reduce_across_ranks(
                acc,
                minibatch_step(model, batch, scores, groups[rank::world], lcfg, accum, max_tokens, learner.autocast),
            )
            if scores.pending is not None:  # every old log-prob known now: check the sampler's before a step
                checked, scores = scores.pending, _fill_pending(acc, scores)
                if scores.deferred is not None:
                    t1 = time.perf_counter()
                    scores, source = settle_deferred(learner, batch, scores, checked, chunk)
                    settled_s = time.perf_counter() - t1
                    score_s, t0 = score_s + settled_s, t0 + settled_s  # scoring time, not the update's
                measured = checked if source["source"] == "sampler" else None  # auto took the sampler's
                gap = sampler_gap(batch, scores, iteration, lcfg.max_logprob_gap, measured)
            if not all(math.isfinite(v) for v in m.values()):
                raise LearnError(f"learn iteration {iteration} step {step}: non-finite loss {m}; nothing committed")
            grad_norm = learner.clip_grad_norm(lcfg.max_grad_norm)
            if not math.isfinite(grad_norm):
                raise LearnError(f"learn iteration {iteration} step {step}: non-finite grad norm; nothing committed")
            lr = core.linear_decay_lr(lcfg.lr, optimizer_steps(opt), lcfg.lr_decay_steps)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            opt.zero_grad(set_to_none=True)
            update_s += time.perf_counter() - t0
            n_tok = int(mask[batch.rows(groups)].sum())
            rows.append(_metric_row(run_id, iteration, step, epoch, m, grad_norm, lr, n_tok, gap))
            step += 1
            if acc.is_main_process:
                progress(f"learn {iteration}", step, lcfg.epochs * (n_groups // per_step), "steps")
        if acc.is_main_process:  # one line an epoch; every step's metrics go to metrics.parquet
            epoch_rows = [r for r in rows if r["epoch"] == epoch]
            log.info(
                "learn iteration %d: epoch %d/%d, %d steps, %s",
                iteration,
                epoch + 1,
                lcfg.epochs,
                len(epoch_rows),
                _epoch_means(epoch_rows),
            )
    _check_weights(learner, batch, iteration, step)
    last = rows[-1] if rows else {}
    summary = {
        "steps": step,
        "samples": len(batch.response_ids),
        "loss": last.get("loss"),
        "kl": last.get("kl"),
        "clip_frac": last.get("clip_frac"),
        "entropy": sum(r["entropy"] for r in rows) / len(rows) if rows else None,  # mean over the steps
        "grad_norm": last.get("grad_norm"),
        "logprob_gap": gap,
        "old_logprobs": source,
        "world_size": world,
        "precision": learner.precision,
        "score_s": score_s,
        "update_s": update_s,
        "tokens": sum(r["n_tokens"] for r in rows),
    }
    cpu = Scores(
        scores.old_logprobs.float().cpu(), None if scores.ref_logprobs is None else scores.ref_logprobs.float().cpu()
    )
    return Update(summary, rows, cpu)


def autocast_precision(setting: str, device: torch.device) -> tuple[str, str]:
    """(autocast, why) for learn.mixed_precision `setting` on `device`: `auto` is bf16 where the device computes
    it natively, "no" elsewhere.

    >>> autocast_precision("bf16", torch.device("cpu"))
    ('bf16', 'learn.mixed_precision')
    """
    if setting != "auto":
        return setting, "learn.mixed_precision"
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return ("bf16", "auto: GPU with bf16") if native else ("no", "auto: GPU without native bf16")
    if device.type == "cpu" and cpu_has_native_bf16():
        return "bf16", "auto: CPU with AMX or AVX512-BF16"
    return "no", f"auto: {device.type} without native bf16"


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this machine's CPU computes bf16 natively (AMX or AVX512-BF16 in /proc/cpuinfo's flags)."""
    try:
        flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    except OSError:  # not Linux
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def sampler_gap(
    batch: Batch, scores: Scores, iteration: int, max_gap: float | None, rows: Tensor | None = None
) -> float:
    """Mean |sampler log-prob - old log-prob| a token (over `rows` (N,) bool, default all: where pi_old is the
    learner's own); raises LearnError above learn.max_logprob_gap."""
    mask = batch.response_mask if rows is None else batch.response_mask * rows[:, None]
    gap = float(core.masked_mean((batch.sampler_logprobs - scores.old_logprobs).abs(), mask))
    if max_gap is not None and gap > max_gap:
        raise LearnError(
            f"learn iteration {iteration}: the sampler's log-probs differ from the snapshot's by "
            f"{gap:.4g} a token on average (> learn.max_logprob_gap={max_gap}): the sampler "
            "may have served other weights; nothing committed. Rerun rollouts (--force)"
        )
    return gap


def _check_weights(learner: Learner, batch: Batch, iteration: int, steps: int) -> None:
    """Never commit weights the sampler cannot sample from: every parameter finite, and (finite weights
    can still be huge: a huge lr) the first group's log-probs too."""
    lm = learner.acc.unwrap_model(learner.model)
    bad = [n for n, p in lm.named_parameters() if p.requires_grad and not bool(torch.isfinite(sharding.local(p)).all())]
    if learner.acc.num_processes > 1:  # each process sees its own shards: all of them decide together
        n_bad = learner.acc.reduce(torch.tensor(float(len(bad)), device=learner.acc.device), "sum")
        bad = bad or (["weights of another process"] if float(n_bad) else [])
    if not bad:
        with learner.autocast():
            probe = score(lm, batch, 1, groups=torch.arange(1, device=batch.prompt_ids.device))
        bad = (
            []
            if bool(torch.isfinite(probe[batch.response_mask[: probe.shape[0]].bool()]).all())
            else ["log-probs of the new weights"]
        )
    if bad:
        raise LearnError(
            f"learn iteration {iteration}: non-finite weights after {steps} steps "
            f"({', '.join(bad[:3])}); nothing committed; lower learn.lr (now {learner.cfg.learn.lr})"
        )


def _metric_row(run_id, iteration, step, epoch, m, grad_norm, lr, n_tokens, gap) -> dict:
    return {
        "run_id": run_id,
        "iteration": iteration,
        "step": step,
        "epoch": epoch,
        "loss": m["loss/total"],
        "pg_loss": m.get("loss/pg", 0.0),
        "kl": m.get("loss/kl"),  # None: no reference
        "clip_frac": m.get("actor/clip_frac", 0.0),
        "entropy": m["actor/entropy"],
        "grad_norm": grad_norm,
        "ratio_mean": m.get("actor/ratio_mean", 1.0),
        "ratio_min": m.get("actor/ratio_min", 1.0),
        "ratio_max": m.get("actor/ratio_max", 1.0),
        "logprob_gap": gap,
        "lr": lr,
        "n_tokens": n_tokens,
    }


def _epoch_means(rows: list[dict]) -> str:
    """'loss -0.01 kl 0.002 clip_frac 0.12 ...': means over an epoch's metric rows (kl only if measured)."""
    keys = ["loss", "kl", "clip_frac", "entropy", "grad_norm"]
    means = {k: sum(r[k] for r in rows) / len(rows) for k in keys if rows and rows[0][k] is not None}
    return " ".join(f"{k} {v:.4g}" for k, v in means.items())
