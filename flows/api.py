"""The Python API in TRL's shape: `from grpo import train`.

    from grpo import train

    def exact(completions, ground_truth, **kwargs):            # TRL's shape; or (response, ground_truth, prompt)
        return [float(c.split() == g.split()) for c, g in zip(completions, ground_truth)]

    train(model="Qwen/Qwen2.5-0.5B-Instruct", dataset=ds, reward_funcs=[exact], config="my.yaml", run="r1",
          iterations=20)
    train(model=..., train_dataset=ds, tools=[multiply], environment_factory=Calculator, reward_funcs=[...])  # agents

It makes the run `grpo init` makes and trains it as `grpo run` does (the same functions: stages.init.init_run,
then flows.commands.runs.train over stages.iteration.run_warm), so every command works on it afterwards: `grpo
status --run r1`, `grpo run --run r1 --iterations 10` (the reward callables come from the run's own copy),
`grpo export`. A reward callable is cloudpickled (a lambda, or a function of a script or of your own module, by
value), named in reward.functions by its name and the sha256 of its bytes, and copied into the run at init: the
reward workers unpickle that copy. A dataset object is written once into storage as Parquet, named by the hash of
its bytes (`datasets/<sha256>.parquet`), and pinned by the run as a file path is. Tools and an environment class are
named by reference (code_spec): a file of yours is copied into the run, an installed module imported by name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
from pathlib import Path
from typing import Any, Callable

from grpo.config import ConfigError, RunConfig, load_config, read_config_file


@dataclasses.dataclass(frozen=True)
class Trained:
    """What `train` leaves: the run, and where its newest policy and figures are."""

    run: str
    uri: str
    """The run's folder in storage."""
    iteration: int | None
    """The last iteration committed (None: none yet)."""
    reached: int | None
    """With `target`: the first iteration whose held-out exact match reached it."""
    reward_mean: float | None
    eval_exact_match: float | None
    policy: str | None
    """The newest committed policy's attempt (`grpo export --run RUN` writes it as a Hugging Face folder)."""


def train(
    model: str | None = None,
    dataset: Any = None,
    reward_funcs: list[Callable | str] | tuple = (),
    config: dict | str | os.PathLike | None = None,
    run: str = "train",
    *,
    iterations: int = 10,
    target: float | None = None,
    eval_dataset: Any = None,
    storage: str | None = None,
    train_dataset: Any = None,
    tools: list[Callable | str] | tuple = (),
    environment_factory: type | str | None = None,
    rollout_func: Callable | str | None = None,
) -> Trained:
    """Make run `run` (or check an existing one has this config) and train `iterations` more iterations of it.

    model: a local folder, fsspec URL or hub id (model.base_model); None builds the task's tiny model.
    dataset, eval_dataset: a datasets.Dataset, a pandas DataFrame, a list of dicts, or a path/URL (task.dataset,
    eval.dataset); None: the task's own generator. Columns as task.prompt_column / task.answer_column name them.
    reward_funcs: callables, `(completions, **kwargs) -> list[float]` as TRL's or `(response, ground_truth, prompt,
    **row) -> float | dict`, or reward.functions specs; none: the task's reward.
    config: a dict of sections ({"learn": {"lr": 1e-3}}, or dotted keys {"learn.lr": 1e-3}) or a YAML file; a TRL
    GRPOConfig name is refused naming its setting here (docs/coming-from-trl.md).
    target: stop once the held-out exact match reaches it. storage: $GRPO_STORAGE or ./storage by default.
    train_dataset: TRL's name for `dataset`. tools, environment_factory: as TRL's GRPOTrainer takes them (functions;
    the environment class itself), recorded by reference (code_spec): rollout.tools, rollout.environment.
    rollout_func: TRL's, `fn(prompts, sampler) -> {prompt_ids, completion_ids, logprobs[, env_mask]}`, recorded the
    same way: rollout.rollout_func.
    """
    from flows.commands.runs import train as train_iterations
    from grpo.record.layout import run_dir
    from grpo.record.lineage import next_iteration, resume_problem
    from grpo.record.storage import open_storage
    from grpo.runtime import threads
    from grpo.runtime.quiet import quiet_libraries
    from stages import StageError
    from stages.init import init_run

    quiet_libraries()
    threads.apply_threads()
    where = open_storage(storage)
    if dataset is not None and train_dataset is not None:
        raise ConfigError("train_dataset is TRL's name for dataset: pass one of them")
    agents = {"tools": [code_spec(t, "tools") for t in tools]} if tools else {}
    if environment_factory is not None:
        agents["environment"] = code_spec(environment_factory, "environment_factory")
    if rollout_func is not None:
        agents["rollout_func"] = code_spec(rollout_func, "rollout_func")
    data = train_dataset if dataset is None else dataset
    cfg = run_config(where, model, data, reward_funcs, config, eval_dataset, agents)
    init_run(where, run, cfg)
    start = next_iteration(where, run)
    if problem := resume_problem(where, run, start):
        raise StageError(problem)
    reached = train_iterations(where, run, start, iterations, target) if iterations > 0 else None
    return trained(where, run, reached, run_dir(where, run))


def run_config(storage, model, dataset, reward_funcs, config, eval_dataset, rollout: dict | None = None) -> RunConfig:
    """The run's config: `config` (a dict or a YAML file) with the arguments' settings over it (`rollout`: the
    tools' and environment's specs)."""
    from grpo.tasks import functions

    if isinstance(config, (str, os.PathLike)):
        raw = nested(read_config_file(str(config)))  # as written: what it leaves unset may follow `model`
    elif config is None or isinstance(config, dict):
        raw = nested(config or {})
    else:
        raise ConfigError(f"config: a dict of sections or a YAML file's path, got {type(config).__name__}")
    sections = {s: dict(raw.get(s) or {}) for s in ("model", "task", "eval", "reward", "rollout")}
    sections["rollout"].update(rollout or {})
    if model is not None:
        sections["model"]["base_model"] = str(model)
    if dataset is not None:
        sections["task"]["dataset"] = dataset_uri(storage, dataset, "dataset")
    if eval_dataset is not None:
        sections["eval"]["dataset"] = dataset_uri(storage, eval_dataset, "eval_dataset")
    if reward_funcs:
        specs = [f if isinstance(f, str) else functions.pickle_callable(f, i) for i, f in enumerate(reward_funcs)]
        sections["reward"]["functions"] = specs
    return load_config({**raw, **{s: v for s, v in sections.items() if v}})


def code_spec(obj: Callable | str, what: str) -> str:
    """How a setting names a function or class handed to `train`, so every process of the run (workers, a resumed or
    forked run, `grpo rescore`) loads it: `path/to/file.py:name` for one in a file of your own (copied into the run at
    init, as a file a config names), `package.module:name` for an installed module's; a string as it is."""
    import sys

    from grpo.tasks.functions import own_code

    if isinstance(obj, str):
        return obj
    name, module = getattr(obj, "__qualname__", ""), sys.modules.get(getattr(obj, "__module__", None) or "")
    if not callable(obj) or not name.isidentifier():
        raise ConfigError(f"{what}: {obj!r} is not a module-level function or class; pass that (TRL: the class itself)")
    if module is None or module.__name__ == "__main__" or not getattr(module, "__file__", None):
        raise ConfigError(
            f"{what}: {name} is defined in the script or notebook being run (__main__), which other processes cannot "
            f"import; move it into a file of its own (say my_{what}.py) and `from my_{what} import {name}`"
        )
    return f"{module.__file__}:{name}" if own_code(module) else f"{module.__name__}:{name}"


def nested(config: dict) -> dict:
    """{"learn.lr": 1e-3, "rollout": {"group_size": 4}} -> {"learn": {"lr": 1e-3}, "rollout": {"group_size": 4}}.

    >>> nested({"learn.lr": 1e-3, "learn": {"epochs": 1}, "seed": 3})
    {'learn': {'epochs': 1, 'lr': 0.001}, 'seed': 3}
    """
    out: dict = {}
    for key, value in sorted(config.items(), key=lambda kv: "." in kv[0]):  # sections first, dotted keys over them
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = {**node[leaf], **value} if isinstance(value, dict) and isinstance(node.get(leaf), dict) else value
    return out


def dataset_uri(storage, dataset, what: str) -> str:
    """A dataset argument as task.dataset names it: a path or URL as it is; an object written once into storage as
    Parquet under the hash of its bytes."""
    if isinstance(dataset, (str, os.PathLike)):
        return str(dataset)
    import pandas as pd

    from grpo.record.counts import is_local

    if hasattr(dataset, "to_pandas"):  # datasets.Dataset
        frame = dataset.to_pandas()
    elif isinstance(dataset, pd.DataFrame):
        frame = dataset
    elif isinstance(dataset, list) and all(isinstance(r, dict) for r in dataset):
        frame = pd.DataFrame(dataset)
    else:
        raise ConfigError(f"{what}: a datasets.Dataset, a pandas DataFrame, a list of dicts or a path, got "
                          f"{type(dataset).__name__}")  # fmt: skip
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    data = buffer.getvalue()
    path = storage.path("datasets", f"{hashlib.sha256(data).hexdigest()[:32]}.parquet")
    if not storage.exists(path):
        if is_local(storage.fs):  # object stores need no folders
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        storage.write_bytes_atomic(path, data)
    return storage.uri(path)


def trained(storage, run_id: str, reached: int | None, folder: str) -> Trained:
    """The run's newest committed iteration and policy."""
    from flows.commands.export import newest_learn
    from grpo.record.layout import stage_dir
    from grpo.record.lineage import next_iteration
    from grpo.record.storage import NotCommittedError, committed_attempts, latest_committed

    k = next_iteration(storage, run_id) - 1
    summary = {}
    for stage in ("advantages", "eval") if k >= 0 else ():
        try:
            summary[stage] = latest_committed(storage, stage_dir(storage, run_id, k, stage), verify=False).manifest
        except NotCommittedError:
            pass
    learn = newest_learn(storage, run_id)
    policy = committed_attempts(storage, stage_dir(storage, run_id, learn, "learn"))[-1] if learn >= 0 else None
    return Trained(
        run=run_id,
        uri=storage.uri(folder),
        iteration=k if k >= 0 else None,
        reached=reached,
        reward_mean=summary["advantages"].summary.get("reward_mean") if "advantages" in summary else None,
        eval_exact_match=summary["eval"].summary.get("exact_match") if "eval" in summary else None,
        policy=storage.uri(policy) if policy else None,
    )
