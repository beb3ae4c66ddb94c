"""The transformers backend's KV-cache decoding: agrees with `generate`, log-probs, stops, top-p."""

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.sampling.base import SamplingSpec
from grpo.sampling.engines import close_generators, get_generator
from grpo.sampling.hf import HFGenerator, sample_token
from grpo.tasks import get_task
from grpo.tiny_model import EOS_ID, build_for_task


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_for_task(
        str(tmp_path_factory.mktemp("arith")), "arithmetic", hidden_size=64, num_heads=2, intermediate_size=128, seed=3
    )


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok(e.prompt)["input_ids"] for e in get_task("arithmetic").generate(12, seed=0)]
    return [p[: len(p) - i % 4] for i, p in enumerate(ids)]  # different lengths: batches are left-padded


def test_greedy_matches_transformers_generate(model_dir, prompts):
    gen = HFGenerator(model_dir, batch_size=5)  # several batches, padded differently
    ours = gen.generate(prompts, SamplingSpec(n=2, temperature=0.0, max_tokens=6))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for p, group in zip(prompts, ours):
        ids = torch.tensor([p])
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=EOS_ID,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        if EOS_ID in ref:
            ref = ref[: ref.index(EOS_ID) + 1]
        assert [s.response_ids for s in group] == [ref, ref]
        assert group[0].finish_reason == ("stop" if ref[-1] == EOS_ID else "length")


def test_logprobs_are_the_raw_model_distribution(model_dir, prompts):
    spec = SamplingSpec(n=3, temperature=1.7, top_p=0.9, max_tokens=6, seed=5)
    out = HFGenerator(model_dir).generate(prompts, spec)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for p, group in zip(prompts, out):
        for s in group:
            assert len(s.logprobs) == len(s.response_ids) >= 1
            assert (s.finish_reason == "stop") == (s.response_ids[-1] == EOS_ID)
            ids = torch.tensor([p + s.response_ids])
            logp = model(input_ids=ids).logits[0, len(p) - 1 : -1].log_softmax(-1)  # no temperature, no top-p
            want = logp.gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
            assert s.logprobs == pytest.approx(want.tolist(), abs=1e-5)
    again = HFGenerator(model_dir).generate(prompts, spec)  # same seed, same samples
    assert [[s.response_ids for s in g] for g in again] == [[s.response_ids for s in g] for g in out]


@pytest.mark.parametrize(
    "backend",
    [
        "hf",
        pytest.param(
            "vllm",
            marks=[
                pytest.mark.vllm,
                pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
            ],
        ),
    ],
)
def test_stop_string_ends_the_response(model_dir, prompts, backend):
    """Same seed with and without a stop string: the same samples, cut where the string appears."""
    gen = get_generator(backend, model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    try:
        free = gen.generate(prompts, SamplingSpec(n=4, max_tokens=6, seed=1))
        words = [w for g in free for s in g for w in tok.decode(s.response_ids).split() if w != "<eos>"]
        stop = max(set(words), key=words.count)
        out = gen.generate(prompts, SamplingSpec(n=4, max_tokens=6, seed=1, stop=(stop,)))
    finally:
        close_generators()
    hit = 0
    for a, b in zip((s for g in free for s in g), (s for g in out for s in g)):
        if stop in tok.decode(a.response_ids):
            hit += 1
            assert b.finish_reason == "stop" and stop in tok.decode(b.response_ids)
            assert stop not in tok.decode(b.response_ids[:-1])  # cut where it first appeared
            assert b.response_ids == a.response_ids[: len(b.response_ids)]
        else:
            assert b.response_ids == a.response_ids
    assert hit


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    rng = torch.Generator().manual_seed(0)
    counts = torch.bincount(sample_token(logits, 0.7, rng), minlength=4)  # 0.5 + 0.3 reach 0.7
    assert counts[2:].sum() == 0
    assert counts[0] / counts[:2].sum() == pytest.approx(0.5 / 0.8, abs=0.03)
    assert (sample_token(logits, 0.1, rng) == 0).all()
    counts = torch.bincount(sample_token(logits, 1.0, rng), minlength=4)
    assert (counts / 4000).tolist() == pytest.approx([0.5, 0.3, 0.15, 0.05], abs=0.03)


HEAP_PROBE = """
import ctypes
from grpo.sampling.vllm_engine import _return_freed_heap
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20  # MiB resident
libc, blocks = ctypes.CDLL(None), []
libc.malloc.restype = libc.realloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.realloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.free(libc.malloc(4 << 20))  # an mmapped block freed: glibc raises its mmap threshold past 4 MiB
for _ in range(100):  # so these 3 MiB blocks come from the heap
    blocks.append(libc.malloc(3 << 20))
    ctypes.memset(blocks[-1], 1, 3 << 20)
for block in blocks:  # each shrunk in place to its first 64 bytes: ~3 MiB free mid-heap between them
    assert libc.realloc(block, 64) == block
before = rss()
_return_freed_heap()
print(before, rss())
"""


def test_freed_heap_goes_back_to_the_os_after_an_engine_call():
    """What an in-process vLLM engine's steps free mid-heap stays resident under glibc's dynamic mmap
    threshold; `_return_freed_heap` (called after each VLLMGenerator.generate) hands it back."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True, check=True).stdout
    before, after = map(int, out.split())
    assert before - after > 200, (before, after)  # of the 300 MiB freed
