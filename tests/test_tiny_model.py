"""Tiny model factory: tokenizer, seeded weights, loading with transformers and vllm."""

import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.tasks import get_task
from grpo.tiny_model import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    build_for_task,
    build_tiny_model,
    build_tokenizer,
)

REPO = Path(__file__).resolve().parents[1]
WORDS = get_task("sort").words()


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def sort_model(tmp_path_factory) -> str:
    return build_for_task(str(tmp_path_factory.mktemp("sort_model")), "sort")


@pytest.mark.parametrize("name", ["sort", "arithmetic"])
def test_tokenizer_round_trip(name):
    task = get_task(name)
    tok = build_tokenizer(task.words())
    for ex in task.generate(20, seed=0):
        for text in (ex.prompt, ex.ground_truth, ex.prompt + " " + ex.ground_truth):
            ids = tok.encode(text)
            assert ids[0] == BOS_ID and UNK_ID not in ids
            assert len(ids) == len(text.split()) + 1  # one id per word
            assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_special_ids_and_unknown_words():
    tok = build_tokenizer(["a", "b", "a"])  # duplicates keep their first id
    tokens = ["<pad>", "<unk>", "<bos>", "<eos>", "a", "b"]
    assert tok.convert_tokens_to_ids(tokens) == [0, 1, 2, 3, 4, 5]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert tok.encode("a  zzz\tb") == [BOS_ID, 4, UNK_ID, 5]
    assert len(tok) == 6


def test_decode_responses_drops_the_final_eos_and_keeps_other_specials(sort_model):
    import random

    from grpo.sampling.base import decode_responses

    tok = AutoTokenizer.from_pretrained(sort_model)
    rng = random.Random(0)
    rows = [[rng.randrange(len(tok)) for _ in range(rng.randint(0, 6))] for _ in range(300)]
    rows += [[EOS_ID], [4, EOS_ID], [EOS_ID, 4, EOS_ID], [PAD_ID, BOS_ID, UNK_ID]]
    expected = [tok.decode(r[:-1] if r and r[-1] == EOS_ID else r, skip_special_tokens=False) for r in rows]
    assert decode_responses(tok, rows) == expected
    assert decode_responses(tok, [[EOS_ID, 4, EOS_ID], [PAD_ID, 4]]) == ["<eos> sort", "<pad> sort"]


def test_tokenizer_rejects_words_with_spaces():
    with pytest.raises(ValueError, match="whitespace"):
        build_tokenizer(["a b"])


def test_saved_tokenizer_loads_with_auto(sort_model):
    tok = AutoTokenizer.from_pretrained(sort_model)
    assert tok.encode("sort 3 1 :") == build_tokenizer(WORDS).encode("sort 3 1 :")
    assert tok("sort 3 1 :")["input_ids"][0] == BOS_ID
    assert tok.decode(tok.encode("sort 3 1 :"), skip_special_tokens=True) == "sort 3 1 :"


def test_model_loads_and_generates(sort_model):
    for name in ("config.json", "generation_config.json"):
        c = json.loads(Path(sort_model, name).read_text())
        assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (BOS_ID, EOS_ID, PAD_ID)
    assert json.loads(Path(sort_model, "config.json").read_text())["vocab_size"] == len(WORDS) + 4
    model = AutoModelForCausalLM.from_pretrained(sort_model)
    assert model.dtype == torch.float32
    ids = torch.tensor([AutoTokenizer.from_pretrained(sort_model).encode("sort 3 1 4 1 5 :")])
    torch.manual_seed(0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=True)
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + 4
    assert torch.equal(out[0, : ids.shape[1]], ids[0])


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = build_tiny_model(str(tmp_path / "a"), WORDS, seed=3)
    b = build_tiny_model(str(tmp_path / "b"), WORDS, seed=3)
    c = build_tiny_model(str(tmp_path / "c"), WORDS, seed=4)
    weights = [os.path.join(d, "model.safetensors") for d in (a, b, c)]
    assert sha256(weights[0]) == sha256(weights[1])
    assert sha256(weights[0]) != sha256(weights[2])


@pytest.mark.parametrize("hidden_size, num_heads", [(128, 8), (96, 2), (100, 3)])
def test_unsupported_head_dim_is_rejected(tmp_path, hidden_size, num_heads):
    # 16 is too small, 48 and 33.3 are not head sizes vllm's cpu backend has
    with pytest.raises(ValueError, match="num_heads"):
        build_tiny_model(str(tmp_path / "m"), WORDS, hidden_size=hidden_size, num_heads=num_heads)
    assert not (tmp_path / "m").exists()


def test_unknown_arch_lists_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="valid archs: llama"):
        build_tiny_model(str(tmp_path / "m"), WORDS, arch="gpt5")


def test_build_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(str(tmp_path / "m"), WORDS, seed=0)
    assert torch.equal(torch.rand(3), expected)


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
@pytest.mark.slow
def test_weight_reload_samples_like_a_fresh_generator(tmp_path, backend):
    """A warm generator that reloads checkpoint B in place samples exactly what one started on B does."""
    from grpo.sampling.base import SamplingSpec
    from grpo.sampling.engines import close_generators, get_generator

    a, b = (build_for_task(str(tmp_path / name), "sort", seed=seed) for name, seed in (("a", 0), ("b", 1)))
    tok = AutoTokenizer.from_pretrained(a)
    prompts = [tok(e.prompt)["input_ids"] for e in get_task("sort").generate(8, seed=0)]
    spec = SamplingSpec(n=4, max_tokens=8, seed=3)
    try:
        warm = get_generator(backend, a)
        warm.generate(prompts, spec)
        records, handler = [], logging.Handler()
        handler.emit = records.append
        logging.getLogger("vllm").addHandler(handler)
        try:
            assert get_generator(backend, b) is warm  # same architecture: reloaded, not restarted
        finally:
            logging.getLogger("vllm").removeHandler(handler)
        assert [r.getMessage() for r in records] == []  # a warm run reloads every iteration: no log lines
        reloaded = warm.generate(prompts, spec)
        close_generators()
        fresh = get_generator(backend, b).generate(prompts, spec)
    finally:
        close_generators()
    for r, f in zip((s for g in reloaded for s in g), (s for g in fresh for s in g)):
        assert r.response_ids == f.response_ids
        assert r.logprobs == pytest.approx(f.logprobs, abs=1e-5)


def test_initializer_range_sets_the_init_std(tmp_path):
    from safetensors.torch import load_file

    for std in (0.02, 0.05):
        path = build_tiny_model(str(tmp_path / str(std)), WORDS, initializer_range=std)
        weights = load_file(f"{path}/model.safetensors")
        for name, w in weights.items():
            if w.dim() == 2:  # every matrix and the (tied) embedding; norms start at 1
                assert w.std().item() == pytest.approx(std, rel=0.1), name
