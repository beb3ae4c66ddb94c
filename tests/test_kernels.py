"""The learner's kernels per device (grpo/learner/kernels.py): the chunked log-probs against the full logits, with
and without LoRA, never more than a chunk of logits at once; Liger's kernel against them; the attention kernels."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo import core
from grpo.config import LoraConfig, load_config
from grpo.errors import LearnError
from grpo.learner import Batch, PolicyLM, kernels, score
from grpo.learner.state import with_adapter
from stages.init import build_tiny_base

pytestmark = [pytest.mark.equivalence, pytest.mark.precision_pinned]  # the bf16 lane leaves it out (conftest.py)

TINY = ["model.hidden_size=64", "model.num_heads=2", "model.intermediate_size=128", "rollout.group_size=4"]
LENGTHS = [[9, 2, 3, 4], [1, 1, 9, 8], [5, 4, 0, 6]]  # 3 groups of 4, an empty response too
PROMPT_LEN = [7, 3, 6]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_base(str(tmp_path_factory.mktemp("lm")), load_config(None, TINY))


def load(base, lora: bool):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if not lora:
        return lm
    lm = with_adapter(lm, LoraConfig(r=4), None, seed=0)
    with torch.no_grad():  # B starts at 0 (the adapters a no-op): give them a part in the log-probs
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    return lm


def make_batch() -> Batch:
    gen = torch.Generator().manual_seed(2)
    lp, t = max(PROMPT_LEN), max(map(max, LENGTHS))
    prompt_ids, prompt_mask = torch.zeros(3, lp, dtype=torch.long), torch.zeros(3, lp, dtype=torch.long)
    for i, n in enumerate(PROMPT_LEN):  # left-padded
        prompt_ids[i, lp - n :], prompt_mask[i, lp - n :] = torch.randint(4, 16, (n,), generator=gen), 1
    response_ids, response_mask = torch.zeros(12, t, dtype=torch.long), torch.zeros(12, t)
    for i, n in enumerate(sum(LENGTHS, [])):
        response_ids[i, :n], response_mask[i, :n] = torch.randint(4, 16, (n,), generator=gen), 1
    return Batch(
        prompt_ids, prompt_mask, response_ids, response_mask, response_mask, torch.zeros(12, t),
        torch.zeros(12, t, dtype=torch.long), *torch.zeros(2, 12), 4, [0] * 12, [0] * 12,
    )  # fmt: skip


def full_logits_logprobs(lm, batch: Batch) -> torch.Tensor:
    """Today's reference: one right-padded forward per whole sequence, its (B, L, V) logits whole; (N, T)."""
    n, t = batch.response_ids.shape
    prompts = [batch.prompt_ids[i // 4][batch.prompt_mask[i // 4].bool()] for i in range(n)]
    responses = [batch.response_ids[i][batch.response_mask[i].bool()] for i in range(n)]
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids, mask = torch.zeros(n, width, dtype=torch.long), torch.zeros(n, width, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, : len(p) + len(r)], mask[i, : len(p) + len(r)] = torch.cat([p, r]), 1
    logits = lm(input_ids=ids, attention_mask=mask).logits  # (N, L, V)
    logp = core.token_logprobs(logits[:, :-1], ids[:, 1:])
    out = torch.zeros(n, t)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        out[i, : len(r)] = logp[i, len(p) - 1 : len(p) - 1 + len(r)]
    return out


def grads(lm) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in lm.parameters() if p.requires_grad and p.grad is not None])


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("padding_free", [False, True])
def test_chunked_log_probs_equal_the_full_logits_and_form_a_chunk_of_logits_at_most(base, lora, padding_free):
    """The log-probs and gradients of PolicyLM's chunked path (5 tokens' logits at a time) equal those of a forward
    forming every logit within 1e-5 in float32, with and without LoRA adapters, packed rows or not; and the LM head
    never sees more than a chunk of positions: in the policy's forward and backward, in pi_old's scoring pass and in
    the reference's (LoRA: the base with the adapters off)."""
    lm, batch, chunk = load(base, lora), make_batch(), 5
    weights = torch.linspace(0.5, 2, 12)[:, None] * batch.response_mask
    want = full_logits_logprobs(lm, batch)
    (want * weights).sum().backward()
    want_grad = grads(lm)
    lm.zero_grad()

    model = PolicyLM(lm, logprob_chunk=chunk, padding_free=padding_free)
    seen = []
    model.causal.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].shape[-2]))
    logp, entropy = model(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, True)
    (logp * weights).sum().backward()
    assert (logp * batch.response_mask - want).abs().max() < 1e-5
    got_grad = grads(lm)
    assert want_grad.norm() > 0 and (got_grad - want_grad).norm() / want_grad.norm() < 1e-5
    assert len(got_grad) == len(want_grad) and (not lora or len(got_grad) < sum(p.numel() for p in lm.parameters()))
    assert entropy.shape == logp.shape and bool((entropy * batch.response_mask >= 0).all())
    training = list(seen)
    old = score(model, batch, chunk_groups=2)  # pi_old's pass
    with model.adapter_disabled():  # LoRA's reference: the base
        ref = score(model, batch, chunk_groups=3)
    assert (old - want).abs().max() < 1e-5
    assert not lora or (ref - old).abs().max() > 1e-4  # the adapters had a part, and were off for the reference
    assert max(seen) <= chunk and len(training) > 2 * int(batch.response_mask.sum()) // chunk  # forward + backward
    assert len(seen) > len(training)


def test_the_device_chooses_the_kernels():
    """A CPU gets the chunked torch log-probs and torch's CPU sdpa kernels; CUDA the flash and memory-efficient sdpa
    kernels ahead of math; learn.logprob_kernel=liger without CUDA fails naming the setting."""
    from torch.nn.attention import SDPBackend

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kernels.logprob_kernel("auto", cpu) == kernels.logprob_kernel("torch", cpu) == "torch"
    assert kernels.logprob_kernel("torch", cuda) == "torch"
    assert kernels.attention_backends(cpu) == [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    backends = kernels.attention_backends(cuda)
    assert (
        backends[:2] == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION] and backends[-1] == SDPBackend.MATH
    )
    with pytest.raises(LearnError, match="^learn.logprob_kernel=liger needs a CUDA device"):
        kernels.logprob_kernel("liger", cpu)
    assert kernels.chosen("auto", cpu) == {"logprobs": "torch", "attention": ["flash_attention", "math"]}


LIGER_CHECK = """
import torch
from grpo import core
from grpo.learner import kernels

gen = torch.Generator().manual_seed(0)
head = torch.nn.Linear(16, 50, bias=False)
hidden = torch.randn(3, 7, 16, generator=gen, requires_grad=True)
labels = torch.randint(0, 50, (3, 7), generator=gen)
weights = torch.linspace(0.5, 2, 21).view(3, 7)
out = {}
for name, fn in {"liger": kernels.liger_token_logprobs, "torch": core.chunked_token_logprobs}.items():
    logp, entropy = fn(hidden, head, labels, 4, True)
    out[name] = (logp, entropy, *torch.autograd.grad((logp * weights).sum(), (hidden, head.weight)))
for a, b in zip(out["liger"], out["torch"]):
    assert (a - b).abs().max() < 1e-5, (a - b).abs().max()
print("liger ok")
"""


@pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is not installed (gpu extra)"
)
def test_liger_log_probs_equal_the_chunked_ones():
    """Liger's fused linear cross-entropy per token, run by Triton's interpreter on the CPU: the log-probs, entropy
    and gradients of the torch path within 1e-5 in float32."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", LIGER_CHECK],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(root), *sys.path])},
    )
    assert proc.returncode == 0 and "liger ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
