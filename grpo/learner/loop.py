"""The update loop: `train` runs one iteration's GRPO update on a Learner, in minibatches of whole groups and
microbatches of gradient accumulation, with its guards (non-finite loss, gradients, weights) and per-step
metrics.

1. pi_old (grpo/learner/pi_old.py) and, when kl_coef > 0, the reference score the rollouts under no_grad
   (both returned, so an audit can recompute every loss);
2. `epochs` passes over minibatches of whole groups in shuffled order (the batch's own where in_order),
   gradient accumulation over microbatches, loss = clipped policy gradient + kl_coef * KL (grpo.core), grad-norm
   clipping, AdamW with lr optionally decayed over the run's steps.
Rank r of a multi-process run (torchrun) takes every r-th group of each minibatch; DDP's
gradient average then equals the one-process gradient: every rank's microbatches hold as many sequences
(the per-sequence modes), and token_mean divides by the whole minibatch's tokens (grpo.core).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo import core
from grpo.config import LearnConfig
from grpo.errors import LearnError
from grpo.learner import kernels, sharding
from grpo.learner.batch import Batch, Scores
from grpo.learner.loss import within_age
from grpo.learner.model import forward_logprobs, score
from grpo.learner.pi_old import OldLogprobs
from grpo.learner.state import Learner, optimizer_steps
from grpo.progress import progress
from grpo.record.lineage import policy_version

log = logging.getLogger("grpo.learner")


def minibatch_step(
    model,
    batch: Batch,
    scores: Scores,
    microbatches: list[Tensor],
    spec: core.LossSpec,
    accum: int,
    autocast,
    token_normalizer: float,
    sequence_normalizer: float | None = None,
    pi_old: OldLogprobs | None = None,
) -> dict[str, float]:
    """Forward/backward over this rank's `microbatches` (each a tensor of groups: split_microbatches), the
    microbatches whose forward gives their rows' pi_old handing it to `pi_old` (whose tensor scores.old_logprobs
    is); token_normalizer and sequence_normalizer are token_mean's and the per-sequence modes' divisors of each
    microbatch's sums (grpo.core.grpo_microbatch_step). Returns metrics: the extremes (`*_max`, `*_min`) over
    microbatches, the rest summed / accum. No host sync inside the loop: the metrics stay on the device in float64
    (as Python floats would add them) and come to the host once, at the end."""
    totals: dict[str, Tensor] = {}
    gives = [False] * len(microbatches) if pi_old is None else pi_old.gives(microbatches)
    for mb_groups, gives_pi_old in zip(microbatches, gives):
        mb = batch.rows(mb_groups)
        mask = batch.loss_mask[mb]  # (R, T) the tokens trained on: the sampled ones of every turn
        gkd = spec.gkd_coef > 0 and batch.topk_ids is not None  # GKD: the top-k log-probs from the same forward
        with autocast():
            logp, entropy, *student_topk = forward_logprobs(model, batch, mb_groups, with_entropy=True, topk=gkd)
        gkd_kl = gkd_term(batch, mb, student_topk[0], mask) if gkd else None
        if gives_pi_old:  # pi_old = pi_theta, no step yet
            pi_old.take(mb, logp)
        ref = scores.ref_logprobs
        loss, metrics = core.grpo_microbatch_step(
            spec,
            logp,
            mask,
            gradient_accumulation_steps=accum,
            raw_rewards=batch.rewards[mb, None],
            advantages=batch.advantages_of(mb),
            old_logprobs=scores.old_logprobs[mb],
            ref_logprobs=None if ref is None else ref[mb],
            sampler_logprobs=batch.sampler_logprobs[mb],
            token_normalizer=token_normalizer,
            sequence_normalizer=sequence_normalizer,
            extra_loss=None if gkd_kl is None else gkd_kl * spec.gkd_coef / accum,  # one backward for both
        )
        metrics["loss/total"] = loss.detach() * accum
        metrics["actor/entropy"] = core.masked_mean(entropy, mask)
        if gkd_kl is not None:
            metrics["loss/gkd"] = gkd_kl.detach()
        for k, v in metrics.items():
            v = torch.as_tensor(v).detach().double()
            reduce = _EXTREMES.get(k.rsplit("_", 1)[-1])
            totals[k] = reduce(totals.get(k, v), v) if reduce else totals.get(k, 0.0) + v / accum
    if not totals:
        return {}
    device = next(iter(totals.values())).device
    return dict(zip(totals, torch.stack([t.to(device) for t in totals.values()]).tolist()))  # the one sync


_EXTREMES = {"max": torch.maximum, "min": torch.minimum}  # metric key suffix -> how microbatches combine


def gkd_term(batch: Batch, rows: Tensor, student_topk: Tensor, mask: Tensor) -> Tensor:
    """GKD's term (teacher.gkd_coef) on the microbatch's `rows`: the forward KL to the teacher over its top k
    (grpo.core.topk_forward_kl) from the student's log-probs of the teacher's top-k ids `student_topk` (R, T, k) (the
    policy-gradient loss's own forward: forward_logprobs' topk), its token mean over `mask` (R, T)."""
    kl = core.topk_forward_kl(student_topk.float(), batch.topk_logprobs[rows], batch.topk_tail[rows])
    return core.masked_mean(kl, mask)


def split_microbatches(batch: Batch, groups: Tensor, lcfg: LearnConfig, world: int) -> list[list[Tensor]]:
    """Every rank's microbatches of the minibatch `groups` (P',): rank r takes groups[r::world], longest responses
    first (a microbatch's forward pads only to its own longest: forward_logprobs), process_microbatch / G groups a
    microbatch, or with learn.microbatch_tokens as many as fit the budget (group_tokens), and then every rank
    as many microbatches, the most any needs (each backward is a collective under DDP and FSDP2): a rank with
    fewer halves its largest until it has as many. rank -> its microbatches, each a tensor of groups."""
    longest = batch.response_mask.sum(1).view(-1, batch.group_size).amax(1)  # (P,)
    mine = [groups[r::world] for r in range(world)]
    mine = [m[longest[m].argsort(descending=True, stable=True)] for m in mine]
    if lcfg.microbatch_tokens is None:
        return [list(m.split(max(1, lcfg.process_microbatch // batch.group_size))) for m in mine]
    tokens = group_tokens(batch).tolist()
    out = [_fill(m.tolist(), tokens, lcfg.microbatch_tokens) for m in mine]
    count = max(map(len, out))
    for mbs in out:
        while len(mbs) < count:  # halve the microbatch of the most tokens among those of 2+ groups
            i = max((i for i, mb in enumerate(mbs) if len(mb) > 1), key=lambda i: sum(tokens[x] for x in mbs[i]))
            mbs[i : i + 1] = [mbs[i][: len(mbs[i]) // 2], mbs[i][len(mbs[i]) // 2 :]]
    return [[torch.tensor(mb, device=groups.device) for mb in mbs] for mbs in out]


def _fill(groups: list[int], tokens: list[int], budget: int) -> list[list[int]]:
    """Consecutive `groups` into microbatches of at most `budget` tokens (a larger group alone)."""
    out: list[list[int]] = [[]]
    used = 0
    for g in groups:
        if out[-1] and used + tokens[g] > budget:
            out.append([])
            used = 0
        out[-1].append(g)
        used += tokens[g]
    return out


def group_tokens(batch: Batch) -> Tensor:
    """(P,) each group's tokens as its forward computes them: the prompt's once, then every response's."""
    responses = batch.response_mask.sum(1).view(-1, batch.group_size).sum(1)
    return batch.prompt_mask.sum(1).long() + responses.long()


def check_microbatch_tokens(batch: Batch, lcfg: LearnConfig, iteration: int) -> None:
    """learn.microbatch_tokens holds the largest group of the batch (a microbatch holds whole groups)."""
    if lcfg.microbatch_tokens is None:
        return
    largest = int(group_tokens(batch).max())
    if largest > lcfg.microbatch_tokens:
        raise LearnError(
            f"learn iteration {iteration}: learn.microbatch_tokens={lcfg.microbatch_tokens} is smaller than a group "
            f"of this batch ({largest} tokens: its prompt and its {batch.group_size} responses); set it to at "
            f"least {largest}, or unset it to split by learn.microbatch_size"
        )


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


def group_order(n_groups: int, in_order: bool, shuffle: torch.Generator) -> Tensor:
    """An epoch's order of the batch's groups: shuffled by the learner's generator, or the batch's own (in_order:
    a warm start's conversations, already drawn epoch by epoch without replacement; shuffled again, a minibatch
    would repeat some and a pass leave a third unseen)."""
    return torch.arange(n_groups) if in_order else torch.randperm(n_groups, generator=shuffle)


@dataclass(frozen=True)
class Update:
    """What `train` returns: the summary, a metrics row per optimizer step, and the scores."""

    summary: dict
    rows: list[dict]
    scores: Scores  # on the CPU


def train(learner: Learner, run_id: str, iteration: int, batch: Batch, torch_seed: int) -> Update:
    """Run the update in place on `learner` (every process runs this). Raises LearnError, having
    left the learner half-updated, when the result must not be committed."""
    lcfg, acc, model, opt = learner.cfg.learn, learner.acc, learner.model, learner.opt
    torch.manual_seed(torch_seed)
    batch = batch.to(learner.device)
    # the tokens this update trains on: the sampled ones, no older than learn.max_token_age
    batch, ages = within_age(batch, policy_version(iteration, 0), lcfg.max_token_age)
    check_microbatch_tokens(batch, lcfg, iteration)
    g, chunk = batch.group_size, max(1, lcfg.process_microbatch // batch.group_size)
    # whole groups are shuffled and split: a minibatch is minibatch_size / G prompts with all their samples
    n_groups, world, rank = len(batch.prompt_ids), acc.num_processes, acc.process_index
    per_step = lcfg.minibatch_size // g
    order = group_order(n_groups, batch.in_order, learner.shuffle).to(learner.device)  # epoch 0's
    t0 = time.perf_counter()
    with learner.autocast():
        pi_old = OldLogprobs(learner, batch, chunk, order[:per_step] if per_step <= n_groups else order[:0])
        scores = Scores(pi_old.old, learner.reference_scores(batch, chunk))
    score_s, update_s = time.perf_counter() - t0, 0.0
    mask = batch.loss_mask
    gap = pi_old.gap(iteration) if pi_old.known else None
    behavior = behavior_summary(batch, scores, learner.loss) if pi_old.known else None
    model.train()

    accum = max(1, lcfg.minibatch_size // world // lcfg.process_microbatch)
    rows, step, gkd = [], 0, []
    for epoch in range(lcfg.epochs):
        if epoch:
            order = group_order(n_groups, batch.in_order, learner.shuffle).to(learner.device)
        for start in range(0, n_groups - per_step + 1, per_step):
            groups = order[start : start + per_step]
            t0 = time.perf_counter()
            n_tok = int(mask[batch.rows(groups)].sum())  # the whole minibatch's trained tokens, every rank's
            microbatches = split_microbatches(batch, groups, lcfg, world)
            steps = accum if lcfg.microbatch_tokens is None else len(microbatches[rank])  # equal on every rank
            # DAPO's token mean of the minibatch: each microbatch's token sum / the minibatch's tokens per
            # microbatch, which the 1/steps scale and the ranks' gradient mean turn into / n_tok. Every rank
            # holds the whole batch, so each counts n_tok itself (verl all-reduces its global token count)
            per_microbatch = max(1, n_tok) / (steps * world)
            # the per-sequence modes likewise, where microbatches differ in size: a sequence weighs 1 / its rank's
            sequences = None if lcfg.microbatch_tokens is None else len(groups) * g / world / steps
            m = reduce_across_ranks(
                acc,
                minibatch_step(
                    model,
                    batch,
                    scores,
                    microbatches[rank],
                    learner.loss,
                    steps,
                    learner.autocast,
                    per_microbatch,
                    sequences,
                    pi_old,
                ),
            )
            if not pi_old.known:  # the first minibatch gave its rows: settle the rest, check the sampler's, then step
                settled_s = pi_old.settle()
                score_s, t0 = score_s + settled_s, t0 + settled_s  # scoring time, not the update's
                gap, behavior = pi_old.gap(iteration), behavior_summary(batch, scores, learner.loss)
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
            rows.append(_metric_row(run_id, iteration, step, epoch, m, grad_norm, lr, n_tok, gap))
            gkd += [m["loss/gkd"]] if "loss/gkd" in m else []
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
        **(behavior or {}),
        **ages,
        "old_logprobs": pi_old.source,
        "world_size": world,
        "precision": learner.precision,
        "kernels": kernels.chosen(lcfg.logprob_kernel, learner.device),
        "learner_path": learner.acc.unwrap_model(learner.model).path.record(),  # grpo/learner/paths.py
        "score_s": score_s,
        "update_s": update_s,
        "tokens": sum(r["n_tokens"] for r in rows),
    }
    if gkd:  # teacher.gkd_coef: the mean over the steps of GKD's top-k forward KL
        summary["gkd_kl"] = sum(gkd) / len(gkd)
    cpu = Scores(
        scores.old_logprobs.float().cpu(), None if scores.ref_logprobs is None else scores.ref_logprobs.float().cpu()
    )
    return Update(summary, rows, cpu)


def behavior_summary(batch: Batch, scores: Scores, spec: core.LossSpec) -> dict[str, float]:
    """The iteration's behaviour weights pi_prox / pi_sampler (learn.behavior_correction) over every trained token
    of the batch, once pi_prox (the old log-probs) is known: no step changes them. behavior_weight_mean and
    _max, behavior_clipped_frac (truncated or masked), sampler_kl (k3 of KL(pi_sampler || pi_prox)); with
    correction none the weights are 1 and the KL still measures how far the sampler was."""
    with torch.no_grad():
        _, m = core.behavior_weights(
            scores.old_logprobs.float(),
            batch.sampler_logprobs.float(),
            batch.loss_mask,
            *spec.behavior,
        )
    names = {"weight_mean": "behavior_weight_mean", "weight_max": "behavior_weight_max"}
    names |= {"clipped_frac": "behavior_clipped_frac", "kl": "sampler_kl"}
    return {names[k.split("/")[1]]: float(v) for k, v in m.items()}


def _check_weights(learner: Learner, batch: Batch, iteration: int, steps: int) -> None:
    """Never commit weights the sampler cannot sample from: every parameter finite, and (finite weights
    can still be huge: a huge lr) the first group's log-probs too."""
    lm = learner.acc.unwrap_model(learner.model)
    bad = [n for n, p in lm.named_parameters() if p.requires_grad and not bool(torch.isfinite(sharding.local(p)).all())]
    if learner.acc.num_processes > 1:  # each process sees its own shards: all of them decide together
        n_bad = learner.acc.reduce(torch.tensor(float(len(bad)), device=learner.device), "sum")
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
