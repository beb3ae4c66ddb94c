"""Which device the in-process learner and the sampler use: learn.device and rollout.device resolved on this
machine (`auto`: cuda:0 where CUDA is available, else the CPU) and checked against it, each failure a ConfigError
naming the field; and whether the two are `apart`. Apart, neither hands the accelerator to the other around a
learn (stages.learn: the sampler does not sleep, the warm learner stays on its device), and with
rollout.staleness >= 1 the flow samples iteration k+1 while learn k runs in this very process
(flows/placement.py `overlapping`).

The limits of one process: vLLM's in-process engine samples on its local rank 0, the first visible GPU (cuda:0),
or on a CPU machine the CPU, so backend vllm takes rollout.device auto, cuda or cuda:0 (the transformers backend
samples on any device); a learner under torchrun (learn.num_processes > 1) takes one GPU a process by its local
rank, so its learn.device stays auto and it is never apart.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from grpo.config import ConfigError, LearnConfig, RolloutConfig, RunConfig


def resolve(setting: str, field: str) -> torch.device:
    """The device a setting names on this machine (`cuda` is cuda:0); a ConfigError naming `field` where the
    machine has no such device.

    >>> resolve("cpu", "learn.device"), resolve("auto", "learn.device") == resolve("auto", "rollout.device")
    (device(type='cpu'), True)
    """
    if setting == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(setting)
    if device.type != "cuda":
        return device
    device = torch.device("cuda", device.index or 0)
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.index >= n:
        raise ConfigError(
            f"{field}={setting}: this machine has {n} CUDA device(s)"
            + (f" (cuda:0..cuda:{n - 1})" if n else "")
            + "; name one it has, cpu, or auto"
        )
    return device


def vllm_device() -> torch.device:
    """Where vLLM's engine samples in this process: its local rank 0 (cuda:0), or the CPU without CUDA."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def learner_device(learn: LearnConfig) -> torch.device:
    """The in-process learner's device (learn.device)."""
    return resolve(learn.device, "learn.device")


def sampler_device(rollout: RolloutConfig, backend: str | None = None) -> torch.device:
    """The sampler's device (rollout.device); with `backend` vllm, refused unless it is vLLM's (vllm_device)."""
    device = resolve(rollout.device, "rollout.device")
    if backend == "vllm" and device != vllm_device():
        raise ConfigError(
            f"rollout.device={rollout.device}: vLLM in one process samples on {vllm_device()} (its local rank "
            f"0); set rollout.backend=hf to sample on {device}, or put the learner elsewhere (learn.device)"
        )
    return device


def apart(cfg: RunConfig) -> bool:
    """Whether this process's learner and sampler are on different devices: an in-process learner
    (learn.num_processes = 1) on another device than rollout.device. False where this machine lacks either (the
    stage that needs it fails naming it): they take turns, as on one device."""
    if cfg.learn.num_processes > 1:
        return False
    try:
        return learner_device(cfg.learn) != sampler_device(cfg.rollout, cfg.rollout.backend)
    except ConfigError:
        return False


def check(cfg: RunConfig, stages: set[str]) -> None:
    """The devices of `stages` (those this process runs) exist here: learn.device for learn, rollout.device for
    rollouts and eval (with backend vllm, vLLM's), teacher.device for teacher; a ConfigError naming the field."""
    if "learn" in stages and cfg.learn.num_processes == 1:
        learner_device(cfg.learn)
    if stages & {"rollouts", "eval"}:
        sampler_device(cfg.rollout, cfg.rollout.backend)
    if "teacher" in stages and cfg.teacher is not None:
        teacher_device(cfg.teacher)


def teacher_device(teacher) -> torch.device:
    """The teacher's device (teacher.device: grpo.config.TeacherConfig); with teacher.backend vllm, refused unless it
    is vLLM's (vllm_device)."""
    device = resolve(teacher.device, "teacher.device")
    if teacher.backend == "vllm" and device != vllm_device():
        raise ConfigError(
            f"teacher.device={teacher.device}: a vLLM teacher in one process scores on {vllm_device()} (its local rank "
            f"0); set teacher.backend=hf to score on {device}, or teacher.device=auto"
        )
    return device


@contextmanager
def current(device: torch.device | None) -> Iterator[None]:
    """CUDA's current device in this thread set to `device` for the block, then set back: what a kernel launched
    without a tensor's device runs on (Triton's among them), and the device whose peak memory a stage's manifest
    records (stages.common.gpu_memory). Each thread has its own, cuda:0 unless set; nothing on a CPU or for None."""
    if device is None or device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield
