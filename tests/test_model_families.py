"""The learner's paths on every model family (tests/families.py: tiny random configs from transformers' own classes):
each path a family takes gives the log-probs and gradients of each sequence computed alone, with no padding; each
path it cannot take is refused by the decision (grpo/learner/paths.py), and forcing the one path the decision
refuses for recurrent layers (packed) is seen mixing responses, so the comparison would catch such a leak.

The batch: 2 prompts left-padded unequally (6 and 3 tokens), 3 responses each of unequal length (7, 2, 5 and 3,
6, 1: packing puts 6 responses in 4 rows), longer than the families' sliding window (4), so a mask that forgets
the window, a state that runs from one response into the next, or a padding column seen, each changes a log-prob.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from grpo.learner import paths
from grpo.learner.model import PolicyLM
from tests.families import FAMILIES, family_config, text_families

PATHS = ("packed", "shared_prompt", "full_sequences")
PROMPTS, RESPONSES, VOCAB = (6, 3), ((7, 2, 5), (3, 6, 1)), 64
# float32: the paths sum in another order than a sequence alone, to rounding (~1e-7 relative); 1e-5 as stated.
# bf16 (autocast, as learn.mixed_precision runs it): each matmul's output rounds to 8 bits (relative 2^-9), and a
# path's shapes (batch, packed rows, cache) round each token otherwise than the sequence alone. The tiny random
# models' logits are small (|logit| ~ 0.1), so a log-prob moves by ~1e-3 at most (measured: 0.001 on Qwen3.5's
# shared prompt, the rest under 3e-4), and a gradient by up to 1.8% of its parameter's largest entry (Qwen2
# packed); bounds 0.01 and 5%, with room for another CPU's bf16 (AVX512-BF16) rounding. A leak moves log-probs by
# 7e-5 (Falcon-H1) to 0.05 (Granite 4) in float32, where the 1e-5 bound sees it.
F32 = dict(logprobs=1e-5, grads=1e-5)
BF16 = dict(logprobs=0.01, grads=0.05)


# logits the model's forward scales (1 in these configs by default): the learner's head must scale them too
LOGIT_SCALES = {"granite4_hybrid": {"logits_scaling": 4.0}, "falcon_h1": {"lm_head_multiplier": 2.0}}


@functools.cache
def _model(family: str):
    from transformers import AutoModelForCausalLM

    config = family_config(family, VOCAB, eos=1, pad=0)
    for field, value in LOGIT_SCALES.get(family, {}).items():
        setattr(config, field, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).eval()


def _batch():
    """prompt_ids, prompt_mask (2, 6) left-padded; response_ids, response_mask (6, 7) right-padded; weights (6, 7)."""
    g = torch.Generator().manual_seed(1)
    lp, t = max(PROMPTS), max(max(r) for r in RESPONSES)
    prompt_ids = torch.zeros(len(PROMPTS), lp, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for i, n in enumerate(PROMPTS):
        prompt_ids[i, lp - n :], prompt_mask[i, lp - n :] = torch.randint(2, VOCAB, (n,), generator=g), 1
    lengths = [n for group in RESPONSES for n in group]
    response_ids, response_mask = torch.zeros(len(lengths), t, dtype=torch.long), torch.zeros(len(lengths), t)
    for i, n in enumerate(lengths):
        response_ids[i, :n], response_mask[i, :n] = torch.randint(2, VOCAB, (n,), generator=g), 1
    weights = torch.randn(len(lengths), t, generator=g) * response_mask  # a loss that weighs each token otherwise
    return prompt_ids, prompt_mask, response_ids, response_mask, weights


def _grads(lm) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
    lm.zero_grad(set_to_none=True)
    return grads


def _alone(lm, batch, dtype):
    """Log-probs (N, T) of each response computed alone (its prompt's real tokens + its own, one row, no mask), and
    the gradients of sum(weights * log-probs) over them."""
    prompt_ids, prompt_mask, response_ids, response_mask, weights = batch
    g = len(response_ids) // len(prompt_ids)
    logp = torch.zeros(response_ids.shape)
    for i, n in enumerate(response_mask.sum(1).long().tolist()):
        prompt = prompt_ids[i // g][prompt_mask[i // g].bool()]
        ids = torch.cat([prompt, response_ids[i, :n]])[None]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = lm(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        row = logits.log_softmax(-1).gather(1, response_ids[i, :n, None])[:, 0]
        (row * weights[i, :n]).sum().backward()
        logp[i, :n] = row.detach()
    return logp, _grads(lm)


def _on_path(lm, batch, dtype, path: str):
    """Log-probs (N, T) of PolicyLM's training forward made to take `path` (full_sequences: as the learner runs it,
    with gradient checkpointing), and the gradients of the same loss."""
    prompt_ids, prompt_mask, response_ids, response_mask, weights = batch
    checkpointing = path == "full_sequences"
    if checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = PolicyLM(lm, padding_free=True, full_sequences_in_training=checkpointing).train()
    if not checkpointing:
        policy.path = dataclasses.replace(policy.path, train=path, score=path)
    assert policy.path.train == path
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logp, _ = policy(prompt_ids, prompt_mask, response_ids, response_mask)
        (logp.float() * weights).sum().backward()
    finally:
        lm.gradient_checkpointing_disable()
        lm.eval()
    return logp.detach().float() * response_mask, _grads(lm)


def _close(got, want, bound: float, what: str):
    """Log-probs within bound; gradients within bound of their largest entry (each parameter's)."""
    if isinstance(got, dict):
        assert got.keys() == want.keys(), what
        for name in want:
            scale = 1.0 if bound < 1e-3 else float(want[name].abs().max()) + 1e-6
            torch.testing.assert_close(got[name], want[name], atol=bound * scale, rtol=1e-4, msg=f"{what}: {name}")
    else:
        torch.testing.assert_close(got, want, atol=bound, rtol=0, msg=what)


def _takes(decided: paths.LearnerPath) -> set[str]:
    """The paths a model with this decision may run: its own and every slower one."""
    return set(PATHS[PATHS.index(decided.score) :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("family", text_families())
def test_each_path_a_family_takes_gives_each_sequence_alone_and_the_rest_are_refused(family, dtype):
    lm, batch, bound = _model(family), _batch(), F32 if dtype == torch.float32 else BF16
    decided = paths.decide(lm.config, lm, padding_free=True, checkpointing=False)
    want_logp, want_grads = _alone(lm, batch, dtype)
    for path in PATHS:
        if path not in _takes(decided):  # refused, and said why
            assert decided.score != path and decided.why, (family, decided)
            continue
        logp, grads = _on_path(lm, batch, dtype, path)
        _close(logp, want_logp, bound["logprobs"], f"{family} {path} log-probs")
        _close(grads, want_grads, bound["grads"], f"{family} {path} gradients")


def test_the_decision_by_layer_kind():
    """Full attention packs; sliding window packs (the window in the mask); recurrent layers share the prompt;
    checkpointing trains on full sequences and still scores on the fast path; an unknown layer kind runs full."""
    expect = {"llama": "packed", "gemma3": "packed", "gpt_oss": "packed", "qwen3_5": "shared_prompt"}
    expect |= {"lfm2": "shared_prompt", "granite4_hybrid": "shared_prompt", "falcon_h1": "shared_prompt"}
    for family, path in expect.items():
        if family not in text_families():
            continue
        lm = _model(family)
        assert paths.decide(lm.config, lm, padding_free=True, checkpointing=False).train == path, family
    lm = _model("qwen3_5")
    assert "recurrent" in paths.decide(lm.config, padding_free=True, checkpointing=False).kinds
    checkpointed = paths.decide(lm.config, padding_free=True, checkpointing=True)
    assert (checkpointed.train, checkpointed.score) == ("full_sequences", "shared_prompt")
    assert "sinks" in paths.layer_kinds(_model("gpt_oss").config, _model("gpt_oss"))
    unknown = family_config("llama", VOCAB, eos=1, pad=0)
    unknown.layer_types = ["indexed_attention", "full_attention"]
    assert paths.decide(unknown, padding_free=True, checkpointing=False).train == "full_sequences"
    assert paths.decide(_model("llama").config, padding_free=False, checkpointing=False).train == "shared_prompt"


def test_grpo_init_says_the_learner_path_in_one_line(tmp_path, caplog):
    """From the checkpoint's config and modules on the meta device: a hybrid shares the prompt, a sliding-window
    model packs, and with gradient checkpointing training runs full sequences."""
    from grpo.config import load_config
    from stages.init import prepare_base
    from tests.families import build_family_model

    hybrid = build_family_model(str(tmp_path / "hybrid"), "qwen3_5", ["sort 3 1 2", "1 2 3"])
    gemma = build_family_model(str(tmp_path / "gemma"), "gemma3", ["sort 3 1 2", "1 2 3"])
    with caplog.at_level("INFO", logger="grpo"):
        prepare_base(load_config(None, [f"model.base_model={hybrid}"]), str(tmp_path / "a"))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("learner path")]
    assert len(said) == 1 and said[0].startswith("learner path: shared_prompt (") and "recurrent" in said[0]
    assert paths.learner_path_line(gemma, True, False).startswith("learner path: packed (")
    line = paths.learner_path_line(gemma, True, True)
    assert line.startswith("learner path: full_sequences, scoring packed (") and "\n" not in line


HYBRIDS = ("qwen3_next", "qwen3_5_text", "lfm2", "granitemoehybrid", "falcon_h1")  # model types with recurrent layers
RECURRENT = [f for f in text_families() if FAMILIES[f][0] in HYBRIDS]


@pytest.mark.parametrize("family", RECURRENT)
def test_packing_forced_on_recurrent_layers_mixes_responses_and_the_comparison_sees_it(family):
    """The leak the decision keeps out (ms-swift #9565): a recurrent state running from one packed response into
    the next gives other log-probs than the response alone, so the conformance test above would fail on it."""
    lm, batch = _model(family), _batch()
    want, _ = _alone(lm, batch, torch.float32)
    got, _ = _on_path(lm, batch, torch.float32, "packed")
    assert paths.decide(lm.config, lm, padding_free=True, checkpointing=False).train != "packed"
    assert (got - want).abs().max() > F32["logprobs"]
