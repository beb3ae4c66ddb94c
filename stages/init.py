"""Create a run: check its inputs, write its resolved config, commit the base model it starts from.

The base model is the policy of iteration 0 and the frozen reference for the KL
penalty. With no `model.base_model` the tiny model for the task is built from a
config; otherwise the checkpoint (a local folder, an fsspec URL or a hub id) is
copied in once, so every later stage references immutable, hashed files. Reward
files named in `reward.functions` are copied beside it (`reward/`).

Everything a later stage needs is checked before run.json is written: the model and
its tokenizer load, the chat template exists where the prompt format needs one, the
datasets have their columns, the reward functions import and take the right
arguments. A typo fails here, naming the field, and leaves no run behind.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from grpo import data
from grpo.checkpoint import ModelNotFoundError, fetch_model, non_finite_weights, upload_folder
from grpo.config import ConfigError, RunConfig, load_config, load_config_file
from grpo.layout import run_dir, run_json
from grpo.storage import Committed, Storage, is_local
from grpo.tasks import functions, generates, get_task
from grpo.tiny_model import build_for_task
from stages.common import StageError, load_run, log, run_stage


def write_run_json(storage: Storage, run_id: str, cfg: RunConfig) -> None:
    """Write run.json once; a different config for an existing run is refused, except in its `tracking`
    section (no stage reads it: turning tracking on for a run that exists is allowed)."""
    path = run_json(storage, run_id)
    data_ = json.dumps({"run_id": run_id, "config": cfg.to_dict()}, indent=1, sort_keys=True).encode()
    if storage.exists(path):
        old, new = load_config(json.loads(storage.read_bytes(path)).get("config")).to_dict(), cfg.to_dict()
        old_tracking, new_tracking = old.pop("tracking"), new.pop("tracking")  # defaults of newer fields filled in
        if old != new:
            raise StageError(f"{storage.uri(path)}: run {run_id!r} exists with a different config; use a new run id")
        if old_tracking != new_tracking:
            storage.write_bytes_atomic(path, data_)
        return
    if is_local(storage.fs):  # object stores need no folders
        storage.fs.makedirs(run_dir(storage, run_id), exist_ok=True)
    storage.write_bytes_atomic(path, data_)


def run_config(storage: Storage, run_id: str, config_path: str | None, overrides: list[str]) -> RunConfig:
    """The config to init `run_id` with: run.json's for an existing run given no config (finishing
    an init that stopped before its base model committed), else the file and overrides (a
    different config for an existing run is then refused by write_run_json)."""
    if storage.exists(run_json(storage, run_id)) and not (config_path or overrides):
        return load_run(storage, run_id)
    return load_config_file(config_path, overrides)


def build_tiny_base(out_dir: str, cfg: RunConfig) -> str:
    """The tiny model `cfg.model` describes, for the vocabulary of `cfg.task`, saved in `out_dir`."""
    return build_for_task(out_dir, cfg.task.name, cfg.task.params, cfg.model, cfg.seed)


def _sample_prompts(cfg: RunConfig) -> list:
    """A few prompts of each source the run reads, to check that they load and render."""
    examples = []
    for name, uri in (("task.dataset", cfg.task.dataset), ("eval.dataset", cfg.eval.dataset)):
        if uri:
            try:
                rows = data.load_examples(uri, cfg.task.prompt_column, cfg.task.answer_column)
            except data.DatasetError as e:
                raise ConfigError(f"{name}: {e}") from e
            examples += [next((e for e in rows if isinstance(e.prompt, list)), rows[0]), rows[0]]
    task = get_task(cfg.task.name, **cfg.task.params)
    if generates(task) and not cfg.task.dataset:  # the task's own prompts, for training and eval
        examples += task.generate(1, seed=0)
    if cfg.task.dataset and not cfg.eval.dataset:
        from stages.prompts import held_out_split

        try:
            held_out_split(cfg)
        except StageError as e:
            raise ConfigError(f"eval.split_fraction: {e}") from e
    return examples


def check_inputs(cfg: RunConfig, model_dir: str) -> None:
    """Fail with a ConfigError naming the field if anything a stage will read is missing or wrong."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 (transformers raises many kinds for a broken folder)
        raise ConfigError(
            f"model.base_model {cfg.model.base_model}: the tokenizer does not load: {type(e).__name__}: {e}"
        ) from e
    examples = _sample_prompts(cfg)
    for example in examples:
        try:
            data.render(tokenizer, example.prompt, cfg.task.prompt_format, cfg.task.system_prompt)
        except data.DatasetError as e:
            raise ConfigError(f"task.prompt_format={cfg.task.prompt_format}: {e}") from e
    columns = set.intersection(*(set(e.row or {}) for e in examples)) if examples else set()
    for spec in cfg.reward.functions:
        try:
            missing = functions.required_columns(functions.load_function(spec)) - columns
        except functions.RewardFunctionError as e:
            raise ConfigError(str(e)) from e
        if missing:
            raise ConfigError(
                f"reward.functions: {spec!r} needs dataset column(s) {sorted(missing)}, which "
                f"{cfg.task.dataset or 'the task generator'} lacks (columns: {sorted(columns)})"
            )


def prepare_base(cfg: RunConfig, tmp: str) -> tuple[str, str]:
    """(local folder of the checked base model, where it came from), inside `tmp`."""
    folder = f"{tmp}/model"
    if cfg.model.base_model:
        try:
            source = fetch_model(cfg.model.base_model, folder)
        except ModelNotFoundError as e:
            raise ConfigError(str(e)) from e
    else:
        build_tiny_base(folder, cfg)
        source = f"tiny {cfg.model.arch} for {cfg.task.name}"
    check_inputs(cfg, folder)
    bad = non_finite_weights(folder)
    if bad:
        raise ConfigError(f"model.base_model {source}: non-finite weights in {', '.join(bad[:3])}")
    return folder, source


def init_run(storage: Storage, run_id: str, cfg: RunConfig, force: bool = False) -> Committed:
    """Check the run's inputs, write run.json and commit the base model under `runs/<run_id>/base`."""
    exists = storage.exists(run_json(storage, run_id))
    with tempfile.TemporaryDirectory() as tmp:
        prepared = None
        if exists:
            write_run_json(storage, run_id, cfg)  # only checks that the config is the same
        else:
            prepared = prepare_base(cfg, tmp)  # before anything is written
            write_run_json(storage, run_id, cfg)

        def body(writer):
            folder, source = prepared or prepare_base(cfg, tmp)
            upload_folder(writer, folder)
            for i, spec in enumerate(cfg.reward.functions):  # the code that scores travels with the run
                if functions.is_file_spec(spec):
                    path = functions.split_spec(spec)[0]
                    writer.storage.fs.put_file(str(Path(path)), writer.path(functions.committed_name(i, spec)))
            return {"base_model": source}

        stage_cfg = {"model": cfg.to_dict()["model"], "task": cfg.to_dict()["task"], "seed": cfg.seed}
        if cfg.reward.functions:
            stage_cfg["reward_functions"] = cfg.reward.functions
        base = run_stage(storage, run_id, None, "base", config=stage_cfg, inputs={}, body=body, force=force)
    log.info("run %s ready at %s", run_id, storage.uri(run_dir(storage, run_id)))
    return base
