"""Create a run: check its inputs, write its resolved config, commit the base model it starts from.

The base model is the policy of iteration 0 and the frozen reference for the KL penalty. With no `model.base_model`
the tiny model for the task is built from a config; otherwise the checkpoint (a local folder, an fsspec URL or a hub
id) is copied in once, so every later stage references immutable, hashed files. Reward files named in
`reward.functions` are copied beside it (`reward/`), and so are the files of rollout's code settings (code_files).

Everything a later stage needs is checked before run.json is written: the model's weights fit its config.json and its
tokenizer loads, the chat template exists where the prompt format needs one, the datasets have their columns and every
row a prompt and a ground truth, the reward functions import and take the right arguments, the tools and environment of
episodes import and describe their tools, eval.dataset is not task.dataset, learn.lora.target_modules name layers of
the model, reward.workers and rollout.tool_workers can all be kept busy. A typo fails here, naming the field, and
leaves no run behind.

The base manifest records each dataset's fingerprint (and the rows task.skip_invalid_rows left out): the run is pinned
to those bytes, a stage refuses a dataset changed since (grpo.pins.pin); a run older than fingerprints is not.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from grpo import data
from grpo.config import ConfigError, RunConfig, check_judge_folder, load_config_file
from grpo.episodes import adapters, chat, openenv, parsing, templates
from grpo.errors import one_line
from grpo.record import pins
from grpo.record.checkpoint import (
    ModelNotFoundError,
    checkpoint_problem,
    fetch_model,
    non_finite_weights,
    upload_folder,
)
from grpo.record.counts import is_local
from grpo.record.fork import fork_of
from grpo.record.identity import CHANGED_DEFAULTS, EVAL_READING, LEARN_PLACEMENT, section, stored_config
from grpo.record.layout import run_dir, run_json
from grpo.record.lineage import committed_input
from grpo.record.storage import Committed, Storage
from grpo.record.weights import lora_target_problem
from grpo.scoring.teacher import check_teachers
from grpo.tasks import functions, generates, get_task, trl_rewards
from grpo.tasks.base import EPISODE_ARGUMENTS
from stages.common import (
    StageError,
    dataset_examples,
    dataset_facts,
    load_run,
    log,
    measured,
    pin_datasets,
    run_datasets,
    run_stage,
)


def write_run_json(storage: Storage, run_id: str, cfg: RunConfig) -> None:
    """Write run.json once; a different config for an existing run is refused, except where no committed result
    depends on it: the `tracking` and `retention` sections (what is sent where, what gc keeps) and learn.num_processes
    (with learn.sharding=fsdp2 the optimizer state reshards to any number of processes; the next learns run with the
    new number), where the learner's processes run (grpo.record.identity.LEARN_PLACEMENT: learn.nodes,
    learn.processes_per_node, learn.node_timeout_s, learn.state_every, learn.device), and when evals run and which
    figure is the best (grpo.record.identity.EVAL_READING: eval.every, eval.metric; committed evals and skips stay),
    rollout.shards and reward.shards (1 and N shards commit the same rows) and rollout.device (where it samples)."""
    path = run_json(storage, run_id)
    if storage.exists(path):
        raw = json.loads(storage.read_bytes(path))
        old, new = stored_config(raw.get("config")).to_dict(), cfg.to_dict()
        for (section, name), (was, now) in CHANGED_DEFAULTS.items():  # the run keeps the default it began with
            if old[section][name] == was and new[section][name] == now:
                new[section][name] = was
        if old == new:
            return
        data_ = json.dumps({**raw, "run_id": run_id, "config": new}, indent=1, sort_keys=True).encode()  # a fork's too
        for c in (old, new):  # defaults of newer fields filled in
            c.pop("tracking"), c.pop("retention")
            for name in LEARN_PLACEMENT:
                c["learn"].pop(name)
            for name in EVAL_READING:
                c["eval"].pop(name)
            c["rollout"].pop("shards"), c["reward"].pop("shards")  # 1 and N shards commit the same rows
            c["rollout"].pop("device")  # where it samples (grpo.record.identity.LEFT_OUT)
            if c["learn"]["sharding"] == "fsdp2":
                c["learn"].pop("num_processes")
        if old != new:
            changed = [f"{s}.{k}" for s in new if isinstance(new[s], dict) for k in new[s]
                       if old.get(s, {}).get(k) != new[s][k]]  # fmt: skip
            raise StageError(
                f"{storage.uri(path)}: run {run_id!r} exists with a different config ({', '.join(changed) or 'seed'}); "
                "use a new run id (only "
                "tracking, retention, eval.every, eval.metric, rollout.shards, rollout.device, reward.shards, "
                "learn.nodes, learn.processes_per_node, learn.node_timeout_s, learn.state_every, learn.device and, "
                "with learn.sharding=fsdp2, learn.num_processes may change)"
            )
        storage.write_bytes_atomic(path, data_)
        return
    data_ = json.dumps({"run_id": run_id, "config": cfg.to_dict()}, indent=1, sort_keys=True).encode()
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
    from grpo.tiny_model import build_for_task

    return build_for_task(out_dir, cfg.task.name, cfg.task.params, cfg.model, cfg.seed)


def _sample_prompts(cfg: RunConfig) -> list:
    """A few prompts of each source the run reads, to check that they load and render."""
    examples = []
    for name, uri in run_datasets(cfg).items():
        rows = dataset_examples(cfg, name, uri)
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
        raise ConfigError(f"model.base_model {cfg.model.base_model}: the tokenizer does not load: {one_line(e)}") from e
    tokenizer = chat.with_thinking(tokenizer, cfg.task.enable_thinking)  # refused where the template has no switch
    examples = _sample_prompts(cfg)
    for example in examples:
        try:
            templates.render(tokenizer, example.prompt, cfg.task.prompt_format, cfg.task.system_prompt)
        except data.DatasetError as e:
            raise ConfigError(f"task.prompt_format={cfg.task.prompt_format}: {e}") from e
    check_episodes(cfg, tokenizer)
    from stages.prompts import loaded_rollout_func  # torch: status and the commands that read a run never import it

    loaded_rollout_func(cfg.rollout.rollout_func)  # imports, and is a function: one line now, not at rollouts
    columns = set.intersection(*(set(e.row or {}) for e in examples)) if examples else set()
    kind = cfg.rollout.environment_kind()
    for spec, needed in reward_columns(cfg).items():
        if problem := trl_rewards.environments_problem(spec, needed, kind):  # TRL's `environments`, with none to give
            raise ConfigError(problem)
        missing = set(needed) - columns - {"environments"}
        if kind is not None:  # an episode's environment and conversation
            missing -= set(EPISODE_ARGUMENTS)
        if missing:
            raise ConfigError(
                f"reward.functions: {spec!r} needs dataset column(s) {sorted(missing)}, which "
                f"{cfg.task.dataset or 'the task generator'} lacks (columns: {sorted(columns)})"
            )


def code_files(cfg: RunConfig) -> list[tuple[list[str], str]]:
    """(specs, the prefix their copies go under in the base commit) of reward.functions and rollout's code settings."""
    r = cfg.rollout
    return [
        (list(cfg.reward.functions), functions.REWARD_PREFIX),
        ([r.environment] if r.environment else [], adapters.PREFIXES["environment"]),
        (list(r.tools), adapters.PREFIXES["tools"]),
        ([r.rollout_func] if r.rollout_func else [], functions.ROLLOUT_FUNC_PREFIX),
    ]


def check_episodes(cfg: RunConfig, tokenizer) -> None:
    """rollout.tools and rollout.environment: the code imports and its tools have schemas (its adapter builds in a tool
    worker as the rollouts stage builds it, within rollout.tool_timeout_s, without credentials but tool_pass_env's: a
    typo, an exit, a crash or a hang is one line), and the model's chat template renders tools and conversations."""
    from grpo.episodes.workers import GRACE_S, check
    from grpo.runtime.pool import RewardPool

    r = cfg.rollout
    if r.environment_kind() is None:
        return
    if not templates.has_chat_template(tokenizer):
        raise ConfigError(
            "rollout.tools / rollout.environment: episodes render their prompts, tools and observations with the "
            "model's chat template, and the model's tokenizer has none"
        )
    where = f"rollout.environment {r.environment!r}" if r.environment else "rollout.tools"
    adapters.preload(r.environment_kind())  # before the worker forks: rollout.tool_timeout_s bounds the user's code
    with RewardPool(1, tuple(r.tool_pass_env), "tool") as pool:
        try:
            limit = r.tool_timeout_s + GRACE_S  # the code imported, a probe instance constructed: bounded as a call
            schemas = pool.apply(check, (adapters.source(r, {}), r.tool_max_memory_mb), timeout=limit)
        except RuntimeError as e:
            raise ConfigError(f"{where}: does not build in a tool worker: {' '.join(str(e).split())}") from e
        finally:
            pool.log_printed()
    if isinstance(schemas, str):
        raise ConfigError(schemas)
    openenv.check_sessions(cfg)  # an OpenEnv server holds as many sessions as the run opens at once
    try:
        templates.apply_template(tokenizer, [{"role": "user", "content": "x"}], schemas, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 (jinja errors of the model's template)
        raise ConfigError(f"rollout.tools: the model's chat template does not render tools: {e}") from e
    parsing.check_tool_format(tokenizer, where, schemas)


IMPORT_TIMEOUT_S = 120.0
"""How long a reward file may take to import and be checked at `grpo init`."""


def reward_columns(cfg: RunConfig) -> dict[str, list[str]]:
    """{spec: the dataset columns it needs} of reward.functions, each imported and checked in a reward worker (no
    credentials but reward.pass_env's, what it prints logged redacted), as the rewards stage runs them: a reward
    file's module-level code never runs in this process, and an import that exits, crashes or hangs is one line."""
    from grpo.runtime.pool import RewardPool

    found = {}
    with RewardPool(1, tuple(cfg.reward.pass_env)) as pool:
        for spec in cfg.reward.functions:
            try:
                found[spec] = pool.apply(functions.columns_needed, (spec,), timeout=IMPORT_TIMEOUT_S)
            except RuntimeError as e:
                raise ConfigError(
                    f"reward.functions: {spec!r}: importing it in a reward worker failed ({one_line(e)}): a reward "
                    "file must import without exiting, crashing or hanging; run `python -c 'import <file>'` to see"
                ) from e
            finally:
                pool.log_printed()
            if isinstance(found[spec], str):
                raise ConfigError(found[spec])
    return found


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity, as taskset and container limits set it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_reward_workers(cfg: RunConfig) -> None:
    """reward.workers (rollout.tool_workers: RolloutConfig): no more than a shard's samples or the cores keep busy."""
    r, rc = cfg.rollout, cfg.reward
    per_shard = -(-r.prompts_per_iteration * r.group_size // rc.shards)
    if rc.workers > per_shard:
        raise ConfigError(
            f"reward.workers={rc.workers} is more than the {per_shard} samples a reward shard scores (rollout."
            f"prompts_per_iteration x rollout.group_size / reward.shards); the rest would idle: set reward.workers "
            f"<= {per_shard}"
        )
    check_judge_folder(rc.judge)  # a local judge named by a path is a folder here
    cores, pools = usable_cores(), [("reward.workers", rc.workers, "sample", "reward.timeout_s")]
    if r.environment_kind():
        pools.append(("rollout.tool_workers", r.tool_workers, "call", "rollout.tool_timeout_s"))
    for setting, n, each, limit in pools:
        if n > cores:
            raise ConfigError(
                f"{setting}={n} is more than the {cores} CPU core(s) this machine gives grpo: workers beyond them "
                f"share cores, each {each} runs slower against {limit}; set {setting} <= {cores}"
            )


BYTES_PER_TOKEN = 32
"""A sampled token's least cost in an iteration: ids, log-probs, mask, advantage in the rollouts and learner's batch."""


def machine_memory() -> int | None:
    """This machine's memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_sizes(cfg: RunConfig, memory: int | None = None) -> None:
    """rollout.prompts_per_iteration x group_size and eval.n_prompts x samples_per_prompt: no more samples than
    this machine's memory can hold at BYTES_PER_TOKEN a token of (rollout.max_prompt_tokens or 1) + max_tokens,
    a bound no real run comes near; past it a stage would grow until the machine runs out, silently."""
    memory = memory or machine_memory()
    if memory is None:
        return
    r, e = cfg.rollout, cfg.eval
    tokens = (r.max_prompt_tokens or 1) + r.max_tokens
    sizes = {
        ("rollout.prompts_per_iteration", "rollout.group_size"): r.prompts_per_iteration * r.group_size,
        ("eval.n_prompts", "eval.samples_per_prompt"): e.n_prompts * e.samples_per_prompt,
    }
    for (fix, times), samples in sizes.items():
        need = samples * tokens * BYTES_PER_TOKEN
        if need > memory:
            raise ConfigError(
                f"{fix} x {times} = {samples:,} samples of up to {tokens} tokens need at least {need / 2**30:,.0f} "
                f"GiB, more than this machine's {memory / 2**30:,.0f} GiB; lower {fix}"
            )


def check_held_out(datasets: dict[str, dict]) -> None:
    """eval.dataset must not be task.dataset (the same URI or the same bytes): its prompts would be trained on."""
    train, held = datasets.get("task.dataset"), datasets.get("eval.dataset")
    if train and held and (train["uri"] == held["uri"] or train["fingerprint"] == held["fingerprint"]):
        same = "is" if train["uri"] == held["uri"] else "has the same content as"
        raise ConfigError(
            f"eval.dataset {held['uri']} {same} task.dataset: every held-out prompt would be trained on; name a "
            "held-out file, or unset eval.dataset to hold out eval.split_fraction of task.dataset"
        )


def check_lora_targets(cfg: RunConfig, model_dir: str) -> None:
    """Each name of learn.lora.target_modules matches a layer as peft matches them (a typo: a layer, or all, bare)."""
    if cfg.learn.lora is not None and (problem := lora_target_problem(cfg.learn.lora.target_modules, model_dir)):
        raise ConfigError(f"learn.lora.target_modules: {problem}; list those that should get adapters")


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
    problem = checkpoint_problem(folder)
    if problem:
        raise ConfigError(f"model.base_model {source}: {problem}")
    check_inputs(cfg, folder)
    check_lora_targets(cfg, folder)
    check_teachers(cfg.teacher, folder)  # a teacher's token space is the student's (on-policy distillation)
    from grpo.learner.paths import learner_path_line  # torch: not for the commands that only read a run (status)
    from grpo.sampling.engines import vllm_model_problem

    if cfg.rollout.backend == "vllm" and (problem := vllm_model_problem(folder)):  # its architecture, on this machine
        raise ConfigError(f"rollout.backend=vllm: {problem}; set rollout.backend=hf (or auto)")
    log.info("%s", learner_path_line(folder, cfg.learn.padding_free, cfg.learn.gradient_checkpointing))
    bad = non_finite_weights(folder)
    if bad:
        raise ConfigError(f"model.base_model {source}: non-finite weights in {', '.join(bad[:3])}")
    return folder, source


@measured
def init_run(storage: Storage, run_id: str, cfg: RunConfig, force: bool = False) -> Committed:
    """Check the run's inputs, write run.json and commit the base model under `runs/<run_id>/base`."""
    exists = storage.exists(run_json(storage, run_id))
    if exists and fork_of(storage, run_id) is not None:  # a fork's base is its parent's (grpo.record.fork)
        write_run_json(storage, run_id, cfg)  # only checks the config, or takes a change of tracking, retention, ...
        return committed_input(storage, run_id, None, "base")
    with tempfile.TemporaryDirectory() as tmp:
        prepared = None
        if exists:
            write_run_json(storage, run_id, cfg)  # only checks that the config is the same
            pin_datasets(storage, run_id)  # a committed base's datasets must not have changed
            datasets = dataset_facts(cfg)
        else:
            pins.pin(None)  # a new run: nothing recorded yet (a run loaded before in this process pins no more)
            check_sizes(cfg)
            check_reward_workers(cfg)
            datasets = dataset_facts(cfg)  # before anything is written
            check_held_out(datasets)
            prepared = prepare_base(cfg, tmp)
            write_run_json(storage, run_id, cfg)

        def body(writer):
            folder, source = prepared or prepare_base(cfg, tmp)
            upload_folder(writer, folder)
            for specs, prefix in code_files(cfg):  # the code that scores, tools and environments travel with the run
                for i, spec in enumerate(specs):  # a module or an OpenEnv server's URL: nothing to copy
                    if functions.is_file_spec(spec):
                        into = writer.path(functions.committed_name(i, spec, prefix))
                        writer.storage.fs.put_file(str(Path(functions.split_spec(spec)[0])), into)
                    elif functions.is_pickled_spec(spec):  # a callable handed to grpo.train, cloudpickled
                        writer.storage.fs.pipe_file(writer.path(functions.committed_name(i, spec, prefix)),
                                                    functions.pickled_bytes(spec))  # fmt: skip
            return {"base_model": source, "datasets": datasets}

        stage_cfg = {"model": section(cfg, "model"), "task": section(cfg, "task"), "seed": cfg.seed}
        if cfg.reward.functions:
            stage_cfg["reward_functions"] = cfg.reward.functions
        if adapters.names_files(cfg.rollout) or cfg.rollout.rollout_func:  # runs without them keep their identity
            stage_cfg["episode_files"] = [s for specs, _ in code_files(cfg)[1:] for s in specs]
        base = run_stage(storage, run_id, None, "base", config=stage_cfg, inputs={}, body=body, force=force)
    pins.pin(base.manifest.summary.get("datasets"))  # what the base recorded: the later stages of this process
    log.info("run %s ready at %s", run_id, storage.uri(run_dir(storage, run_id)))
    return base
