"""A checkpoint folder as a transformers model, both ways through transformers.

The class a checkpoint loads as is the architecture it was saved as (`model_class`): a multimodal
`...ForConditionalGeneration` (Qwen3.5's small checkpoints, Gemma 3 4B and up) stays one, its vision tower loaded,
frozen while its language model trains on text (`text_only`) and saved again; AutoModelForCausalLM would give
Qwen3.5's text model alone and a save would drop the tower. Weights come in through transformers' loading (its key
conversions: fused MoE experts from the hub's per-expert tensors, renamed prefixes, tied embeddings, dtype) and go
out through save_pretrained, which writes them back in the hub's layout (`saved_layout`); `read_weights` swaps a
new checkpoint into a loaded model in place, and `weights_mismatch` is init's check that a folder's files fit its
config.
"""

from __future__ import annotations

from pathlib import Path

from grpo.errors import one_line


def model_class(config):
    """The transformers auto class that loads a checkpoint of `config` as the architecture it was saved as:
    AutoModelForImageTextToText where config.architectures names that class's model for its model_type (a
    multimodal checkpoint), else AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    multimodal = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(config.model_type)
    return AutoModelForImageTextToText if multimodal in (config.architectures or []) else AutoModelForCausalLM


def load_model(model_dir: str, dtype):
    """The checkpoint in model_dir as a transformers model of its own architecture (model_class), weights in
    `dtype`."""
    from transformers import AutoConfig

    return model_class(AutoConfig.from_pretrained(model_dir)).from_pretrained(model_dir, dtype=dtype)


def meta_model(config):
    """The model `config` describes, on the meta device (its modules and shapes, no memory, no weights)."""
    import torch

    with torch.device("meta"):
        return model_class(config).from_config(config)


def text_only(model) -> list[str]:
    """Freeze every parameter that text never reaches (a multimodal model's vision tower and projector): only the
    language model and its head train, and the rest is saved as loaded. Returns the names frozen (none for a
    text model)."""
    keep = {id(p) for part in (model.get_decoder(), model.get_output_embeddings()) for p in part.parameters()}
    frozen = [n for n, p in model.named_parameters() if id(p) not in keep]
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    return frozen


def saved_layout(model) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} as model.save_pretrained writes them: tied weights once, transformers' conversions
    reverted (MoE experts back to the hub's per-expert tensors, prefixes as the hub has them). Works on a
    meta_model."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = revert_weight_conversion(model, remove_tied_weights_from_state_dict(model.state_dict(), model))
    return {name: tuple(t.shape) for name, t in state.items()}


def safetensors_names(model_dir: str | Path) -> set[str]:
    """The tensor names in a folder's safetensors files (their headers; no weights read)."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            names |= set(st.keys())
    return names


def read_weights(model, model_dir: str) -> None:
    """The weights of the checkpoint in model_dir copied into `model` (a transformers model of its architecture)
    in place: its device, dtype and tied weights kept. Files already in the model's own names (no conversion
    applies: the common case, a millisecond) are read directly; any other layout (the hub's per-expert MoE
    tensors, a multimodal prefix) goes through from_pretrained, which converts it, first. ValueError in one line
    when they do not fit."""
    from safetensors.torch import load_file
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    own = set(remove_tied_weights_from_state_dict(model.state_dict(), model))
    if safetensors_names(model_dir) == own and not get_model_conversion_mapping(model, add_legacy=False):
        state = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            state.update(load_file(f))
        missing, unexpected = set(own) - set(state), set(state) - set(own)
    else:
        try:
            loaded, info = type(model).from_pretrained(model_dir, dtype=model.dtype, output_loading_info=True)
        except (OSError, ValueError, RuntimeError) as e:
            raise ValueError(f"{model_dir}: weights do not load as {type(model).__name__}: {one_line(e)}") from e
        state = loaded.state_dict()
        missing = set(info["missing_keys"]) | {k for k, *_ in info["mismatched_keys"]}
        unexpected = set(info["unexpected_keys"])
    if missing or unexpected:
        raise ValueError(
            f"{model_dir}: weights do not fit the loaded model (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )
    model.load_state_dict(state, strict=False)  # cast to the model's dtype, on its device; tied weights once


def weights_mismatch(model, files: dict[str, tuple[tuple[int, ...], str]], model_type: str) -> str | None:
    """The first tensor of `model` (a meta_model) whose shape differs from the files' ({name: (shape, file)}) or
    that the files lack, in one line; None when they fit. The files may be in the layout save_pretrained writes
    (the hub's: per-expert MoE tensors, tied weights once) or in the model's own names; a tied lm_head may be
    absent, and so may a buffer (transformers makes it)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    own = {n: tuple(t.shape) for n, t in remove_tied_weights_from_state_dict(model.state_dict(), model).items()}
    layout = max((saved_layout(model), own), key=lambda names: len(names.keys() & files.keys()))
    prefix = model.base_model_prefix + "."
    if not any(n.startswith(prefix) for n in files):  # saved from the model without its head
        layout = {n.removeprefix(prefix): shape for n, shape in layout.items()}
    buffers = {n.removeprefix(prefix) for n, _ in model.named_buffers()} | dict(model.named_buffers()).keys()
    for key, shape in layout.items():
        if key in files and files[key][0] != shape:
            found, file = files[key]
            return f"tensor {key} in {file} has shape {list(found)}; config.json makes it {list(shape)}"
        if key not in files and key not in buffers:
            names = sorted({file for _, file in files.values()})
            where = names[0] if len(names) == 1 else f"any of its {len(names)} weight files"
            return f"tensor {key} is not in {where} (config.json's model_type is {model_type!r})"
    return None


def lora_target_problem(targets: list[str], model_dir: str) -> str | None:
    """The first of `targets` (peft's target_modules) that matches no linear layer of the checkpoint's model as peft
    matches them (the layer's name, or its dotted path's end), in one line; None when each does. A MoE's expert
    layers (Qwen3-MoE's gate/up/down_proj) are no linear layers once transformers fuses them: they count where peft
    adapts them as the fused tensors (its target_parameters), as it does for the families it knows."""
    import torch
    from transformers import AutoConfig

    model = meta_model(AutoConfig.from_pretrained(model_dir))  # the modules' names without their weights
    layers = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in layers)]
    if missing:
        from peft import LoraConfig, get_peft_model

        adapted = get_peft_model(model, LoraConfig(target_modules=list(targets)), low_cpu_mem_usage=True)
        config = adapted.peft_config["default"]
        if config.target_parameters:  # the experts' names peft took over onto their fused tensors
            missing = [t for t in missing if t in config.target_modules]
    if not missing:
        return None
    names = sorted({n.rsplit(".", 1)[-1] for n in layers})
    return f"{missing[0]!r} names no linear layer of the model (its layers: {', '.join(names)})"
