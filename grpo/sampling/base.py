"""What every sampling backend takes and gives: the Generator protocol, SamplingSpec, Sample, and the token
helpers the stages share (stop ids, pad id, decoding responses)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol


@dataclass(frozen=True)
class SamplingSpec:
    n: int = 1
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    seed: int = 0


@dataclass(frozen=True)
class Sample:
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]


class Generator(Protocol):
    model_dir: str
    adapter_dir: str | None
    logprobs_dtype: str  # what the sampled tokens' log-probs are computed in (the rollouts manifest's `sampler`)

    def generate(
        self,
        prompts: list[list[int]],
        spec: SamplingSpec,
        budgets: list[int] | None = None,
        progress=None,
        seeds: list[int] | None = None,
    ) -> list[list[Sample]]:
        """prompts: token ids (bos included) -> per prompt, spec.n samples of at most its budget
        (default spec.max_tokens) tokens; every eos id of the checkpoint (`stop_token_ids`) stops.
        progress: called with the number of prompts whose samples have all ended, as they end; it sees
        the sampling, never changes it. seeds: one per prompt, its samples' random numbers drawn from it alone
        (sample j's from seed + j), whatever else the call samples (an episode's turn: grpo/episodes/loop.py);
        None: every random number of the call drawn from spec.seed, as single-turn rollouts always did."""
        ...

    def load_weights(self, model_dir: str) -> None:
        """Swap in the weights of `model_dir`, a checkpoint of the same architecture (dropping adapters)."""
        ...

    def load_adapter(self, adapter_dir: str | None) -> None:
        """Sample with the LoRA adapters of `adapter_dir` (peft's files) on the loaded weights; None:
        the weights alone. Adapters of one run share their shapes: no engine restart, no weight reload."""
        ...

    def sleep(self) -> bool:
        """Free the accelerator for the learner; True when the generator stays usable (it wakes on its
        next use), False when it must be closed instead."""
        ...

    def wake(self) -> None: ...

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (vLLM's prefix cache; a no-op where there is none), so what a call
        reuses depends on the calls since, never on an earlier stage of the process."""
        ...

    def close(self) -> None: ...


def _generation_config_eos(model_dir: str) -> list[int]:
    path = Path(model_dir, "generation_config.json")
    eos = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def stop_token_ids(tokenizer, model_dir: str) -> tuple[int, ...]:
    """Every eos id of a checkpoint: the tokenizer's and generation_config.json's (Qwen2.5 lists
    `[<|im_end|>, <|endoftext|>]`). Either backend stops on each and strips it from the text."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []) + _generation_config_eos(model_dir)
    if not ids:
        raise ValueError(f"{model_dir}: no eos token in the tokenizer or generation_config.json")
    return tuple(dict.fromkeys(ids))


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, or its eos id when it has none (padding is masked out anyway)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def decode_responses(tokenizer, rows: list[list[int]], eos_ids: tuple[int, ...] | None = None) -> list[str]:
    """Each response's text: the eos that ended it dropped (any of `eos_ids`, default the
    tokenizer's), other special tokens kept.

    Keeping a sampled `<pad>` or `<bos>` visible means the reward sees it (it is
    not an exact answer), instead of a decode that silently hides it. A fast
    tokenizer without clean-up decodes through its `tokenizers` object: the same
    text without transformers' per-call argument handling (3x the decode itself).
    """
    eos = set(eos_ids or [tokenizer.eos_token_id])
    rows = [ids[:-1] if ids and ids[-1] in eos else ids for ids in rows]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decode = tokenizer.decode if backend is None or tokenizer.clean_up_tokenization_spaces else backend.decode
    return [decode(ids, skip_special_tokens=False) for ids in rows]
