"""Where pi_old comes from (learn.old_logprobs: a registry keyed by name): the sampler's log-probs, a scoring pass
of the learner before its first step, or `auto`, the first minibatch's own forward deciding between the two;
`OldLogprobs`, one update's pi_old from the start to every row known; and the sampler-to-learner gap the stage
records and may bound."""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from grpo import core
from grpo.errors import LearnError
from grpo.learner.batch import Batch
from grpo.learner.model import score
from grpo.learner.state import Learner


class PiOld(NamedTuple):
    """What an OLD_LOGPROBS function gives before the first step."""

    old: Tensor  # (N, T) the old log-probs known so far
    pending: Tensor | None  # (N,) rows the first minibatch's forward fills (OldLogprobs.take)
    deferred: Tensor | None  # (N,) rows settled after that forward (OldLogprobs.settle)
    source: dict | None  # the learn manifest's `old_logprobs`; None: OldLogprobs.settle says


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
    """No pass yet: the first minibatch's forward gives its rows, and the rest wait for OldLogprobs.settle;
    recompute's pass where that forward is not the scoring one (dropout on)."""
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


class OldLogprobs:
    """One update's pi_old (N, T), from what learn.old_logprobs gives before the first step to every row known.

    Rows can be left to the first minibatch's own forward (pending: the weights are still the snapshot's then, so
    its log-probs are pi_old, no scoring pass) and, with `auto`, to be settled after that forward and before its
    step (deferred: the sampler's log-probs where the pending rows show them equal to the learner's, else scored).
    `train` asks it which microbatches give their rows (gives), hands them over (take), and settles the rest once
    the first minibatch's forward and backward are done (settle)."""

    def __init__(self, learner: Learner, batch: Batch, chunk_groups: int, first: Tensor):
        """`first` (P',): the groups of the first minibatch."""
        self.learner, self.batch, self.chunk_groups = learner, batch, chunk_groups
        mode = learner.cfg.learn.old_logprobs
        self.old, self.pending, self.deferred, self.source = OLD_LOGPROBS[mode](learner, batch, chunk_groups, first)
        self.measured: Tensor | None = None  # (N,) rows where pi_old is the learner's own; None: all

    @property
    def known(self) -> bool:
        """Every row's old log-prob is known: the gap, the behaviour weights and a step may go on."""
        return self.pending is None

    def gives(self, microbatches: list[Tensor]) -> list[bool]:
        """For each microbatch (a tensor of groups) whether its forward gives its rows' pi_old; read on the host
        once a step, not a microbatch."""
        if self.pending is None:
            return [False] * len(microbatches)
        rows = self.pending.cpu()
        return [bool(rows[self.batch.rows(mb.cpu())].all()) for mb in microbatches]

    def take(self, rows: Tensor, logp: Tensor) -> None:
        """The log-probs (R, T) of `rows` (R,) from a forward before any step: their pi_old."""
        self.old[rows] = logp.detach().to(self.old.dtype)

    def settle(self) -> float:
        """After the first minibatch's forward and backward, before its step: every process's pending rows on every
        process, then the deferred rows settled (the sampler's log-probs when the pending rows match them within
        SAMPLER_MAX_DIFF, else scored now). Returns the seconds spent scoring."""
        checked, acc, batch = self.pending, self.learner.acc, self.batch
        if acc.num_processes > 1:  # each process filled its own groups' rows; the others are still 0 there
            self.old[checked] = acc.reduce(self.old[checked], "sum")
        self.pending = None
        if self.deferred is None:
            return 0.0
        t0 = time.perf_counter()
        gaps = (batch.sampler_logprobs - self.old).abs().masked_fill(~batch.loss_mask.bool(), 0.0)  # (N, T)
        diff = float(gaps[checked].max())
        if diff <= SAMPLER_MAX_DIFF:
            self.old[self.deferred] = batch.sampler_logprobs[self.deferred].to(self.old.dtype)
            self.measured = checked  # the sampler's rows have no gap to measure
        else:
            with self.learner.autocast():
                _score_rows(self.learner, batch, self.chunk_groups, self.deferred, self.old)
            self.learner.model.train()  # score() left it in eval mode
        self.source = {"source": "sampler" if self.measured is not None else "recomputed", "max_diff": diff}
        self.deferred = None
        return time.perf_counter() - t0

    def gap(self, iteration: int) -> float:
        """sampler_gap where pi_old is the learner's own, bounded by learn.max_logprob_gap."""
        max_gap = self.learner.cfg.learn.max_logprob_gap
        return sampler_gap(self.batch, self.old, iteration, max_gap, self.measured)


def sampler_gap(batch: Batch, old: Tensor, iteration: int, max_gap: float | None, rows: Tensor | None = None) -> float:
    """Mean |sampler log-prob - old log-prob (N, T)| a sampled token (over `rows` (N,) bool, default all: where
    pi_old is the learner's own); raises LearnError above learn.max_logprob_gap."""
    mask = batch.loss_mask if rows is None else batch.loss_mask * rows[:, None]
    gap = float(core.masked_mean((batch.sampler_logprobs - old).abs(), mask))
    if max_gap is not None and gap > max_gap:
        raise LearnError(
            f"learn iteration {iteration}: the sampler's log-probs differ from the snapshot's by "
            f"{gap:.4g} a token on average (> learn.max_logprob_gap={max_gap}): the sampler "
            "may have served other weights; nothing committed. Rerun rollouts (--force)"
        )
    return gap
