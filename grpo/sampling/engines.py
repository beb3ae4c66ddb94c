"""The engine registry: which backend samples (`choose_backend`), with which settings (`engine_settings`), and the
live engines one process keeps warm between stages (`get_generator`, `release_accelerator` around the learner,
`close_generators`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from grpo.devices import sampler_device, vllm_device
from grpo.sampling.base import Generator, _generation_config_eos
from grpo.sampling.hf import HFGenerator
from grpo.sampling.vllm_engine import VLLMGenerator

BACKENDS = {"hf": HFGenerator, "vllm": VLLMGenerator}
_CACHE: dict[str, Generator] = {}
_SETTINGS: dict[str, dict] = {}  # what each live generator was built with


# config.json keys that differ between saves of one architecture
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "dtype", "torch_dtype"}


def same_architecture(dir_a: str, dir_b: str) -> bool:
    """Whether two checkpoint folders differ only in their weights (config, tokenizer and eos ids equal)."""

    def read(d: str, name: str) -> bytes | None:
        p = Path(d, name)
        return p.read_bytes() if p.exists() else None

    def config(d: str) -> dict | None:
        raw = read(d, "config.json")
        return None if raw is None else {k: v for k, v in json.loads(raw).items() if k not in _VOLATILE_CONFIG_KEYS}

    config_a = config(dir_a)
    return (
        config_a is not None
        and config_a == config(dir_b)
        and all(read(dir_a, f) == read(dir_b, f) for f in ("tokenizer.json", "tokenizer_config.json"))
        and _generation_config_eos(dir_a) == _generation_config_eos(dir_b)
    )  # what stops sampling


def get_generator(backend: str, model_dir: str, adapter_dir: str | None = None, **settings) -> Generator:
    """A generator for `model_dir` (with the LoRA adapters of `adapter_dir`) built with `settings` (the
    backend's keyword arguments). The live one is reused when its settings are the same: woken if
    asleep, as is for the same checkpoint, with its weights reloaded in place for another checkpoint
    of the same architecture (a warm engine across iterations), its adapters swapped for other ones;
    it is restarted otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown rollout backend {backend!r}; valid: {sorted(BACKENDS)}")
    current = _CACHE.get(backend)
    if current is not None and _SETTINGS.get(backend) == settings:
        if current.model_dir == model_dir or same_architecture(current.model_dir, model_dir):
            current.wake()
            if current.model_dir != model_dir:
                current.load_weights(model_dir)
            if current.adapter_dir != adapter_dir:
                current.load_adapter(adapter_dir)
            return current
    if current is not None:
        current.close()
        del _CACHE[backend]
    _CACHE[backend] = BACKENDS[backend](model_dir, **settings)
    _SETTINGS[backend] = settings
    if adapter_dir is not None:
        _CACHE[backend].load_adapter(adapter_dir)
    return _CACHE[backend]


def vllm_model_problem(model_dir: str) -> str | None:
    """Why vLLM cannot build the checkpoint in model_dir here, in one line, or None: its architecture's vLLM module
    (vLLM's registry) does not import, e.g. Qwen3.5's, which imports torchvision for its vision part even for text."""
    import importlib

    from vllm.model_executor.models.registry import _VLLM_MODELS

    config = Path(model_dir) / "config.json"
    architectures = (json.loads(config.read_text()).get("architectures") or []) if config.exists() else []
    for arch in architectures:
        if arch in _VLLM_MODELS:
            module = _VLLM_MODELS[arch][0]
            try:
                importlib.import_module(f"vllm.model_executor.models.{module}")
            except ImportError as e:
                return f"vLLM's model for {arch} does not import here ({e})"
    return None


def vllm_problem(model_dir: str) -> str | None:
    """Why vLLM cannot run the checkpoint in model_dir here, in one line (it is not installed, or
    vllm_model_problem), or None."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    return vllm_model_problem(model_dir)


VLLM_MIN_PARAMS = 10_000_000  # on 2 CPU cores vLLM samples 2.8x faster at 13M, transformers 3x faster at 0.1M


def choose_backend(
    setting: str, model_dir: str, device: torch.device | None = None, section: str = "rollout"
) -> tuple[str, str]:
    """(backend, why) for rollout.backend `setting`: `auto` picks vLLM on a GPU and for models of
    VLLM_MIN_PARAMS and up, transformers for smaller ones on a CPU, where vLLM is not installed or cannot build the
    model (vllm_model_problem), or for a sampler `device` (rollout.device resolved) other than the one vLLM samples
    on in one process (grpo.devices). `section`: whose backend and device setting it is (teacher, reward.judge:
    the models that score, decided alike)."""
    if setting != "auto":
        return setting, f"{section}.backend"
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "hf", "auto: vLLM is not installed"
    if device is not None and device != vllm_device():
        return "hf", f"auto: {section}.device {device}, where vLLM does not sample in one process ({vllm_device()})"
    if torch.cuda.is_available():
        backend, why = "vllm", "auto: a GPU"
    else:
        from grpo.record.checkpoint import parameter_count

        n = parameter_count(model_dir)
        if n < VLLM_MIN_PARAMS:
            return "hf", f"auto: {n / 1e6:.1f}M parameters on a CPU (< {VLLM_MIN_PARAMS / 1e6:.0f}M)"
        backend, why = "vllm", f"auto: {n / 1e6:.1f}M parameters on a CPU (>= {VLLM_MIN_PARAMS / 1e6:.0f}M)"
    if problem := vllm_model_problem(model_dir):
        return "hf", f"auto: {problem}"
    return backend, why


def release_accelerator(keep_engine: bool) -> None:
    """Before the learner runs: every live generator sleeps (off the GPU, usable again on its next
    use) or, when it cannot sleep or keep_engine is False, is closed."""
    for backend, gen in list(_CACHE.items()):
        if not (keep_engine and gen.sleep()):
            gen.close()
            del _CACHE[backend]


def engine_settings(backend: str, rollout, dtype: str, model_dir: str, lora=None) -> dict:
    """The keyword arguments of the `backend` generator for this run on this machine: rollout.vllm's
    None settings resolved to the platform's defaults, model.dtype's `auto` to the checkpoint's dtype, the
    transformers backend's device where rollout.device sets one.

    rollout: grpo.config.RolloutConfig; lora: grpo.config.LoraConfig or None. Recorded in the rollouts
    and eval manifests (`sampler`).
    """
    from grpo.record.checkpoint import checkpoint_dtype_name

    dtype = checkpoint_dtype_name(model_dir) if dtype == "auto" else dtype
    if backend != "vllm":  # rollout.device where it is set (auto: the generator's own choice, as before it existed)
        where = {} if rollout.device == "auto" else {"device": str(sampler_device(rollout))}
        return {"dtype": dtype} | where
    sampler_device(rollout, backend)  # vLLM's device, or a ConfigError naming rollout.device
    v, gpu = rollout.vllm, torch.cuda.is_available()
    max_len = v.max_model_len
    if max_len is None and rollout.max_prompt_tokens is not None:
        max_len = min(rollout.max_prompt_tokens + rollout.max_tokens, _context_length(model_dir))
    settings = {
        "dtype": dtype,
        "max_model_len": max_len,
        "enforce_eager": (not gpu) if v.enforce_eager is None else v.enforce_eager,
        # episodes (rollout.tools, rollout.environment): every turn's context starts with the last one's; segments
        # (rollout.segment_tokens): a prompt's G responses are G requests of one prompt
        "enable_prefix_caching": (gpu or episodes(rollout) or getattr(rollout, "segment_tokens", None) is not None)
        if v.enable_prefix_caching is None
        else v.enable_prefix_caching,
        "kv_cache_dtype": v.kv_cache_dtype,
        "tensor_parallel_size": v.tensor_parallel_size,
        "enable_sleep_mode": gpu if v.enable_sleep_mode is None else v.enable_sleep_mode,
    }
    if gpu:
        settings["gpu_memory_utilization"] = v.gpu_memory_utilization
    if lora is not None and (gpu if v.enable_lora is None else v.enable_lora):  # else merged in memory
        settings |= {"enable_lora": True, "max_lora_rank": _lora_rank(lora.r), "max_loras": 1}
    return settings


def scoring_settings(rollout, model_dir: str, dtype: str, max_model_len: int | None) -> dict:
    """The vLLM settings of a model that scores rather than samples the policy (a teacher's prompt log-probs, a local
    judge's answers): rollout.vllm's, resolved as `engine_settings` resolves them (wherever rollout.device puts the
    policy's sampler), in `dtype`, planned for `max_model_len` tokens (None: the model's context), no LoRA. A
    generator built with them (get_generator) is the process's one vLLM engine: the rollouts' engine, its weights
    reloaded in place where the scorer's architecture and settings are the policy's, else restarted."""
    import dataclasses

    settings = engine_settings("vllm", dataclasses.replace(rollout, device="auto"), dtype, model_dir)
    return settings | {"max_model_len": max_model_len}


def episodes(rollout) -> bool:
    """Whether the rollout settings sample episodes (grpo/episodes): a turn a sampler call, each context the last
    one's and more, which vLLM's prefix cache serves without prefilling it again."""
    return bool(getattr(rollout, "tools", None) or getattr(rollout, "environment", None))


def _lora_rank(r: int) -> int:
    """vLLM's max_lora_rank: the smallest of the ranks it accepts that holds r."""
    return next(n for n in (1, 8, 16, 32, 64, 128, 256, 320, 512) if n >= r)


def _context_length(model_dir: str) -> int:
    return int(json.loads(Path(model_dir, "config.json").read_text()).get("max_position_embeddings") or 2**31)


def close_generators() -> None:
    """Stop every live engine (the next get_generator starts cold)."""
    while _CACHE:
        _CACHE.popitem()[1].close()
    _SETTINGS.clear()
