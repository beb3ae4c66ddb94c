"""How the learner's processes split the model (learn.sharding=fsdp2) and save what they hold.

torchtitan's split: the model (grpo.learner.PolicyLM) knows nothing of parallelism; `fully_shard_policy`
applies torch's FSDP2 `fully_shard` to each decoder layer and then to the whole model, over a 1-D device
mesh of every process. Each process then holds 1/world of every parameter, its gradient and its AdamW
state; a layer's full weights exist only while it runs. Accelerate's FSDP plugin would do the same on
GPUs but silently falls back to DDP on a CPU, so the one code path here is torch's own, tested on gloo.

State goes through torch Distributed Checkpoint (DCP): every process writes its own shards of the float32
weights (the master weights) and the AdamW state into one folder, and a later learner at any world size
(1 process included) reads them back resharded. The HF checkpoint samplers read is gathered whole
(`full_state_dict`) and written by the main process.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter


def fully_shard_policy(model: torch.nn.Module, world: int, device: torch.device) -> None:
    """Shard `model` (a PolicyLM, on `device`) in place: each decoder layer, then the root (embeddings,
    final norm, lm_head). Needs an initialized process group of `world` processes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for layer in model.causal.get_decoder().layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _options(trainable_only: bool, full: bool = False):
    """trainable_only (LoRA): the adapters alone, the frozen base neither saved nor expected on load."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(
        full_state_dict=full, cpu_offload=full, ignore_frozen_params=trainable_only, strict=not trainable_only
    )


def full_state_dict(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Every weight of `model` whole, on the CPU, keyed as model.state_dict() (every process must call
    this; a sharded model gathers). trainable_only: the LoRA adapters alone."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(trainable_only, full=True))


def save_state(model: torch.nn.Module, opt: torch.optim.Optimizer, folder: str | Path, trainable_only: bool) -> None:
    """Every process writes its shards of the (trainable) float32 weights and the AdamW state into
    `folder` (a local folder all processes of a node share)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optim = get_state_dict(model, opt, options=_options(trainable_only))
    writer = _Writer(str(folder))
    dcp.save({"model": weights, "optim": optim}, storage_writer=writer, no_dist=not _distributed())


class _Writer(FileSystemWriter):
    """DCP's file-system writer, its .metadata free of where and when it was written (the folder, a random save
    id): the same shards make the same bytes, so a replayed state commits what the lost one would have."""

    def storage_meta(self):
        return None


def load_state(model: torch.nn.Module, opt: torch.optim.Optimizer, folder: str | Path, trainable_only: bool) -> None:
    """Read `folder` (save_state's, written at any world size) into this process's shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    weights, optim = get_state_dict(model, opt, options=_options(trainable_only))
    state = {"model": weights, "optim": optim}
    dcp.load(state, checkpoint_id=str(folder), no_dist=not _distributed())
    set_state_dict(
        model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_options(trainable_only)
    )


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded tensor (DTensor); the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def total_norm(norm: torch.Tensor) -> float:
    """clip_grad_norm_'s result as a float (a sharded model's is a DTensor: made whole)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
