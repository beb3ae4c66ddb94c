"""TRL's rollout_func (rollout.rollout_func): a user's function makes each chunk's samples, given the chunk's prompts
and the stage's sampler, `fn(prompts, sampler) -> {"prompt_ids", "completion_ids", "logprobs"[, "env_mask"]}`, as
GRPOTrainer calls `rollout_func(prompts, trainer)`. What it returns is checked whole before a row is written: the
count (num_generations completions a prompt, in prompt order), every list's length against its completion's, token
ids in the vocabulary, log-probs finite and <= 0, masks of 0 and 1; anything else is one line naming the function.
The stage writes what it returned token for token (its prompt ids included): nothing is decoded and encoded again.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable

from grpo.errors import StageError, one_line
from grpo.sampling.base import Generator, Sample, SamplingSpec
from grpo.tasks.functions import ROLLOUT_FUNC_PREFIX

PREFIX = ROLLOUT_FUNC_PREFIX  # where the base commit keeps the function's file
"""Where a run's base commit keeps the copy of the file rollout.rollout_func names."""
KEYS = ("prompt_ids", "completion_ids", "logprobs")
"""What a rollout function must return (TRL's names)."""
OPTIONAL = ("env_mask", "finish_reason")
"""What it may return beside them: TRL's env_mask (the loss mask), and RolloutSampler.generate's finish_reason."""


@dataclasses.dataclass(frozen=True)
class RolloutSample(Sample):
    """A sample a rollout function made: its own prompt ids, and its loss mask (env_mask; all 1 without one)."""

    prompt_ids: list[int]
    loss_mask: list[int]


class RolloutSampler:
    """What a rollout function gets as its second argument, where TRL passes its trainer: the stage's sampler (the
    snapshot policy, on vLLM or HF), its tokenizer and sampling settings under TRL's names."""

    def __init__(self, gen: Generator, tokenizer, spec: SamplingSpec):
        self.gen, self.spec = gen, spec
        self.processing_class = tokenizer
        self.num_generations = spec.n
        self.max_completion_length = spec.max_tokens
        self.temperature = spec.temperature

    def generate(self, prompt_ids: list[list[int]], n: int | None = None, max_tokens: int | None = None) -> dict:
        """`n` (default num_generations) samples of each prompt (token ids), seeded by the stage: TRL's keys, one
        entry a completion, in prompt order, and each one's finish_reason ("stop": it ended on an eos id)."""
        spec = dataclasses.replace(self.spec, n=n or self.spec.n, max_tokens=max_tokens or self.spec.max_tokens)
        groups = self.gen.generate([list(ids) for ids in prompt_ids], spec)
        flat = [(ids, s) for ids, group in zip(prompt_ids, groups) for s in group]
        return {
            "prompt_ids": [list(ids) for ids, _ in flat],
            "completion_ids": [s.response_ids for _, s in flat],
            "logprobs": [s.logprobs for _, s in flat],
            "finish_reason": [s.finish_reason for _, s in flat],
        }


class RolloutFunction:
    """A rollout function as the stage calls it on each chunk: its samples, grouped by prompt, checked."""

    def __init__(self, fn: Callable, spec_text: str, vocab_size: int, eos_ids: tuple[int, ...]):
        self.fn, self.name, self.vocab_size, self.eos_ids = fn, spec_text, vocab_size, eos_ids

    def __call__(
        self, gen: Generator, tokenizer, prompts: list[str], spec: SamplingSpec, context: int
    ) -> list[list[RolloutSample]]:
        """`prompts`' samples, spec.n a prompt, grouped; `context`: the model's positions, prompt and response."""
        try:
            out = self.fn(list(prompts), RolloutSampler(gen, tokenizer, spec))
        except Exception as e:  # noqa: BLE001 (whatever the user's function raises)
            raise StageError(f"rollout.rollout_func {self.name} raised {one_line(e)}") from e
        samples = self.checked(out, len(prompts), spec.n, spec.max_tokens)
        for i, s in enumerate(samples):
            if s.prompt_ids != samples[i - i % spec.n].prompt_ids:
                raise self.refuse(
                    f"completion {i}: prompt_ids differ from its group's first (prompt {i // spec.n}): the learner "
                    "scores each prompt once for its whole group"
                )
            if context and len(s.prompt_ids) + len(s.response_ids) > context:
                n = len(s.prompt_ids) + len(s.response_ids)
                raise self.refuse(f"completion {i}: prompt and completion are {n} tokens, the model has {context}")
        return [samples[i * spec.n : (i + 1) * spec.n] for i in range(len(prompts))]

    def refuse(self, why: str) -> StageError:
        return StageError(f"rollout.rollout_func {self.name}: {why}; nothing was written")

    def checked(self, out, prompts: int, n: int, max_tokens: int) -> list[RolloutSample]:
        """`out` as samples, or one line saying what in it is wrong."""
        if not isinstance(out, dict) or (missing := [k for k in KEYS if k not in out]):
            got = sorted(out) if isinstance(out, dict) else type(out).__name__
            raise self.refuse(f"returned {got}, not a dict with TRL's keys {', '.join(KEYS)} (missing {missing})")
        if extra := sorted(set(out) - set(KEYS) - set(OPTIONAL)):
            raise self.refuse(f"returned keys {extra} this stage does not take (it takes {', '.join(KEYS + OPTIONAL)})")
        want = prompts * n
        for key in [k for k in KEYS + OPTIONAL if k in out]:
            if not isinstance(out[key], (list, tuple)) or len(out[key]) != want:
                got = len(out[key]) if isinstance(out[key], (list, tuple)) else type(out[key]).__name__
                raise self.refuse(
                    f"{key} has {got} entries, not {want} ({prompts} prompts x num_generations {n}, in prompt order)"
                )
        return [self.sample(out, i, n, max_tokens) for i in range(want)]

    def sample(self, out: dict, i: int, n: int, max_tokens: int) -> RolloutSample:
        """Completion i of `out`, checked."""
        where = f"completion {i} (prompt {i // n}, sample {i % n})"
        ids, prompt_ids, logprobs = list(out["completion_ids"][i]), list(out["prompt_ids"][i]), list(out["logprobs"][i])
        for key, tokens in (("completion_ids", ids), ("prompt_ids", prompt_ids)):
            if not tokens or not all(isinstance(t, numbers.Integral) and 0 <= t < self.vocab_size for t in tokens):
                raise self.refuse(f"{where}: {key} must be a non-empty list of token ids in [0, {self.vocab_size})")
        if len(ids) > max_tokens:
            raise self.refuse(f"{where}: {len(ids)} completion tokens, more than rollout.max_tokens={max_tokens}")
        if len(logprobs) != len(ids) or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in logprobs):
            raise self.refuse(f"{where}: logprobs must be {len(ids)} finite numbers, one a completion token")
        if any(x > 1e-6 for x in logprobs):
            above = f"a log-probability above 0 ({max(logprobs):.4g})"
            raise self.refuse(f"{where}: {above}; logprobs are the sampler's log-probabilities, each <= 0")
        mask = list(out["env_mask"][i]) if "env_mask" in out else [1] * len(ids)
        if len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
            raise self.refuse(f"{where}: env_mask must be {len(ids)} values of 0 or 1, one a completion token")
        finish = "stop" if ids[-1] in self.eos_ids else "length"
        ids, prompt_ids = [int(t) for t in ids], [int(t) for t in prompt_ids]
        return RolloutSample(ids, [float(x) for x in logprobs], finish, prompt_ids, [int(m) for m in mask])
