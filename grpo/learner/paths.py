"""Which path PolicyLM's forward takes for a model, decided once from what its layers are.

Three paths give the same log-probs and gradients (tests/test_model_families.py checks each family on each):
`packed` (each group's prompt computed once, its responses packed into shared rows under a mask of ours),
`shared_prompt` (the prompt once, every layer's state repeated for the group's G responses) and `full_sequences`
(one forward over each prompt + response: what gradient checkpointing runs). A faster path is taken only where
every layer keeps the responses apart on it:

- full attention, attention sinks: any path (a sink is a per-head logit, the same under any mask);
- sliding window: shared prompt (the cache keeps the window); packed with the window in our mask;
- linear attention, conv, SSM (Gated DeltaNet, LFM2's conv, Mamba): shared prompt, their conv and recurrent states
  repeated; never packed: a recurrent state runs on through a row, so a response packed after another would start
  from its state (the leak ms-swift #9565 reports for Qwen3.5). Packing them needs varlen kernels that reset the
  state at each response (flash-linear-attention's cu_seqlens), which transformers' layers do not take;
- a layer kind not listed here (chunked attention, indexed attention, ...): full sequences, the one path that assumes
  nothing of a layer.

Packing also needs an attention that takes a mask of ours (sdpa, eager). The layer kinds are transformers' own
(`get_layer_types_and_kwargs`, what its cache is built from) and the model's modules (sinks), so the decision
needs a config (and, for sinks, the modules: a model on the meta device will do), never weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Path = Literal["packed", "shared_prompt", "full_sequences"]

# transformers' layer types (cache_utils.DYNAMIC_LAYER_TYPE_MAPPING) -> the kinds of state the layer keeps
LAYER_KINDS = {
    "full_attention": ("full_attention",),
    "sliding_attention": ("sliding_window",),
    "conv": ("recurrent",),
    "linear_attention": ("recurrent",),
    "mamba": ("recurrent",),
    "hybrid": ("full_attention", "recurrent"),  # an attention and an SSM side by side in one layer (Falcon-H1)
    "hybrid_sliding": ("sliding_window", "recurrent"),
    "moe": ("stateless",),
    "mlp": ("stateless",),
}
SHARED = {"full_attention", "sliding_window", "recurrent", "stateless", "sinks"}
PACKED = {"full_attention", "sliding_window", "stateless", "sinks"}
MASKED_ATTENTION = ("sdpa", "eager")  # attention implementations that take a mask of ours


@dataclass(frozen=True)
class LearnerPath:
    """The paths a model's forwards take and why (the learn manifest's `learner_path`)."""

    train: Path  # the training forward's (with gradient)
    score: Path  # the scoring passes' (no gradient: old and reference log-probs)
    kinds: tuple[str, ...]  # the kinds of layer the model has, sorted
    why: str  # one line

    def record(self) -> dict:
        return {"train": self.train, "score": self.score, "layers": list(self.kinds), "why": self.why}


def layer_kinds(config, model=None) -> tuple[str, ...]:
    """The kinds of layer (LAYER_KINDS values, `sinks`, or `unknown:<type>`) of the text decoder of `config`; with
    `model` (its modules, weights or not) attention sinks are seen too."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    kinds = {kind for t in types for kind in LAYER_KINDS.get(t, (f"unknown:{t}",))}
    if model is not None and any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters()):
        kinds.add("sinks")
    return tuple(sorted(kinds))


def decide(config, model=None, *, padding_free: bool, checkpointing: bool) -> LearnerPath:
    """The learner's paths for a model of `config` (and `model`, for sinks) under learn.padding_free and
    learn.gradient_checkpointing.

    >>> from transformers import LlamaConfig, Qwen3_5TextConfig
    >>> llama = LlamaConfig(num_hidden_layers=1, attn_implementation="sdpa")
    >>> decide(llama, padding_free=True, checkpointing=False).train
    'packed'
    >>> p = decide(Qwen3_5TextConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
    ...            padding_free=True, checkpointing=False)
    >>> p.train, p.score
    ('shared_prompt', 'shared_prompt')
    """
    kinds = layer_kinds(config, model)
    attention = config.get_text_config(decoder=True)._attn_implementation
    fast, why = _fastest(set(kinds), attention, padding_free)
    train = "full_sequences" if checkpointing else fast
    if checkpointing:
        why += "; training runs full sequences (gradient checkpointing keeps no cache to share)"
    return LearnerPath(train, fast, kinds, why)


def _fastest(kinds: set[str], attention: str | None, padding_free: bool) -> tuple[Path, str]:
    """The fastest path every layer of `kinds` keeps the responses apart on, and why in one line."""
    layers = "+".join(sorted(kinds))
    if not kinds <= SHARED:
        return "full_sequences", f"layers {layers}: the fast paths are not checked on a kind here, so full sequences"
    if not padding_free:
        return "shared_prompt", f"layers {layers}; learn.padding_free is off"
    if "recurrent" in kinds:
        return "shared_prompt", (
            f"layers {layers}: a linear-attention/conv/SSM state would run on from one packed response into the "
            "next (no varlen kernel resets it here)"
        )
    if not kinds <= PACKED:
        return "shared_prompt", f"layers {layers}: packing has no mask for them, so shared prompt"
    if attention not in MASKED_ATTENTION:
        return "shared_prompt", f"layers {layers}: {attention} attention takes no mask of ours, so shared prompt"
    return "packed", (
        f"layers {layers} keep packed responses apart under the learner's mask; shared prompt where packing saves "
        "under 10% of the rows"
    )


def learner_path_line(model_dir: str, padding_free: bool, checkpointing: bool) -> str:
    """One line (`grpo init` says it): the path the learner will take on the checkpoint in model_dir and why,
    decided from its config and its modules on the meta device, no weights."""
    from transformers import AutoConfig

    from grpo.record.weights import meta_model

    config, model = AutoConfig.from_pretrained(model_dir), None
    try:
        model = meta_model(config)  # the architecture the learner loads (a multimodal one whole)
        config = model.config  # with the attention implementation transformers chose
    except Exception:  # noqa: BLE001 (a checkpoint transformers cannot build: its config decides alone)
        pass
    path = decide(config, model, padding_free=padding_free, checkpointing=checkpointing)
    scoring = "" if path.score == path.train else f", scoring {path.score}"
    return f"learner path: {path.train}{scoring} ({path.why})"
