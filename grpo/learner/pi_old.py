"""Where pi_old comes from (learn.old_logprobs: a registry keyed by name): the sampler's log-probs, a scoring pass
of the learner before its first step, or `auto`, the first minibatch's own forward deciding between the two;
and the sampler-to-learner gap the stage records and may bound."""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from grpo import core
from grpo.errors import LearnError
from grpo.learner.batch import Batch, Scores
from grpo.learner.model import score
from grpo.learner.state import Learner


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
