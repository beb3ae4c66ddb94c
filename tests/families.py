"""Tiny random checkpoints of the decoder families people fine-tune now, built from transformers' own config classes.

Each family is a few lines of config at toy size (hidden 64, head_dim 32, so vLLM's CPU attention takes it), with
its own kind of layers kept: Gemma's and Mistral's sliding window small enough that the test sequences cross it,
the hybrids' linear-attention / conv / Mamba layers beside full attention, MoE experts routed. `build_family_model`
saves one as a user's checkpoint: `save_pretrained` weights (in the family's hub key layout: transformers converts on
save), a byte-level BPE chat tokenizer (grpo.tiny_model.build_chat_tokenizer) and generation_config.json, so
`grpo init --set model.base_model=DIR` takes it as it would a hub download. Families this transformers lacks are
left out of FAMILIES (the tests parametrize over what is here).
"""

from __future__ import annotations

import os

import torch

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
WINDOW = 4  # sliding window: test sequences are longer, so a mask that forgets the window gives other log-probs


def _moe(**extra) -> dict:
    return dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **extra)


def _hybrid_linear(**extra) -> dict:
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5) beside full attention, at toy size."""
    return dict(
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        **extra,
    )


# family -> (model_type, config fields): text decoders; MULTIMODAL below wraps a text config
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(num_hidden_layers=2)),
    "qwen2": ("qwen2", dict(num_hidden_layers=2)),
    "qwen3": ("qwen3", dict(num_hidden_layers=2)),
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=2, **_moe())),
    "qwen3_next": (
        "qwen3_next",
        _hybrid_linear(**_moe(shared_expert_intermediate_size=32), partial_rotary_factor=0.5),
    ),
    "qwen3_5": ("qwen3_5_text", _hybrid_linear()),
    "gemma2": (
        "gemma2",
        dict(num_hidden_layers=2, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    ),
    "gemma3": (
        "gemma3_text",
        dict(num_hidden_layers=2, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    ),
    "mistral": ("mistral", dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "phi3": ("phi3", dict(num_hidden_layers=2)),
    "smollm3": ("smollm3", dict(num_hidden_layers=2)),
    "olmo2": ("olmo2", dict(num_hidden_layers=2)),
    "gpt_oss": (
        "gpt_oss",
        dict(
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "lfm2": (
        "lfm2",
        dict(num_hidden_layers=2, layer_types=["conv", "full_attention"], conv_L_cache=3, block_ff_dim=128),
    ),
    "granite4_hybrid": (
        "granitemoehybrid",
        dict(
            num_hidden_layers=2,
            layer_types=["mamba", "attention"],
            num_local_experts=4,
            num_experts_per_tok=2,
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=16,
            shared_intermediate_size=64,
        ),
    ),
    "falcon_h1": (
        "falcon_h1",
        dict(
            num_hidden_layers=2,
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=1,
            mamba_chunk_size=16,
        ),
    ),
}

# multimodal checkpoints trained on text: the ForConditionalGeneration config, its text part a family above
MULTIMODAL: dict[str, tuple[str, str]] = {"qwen3_5_vl": ("qwen3_5", "qwen3_5"), "gemma3_vl": ("gemma3", "gemma3")}


def _known() -> dict[str, tuple[str, dict]]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return {name: spec for name, spec in FAMILIES.items() if spec[0] in CONFIG_MAPPING}


def family_config(family: str, vocab_size: int, eos: int, pad: int):
    """The tiny config of `family` (a FAMILIES or MULTIMODAL name) for a tokenizer of vocab_size, eos and pad ids."""
    from transformers import AutoConfig

    ids = dict(vocab_size=vocab_size, eos_token_id=eos, pad_token_id=pad, bos_token_id=pad)
    if family in MULTIMODAL:
        model_type, text = MULTIMODAL[family]
        text_type, fields = FAMILIES[text]
        text_config = AutoConfig.for_model(text_type, **SMALL, **fields, **ids, max_position_embeddings=256)
        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)
        if model_type == "gemma3":
            vision = dict(
                num_hidden_layers=1,
                hidden_size=32,
                num_attention_heads=2,
                intermediate_size=64,
                image_size=28,
                patch_size=14,
            )
        return AutoConfig.for_model(model_type, text_config=text_config.to_dict(), vision_config=vision, **ids)
    model_type, fields = FAMILIES[family]
    return AutoConfig.for_model(
        model_type, **SMALL, **fields, **ids, max_position_embeddings=256, tie_word_embeddings=True
    )


def build_family_model(
    out_dir: str, family: str, texts: list[str], *, vocab_size: int = 300, seed: int = 0, dtype: str = "float32"
) -> str:
    """Save a randomly initialised `family` checkpoint with a chat tokenizer trained on `texts` (as
    grpo.tiny_model.build_chat_model does for Qwen2) to out_dir; returns out_dir."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

    from grpo.tiny_model import build_chat_tokenizer

    tokenizer = build_chat_tokenizer(texts, vocab_size)
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = family_config(family, len(tokenizer), im_end, endoftext)
    auto = AutoModelForImageTextToText if family in MULTIMODAL else AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext
    )
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def text_families() -> list[str]:
    """The FAMILIES this transformers has."""
    return sorted(_known())
