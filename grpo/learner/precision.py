"""The learner's precision: what learn.mixed_precision resolves to on a device, and why."""

from __future__ import annotations

import functools
import os

import torch

from grpo.config import ConfigError

AUTO_PRECISION_ENV = "GRPO_AUTO_PRECISION"  # bf16 | no: what learn.mixed_precision=auto resolves to, forced


def autocast_precision(setting: str, device: torch.device) -> tuple[str, str]:
    """(autocast, why) for learn.mixed_precision `setting` on `device`: `auto` is bf16 on a GPU that computes it
    natively and float32 elsewhere, CPUs with AMX or AVX512-BF16 included (measured there: bf16 autocast makes
    old_logprobs=auto score every batch again, the float32 sampler being 0.01 a token off; benchmarks/RESULTS.md);
    GRPO_AUTO_PRECISION=bf16|no forces what `auto` resolves to (CI's bf16 lane runs the tests so on a CPU).

    >>> autocast_precision("bf16", torch.device("cpu"))
    ('bf16', 'learn.mixed_precision')
    """
    if setting != "auto":
        return setting, "learn.mixed_precision"
    forced = os.environ.get(AUTO_PRECISION_ENV)
    if forced:
        if forced not in ("bf16", "no"):
            raise ConfigError(f"{AUTO_PRECISION_ENV}={forced!r}: use bf16 or no, or unset it")
        return forced, f"auto: {AUTO_PRECISION_ENV}={forced}"
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return ("bf16", "auto: GPU with bf16") if native else ("no", "auto: GPU without native bf16")
    if device.type == "cpu" and cpu_has_native_bf16():
        return "no", "auto: float32 on a CPU (bf16 here is native, but rescores pi_old)"
    return "no", f"auto: {device.type} without native bf16"


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this machine's CPU computes bf16 natively (AMX or AVX512-BF16 in /proc/cpuinfo's flags)."""
    try:
        flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    except OSError:  # not Linux
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags
