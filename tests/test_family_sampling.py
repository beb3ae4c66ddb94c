"""The transformers sampler on every family's cache (KV, sliding window, conv, linear-attention and Mamba states):
each sampled log-prob is the model's own, teacher-forced over the prompt alone, and taken in float32."""

import importlib.util

import pytest
import torch
from families import build_family_model, text_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.sampling.base import SamplingSpec
from grpo.sampling.engines import close_generators, get_generator
from grpo.sampling.hf import HFGenerator

TEXTS = ["the quick brown fox jumps over the lazy dog " * 3, "sort 3 1 2 -> 1 2 3", "hello world, how are you?"]
PROMPTS = ["the quick brown fox jumps", "sort 3 1 2 -> 1", "hello world, how are you? the lazy dog jumps over the fox"]
BUDGET = 8  # with the shortest prompt, past the families' sliding window (tests/families.py WINDOW = 4)


def sample_without_stops(model_dir: str, dtype: str = "float32") -> tuple[HFGenerator, list[list[int]], list]:
    """Three prompts of unequal length (left-padded in one batch), two samples each, every sample BUDGET tokens:
    the generator's stop ids emptied, so no sample ends early however the random model samples."""
    gen = HFGenerator(model_dir, dtype=dtype)
    gen.eos = gen.eos[:0]
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    assert len({len(p) for p in prompts}) == 3
    out = gen.generate(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=BUDGET, seed=1))
    assert all(len(s.response_ids) == BUDGET for g in out for s in g)
    return gen, prompts, out


def teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """(T,) float32 log-probs of `response` after `prompt` alone (no padding), in one forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return logits.float().log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.mark.parametrize("family", text_families())
def test_sampled_logprobs_are_the_models_own_on_every_cache_kind(family, tmp_path):
    """Left-padded prompts decoded from a cache repeated for each prompt's samples: each sample's log-probs equal one
    forward of its prompt alone and its tokens (float32), for every layer kind's state."""
    model_dir = build_family_model(str(tmp_path / family), family, TEXTS)
    gen, prompts, out = sample_without_stops(model_dir)
    for p, group in zip(prompts, out):
        for s in group:
            assert s.logprobs == pytest.approx(teacher_forced(gen.model, p, s.response_ids).tolist(), abs=1e-5)


def test_bf16_models_logprobs_are_taken_in_float32(tmp_path):
    """A bf16 model's logits go through log_softmax in float32: the log-probs are float32 numbers (a bf16 log_softmax
    gives only values bf16 holds, 2^-5 apart near -5) and equal the float32 log_softmax of the same logits."""
    model_dir = build_family_model(str(tmp_path / "qwen3"), "qwen3", TEXTS, dtype="bfloat16")
    gen, prompts, out = sample_without_stops(model_dir, dtype="bfloat16")
    assert gen.model.dtype == torch.bfloat16
    got = torch.tensor([lp for g in out for s in g for lp in s.logprobs])  # float32 from the sampler's lists
    assert (got.bfloat16().float() != got).float().mean() > 0.9  # not bf16 values
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    for p, group in zip(prompts, out):
        for s in group:  # bf16 activations differ between a cached decode and one forward by ~1e-2 at most here
            assert s.logprobs == pytest.approx(teacher_forced(model, p, s.response_ids).tolist(), abs=0.05)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_takes_a_bf16_models_logprobs_in_float32(tmp_path):
    """vLLM's sampled log-probs of a bf16 model (logprobs_mode raw_logprobs) are float32 numbers, as the transformers
    sampler's: newer vLLM releases that stopped upcasting the logits first (vLLM PR #48641) would give bf16 values."""
    model_dir = build_family_model(str(tmp_path / "qwen3"), "qwen3", TEXTS, dtype="bfloat16")
    tok = AutoTokenizer.from_pretrained(model_dir)
    gen = get_generator("vllm", model_dir, dtype="bfloat16", max_model_len=64, enforce_eager=True)
    try:
        out = gen.generate([tok(p)["input_ids"] for p in PROMPTS], SamplingSpec(n=2, max_tokens=BUDGET, seed=1))
    finally:
        close_generators()
    got = torch.tensor([lp for g in out for s in g for lp in s.logprobs])
    assert gen.logprobs_dtype == "float32" and len(got) >= 6
    assert (got.bfloat16().float() != got).float().mean() > 0.9  # not bf16 values
