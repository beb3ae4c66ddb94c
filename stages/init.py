"""Create a run: write its resolved config and commit the base model it starts from.

The base model is the policy of iteration 0 and the frozen reference for the KL
penalty. With no `model.base_model` the tiny model for the task is built from a
config; otherwise the given HF-format folder is copied in once, so every later
stage references immutable, hashed files.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import fsspec

from grpo.checkpoint import upload_folder
from grpo.config import RunConfig
from grpo.storage import Committed, Storage, is_local
from grpo.tiny_model import build_for_task
from stages.common import StageError, log, run_dir, run_stage


def write_run_json(storage: Storage, run_id: str, cfg: RunConfig) -> None:
    """Write run.json once; a different config for an existing run is refused."""
    path = f"{run_dir(storage, run_id)}/run.json"
    data = json.dumps({"run_id": run_id, "config": cfg.to_dict()}, indent=1, sort_keys=True).encode()
    if storage.exists(path):
        existing = json.loads(storage.read_bytes(path))
        if existing.get("config") != cfg.to_dict():
            raise StageError(f"{storage.uri(path)}: run {run_id!r} exists with a different config; "
                             "use a new run id")
        return
    if is_local(storage.fs):  # object stores need no folders
        storage.fs.makedirs(run_dir(storage, run_id), exist_ok=True)
    storage.write_bytes_atomic(path, data)


def _copy_base(src: str, dst: Path) -> None:
    fs, root = fsspec.core.url_to_fs(src)
    if not fs.exists(f"{root}/config.json"):
        raise StageError(f"model.base_model {src}: no config.json, not an HF-format checkpoint folder")
    fs.get(root.rstrip("/") + "/", str(dst), recursive=True)


def build_tiny_base(out_dir: str, cfg: RunConfig) -> str:
    """The tiny model `cfg.model` describes, for the vocabulary of `cfg.task`, saved in `out_dir`."""
    m = cfg.model
    return build_for_task(out_dir, cfg.task.name, cfg.task.params, hidden_size=m.hidden_size,
                          num_layers=m.num_layers, num_heads=m.num_heads, intermediate_size=m.intermediate_size,
                          max_position_embeddings=m.max_position_embeddings, seed=cfg.seed, arch=m.arch,
                          tie_embeddings=m.tie_embeddings, initializer_range=m.initializer_range)


def init_run(storage: Storage, run_id: str, cfg: RunConfig, force: bool = False) -> Committed:
    """Write run.json and commit the base model under `runs/<run_id>/base`."""
    write_run_json(storage, run_id, cfg)

    def body(writer):
        with tempfile.TemporaryDirectory() as tmp:
            if cfg.model.base_model:
                _copy_base(cfg.model.base_model, Path(tmp))
            else:
                build_tiny_base(tmp, cfg)
            upload_folder(writer, tmp)
        return {"base_model": cfg.model.base_model or f"tiny {cfg.model.arch} for {cfg.task.name}"}

    stage_cfg = {"model": cfg.to_dict()["model"], "task": cfg.to_dict()["task"], "seed": cfg.seed}
    base = run_stage(storage, run_id, None, "base", config=stage_cfg, inputs={}, body=body, force=force)
    log.info("run %s ready at %s", run_id, storage.uri(run_dir(storage, run_id)))
    return base
