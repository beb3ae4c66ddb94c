"""Which kernels the learner's forwards run on a device, chosen here once: the log-prob kernel (the LM head and
the log-probs and entropy of the sampled tokens, never the full (tokens x vocab) logits) and the attention
kernel of the rows PolicyLM builds (packed rows' block-diagonal mask, padding).

Log-probs (learn.logprob_kernel): `torch`, grpo.core.chunked_token_logprobs, learn.logprob_chunk tokens' logits at
a time, recomputed in backward; `liger`, Liger's fused linear cross-entropy (Triton; liger-kernel, the `gpu` extra),
which streams the LM head through the softmax without keeping the logits (as TRL's use_liger_kernel); `auto`,
liger on CUDA where liger_kernel imports, torch elsewhere. Both give the same log-probs and gradients to float
rounding (tests/test_kernels.py); the entropy, a metric without gradient, comes from the torch path under no_grad.

Attention: transformers' sdpa with a mask of ours (the packed rows' block-diagonal one, or padding), so on CUDA the
memory-efficient kernel (any mask) after flash (no mask: rows without padding), never the math one where either
applies; a packing through position_ids (flash-attention varlen, as TRL's padding_free) cannot express a group's
prompt shared by its rows as a cache. On a CPU, torch's CPU flash kernel, then math.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch
from torch import Tensor

from grpo import core
from grpo.errors import LearnError


def liger_available(device: torch.device) -> bool:
    """Liger's Triton kernels can run here: a CUDA device and liger_kernel installed."""
    return device.type == "cuda" and _liger_installed()


@functools.cache
def _liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def logprob_kernel(setting: str, device: torch.device) -> str:
    """learn.logprob_kernel (auto | torch | liger) -> the kernel run on `device`: torch or liger."""
    if setting == "torch" or (setting == "auto" and not liger_available(device)):
        return "torch"
    if not liger_available(device):
        raise LearnError(
            f"learn.logprob_kernel=liger needs a CUDA device and liger-kernel (the gpu extra); on {device.type} "
            "set it to auto or torch"
        )
    return "liger"


def token_logprobs(
    hidden: Tensor, head: torch.nn.Module, labels: Tensor, chunk: int, with_entropy: bool, kernel: str
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (B, T) of labels (B, T) under head(hidden) (hidden (B, T, H), head the LM head) and with_entropy
    their entropy (B, T) (no gradient), by `kernel` (logprob_kernel); a head that is not a plain Linear (an adapter
    on it), or labels (B, T, m) (m ids a position: log-probs (B, T, m)), take the torch path."""
    if kernel != "liger" or type(head) is not torch.nn.Linear or labels.dim() == 3:
        return core.chunked_token_logprobs(hidden, head, labels, chunk, with_entropy)
    return liger_token_logprobs(hidden, head, labels, chunk, with_entropy)


def liger_token_logprobs(
    hidden: Tensor, head: torch.nn.Linear, labels: Tensor, chunk: int, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """token_logprobs by Liger's fused linear cross-entropy, per token (reduction none: the gradient of each
    token's log-prob weighed in backward, where the logits are formed again chunk by chunk); the entropy by the
    torch path under no_grad (a forward of the LM head more: Liger computes none)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    b, t, h = hidden.shape
    nll = liger_fused_linear_cross_entropy(
        hidden.reshape(b * t, h), head.weight, labels.reshape(b * t), head.bias, reduction="none"
    )
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = core.chunked_token_logprobs(hidden.detach(), head, labels, chunk, True)[1]
    return -nll.reshape(b, t), entropy


def attention_backends(device: torch.device) -> list:
    """The sdpa kernels the learner's forwards may use on `device`, in torch's order of preference."""
    from torch.nn.attention import SDPBackend

    if device.type == "cuda":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def attention(device: torch.device):
    """Context: sdpa restricted to attention_backends(device), in that order (a no-op for eager attention)."""
    from torch.nn.attention import sdpa_kernel

    try:
        return sdpa_kernel(attention_backends(device), set_priority=True)
    except TypeError:  # torch < 2.6: no priorities, the list alone
        return sdpa_kernel(attention_backends(device))
    except RuntimeError:  # a backend this build lacks
        return contextlib.nullcontext()


def chosen(setting: str, device: torch.device) -> dict:
    """What the learn manifest records (`kernels`): the log-prob kernel and the sdpa kernels allowed, in order."""
    return {
        "logprobs": logprob_kernel(setting, device),
        "attention": [b.name.lower() for b in attention_backends(device)],
    }
