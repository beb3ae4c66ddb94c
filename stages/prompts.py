"""What a policy is prompted with: an iteration's training prompts, the held-out set, rendered and
tokenized for a checkpoint, and the sampler that serves them (stages rollouts and eval).

Prompts come from the task generator (seeded by the run seed and the iteration) or from the user's
dataset (`task.dataset`, drawn epoch by epoch without replacement, the held-out rows left out; see
grpo.data), rendered with the model's chat template where the prompt format asks for it. A prompt
too long for `rollout.max_prompt_tokens` or for the model's context is skipped and counted; each
other prompt gets the response budget its length leaves.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from tokenizers import models as tokenizer_models

from grpo import data
from grpo.config import ConfigError, RunConfig
from grpo.devices import sampler_device
from grpo.episodes import adapters, templates
from grpo.episodes.chat import with_thinking
from grpo.episodes.loop import Start
from grpo.episodes.workers import GRACE_S, Workers, probe
from grpo.record import pins
from grpo.record.checkpoint import local_checkpoint, policy_folders, tokenizer_and_config
from grpo.record.layout import Salt, iteration_seed
from grpo.record.storage import Committed
from grpo.runtime.pool import WARM_POOLS
from grpo.sampling.base import Generator, stop_token_ids
from grpo.sampling.engines import choose_backend, engine_settings, get_generator
from grpo.sampling.rollout_func import PREFIX as ROLLOUT_FUNC_PREFIX
from grpo.sampling.rollout_func import RolloutFunction
from grpo.tasks import Example, functions, get_task
from stages.common import StageError


def _dataset(uri: str, cfg: RunConfig) -> tuple[Example, ...]:
    """The usable rows of a dataset (task.skip_invalid_rows), refused when it changed since grpo init
    (pins.pinned_version: every read of a dataset by a stage comes through here)."""
    t = cfg.task
    try:
        return data.load_examples(uri, t.prompt_column, t.answer_column, t.skip_invalid_rows, pins.pinned_version(uri))
    except data.DatasetError as e:
        raise StageError(str(e)) from e


def iteration_prompts(cfg: RunConfig, iteration: int) -> list[Example]:
    """The `prompts_per_iteration` training prompts of `iteration`."""
    n, seed = cfg.rollout.prompts_per_iteration, iteration_seed(cfg.seed, iteration, Salt.PROMPTS)
    if cfg.task.dataset:
        train, _ = held_out_split(cfg)
        epochs_seed = iteration_seed(cfg.seed, 0, Salt.EPOCH_DRAWS)  # one seed for every epoch's permutation
        return [train[i] for i in data.draw(len(train), n, iteration, epochs_seed)]
    return get_task(cfg.task.name, **cfg.task.params).generate(n, seed)


def round_prompts(cfg: RunConfig, iteration: int, round: int, start: int) -> list[Example]:
    """Round `round`'s prompts of `iteration` under dynamic sampling (rollout.min_signal_groups): the next
    `prompts_per_iteration` of the epoch order of a dataset, from draw `start + round * n` (`start`: the
    iteration's first draw, stages.dynamic_sampling.draw_start), or of the task generator's stream seeded by the
    iteration. Round 0 of an iteration starting at draw iteration * n is iteration_prompts' list."""
    n = cfg.rollout.prompts_per_iteration
    if cfg.task.dataset:
        train, _ = held_out_split(cfg)
        epochs_seed = iteration_seed(cfg.seed, 0, Salt.EPOCH_DRAWS)
        return [train[i] for i in data.draw_at(len(train), start + round * n, n, epochs_seed)]
    seed = iteration_seed(cfg.seed, iteration, Salt.PROMPTS)  # a generator's first k * n are its first n and more
    return get_task(cfg.task.name, **cfg.task.params).generate((round + 1) * n, seed)[round * n :]


def held_out_split(cfg: RunConfig) -> tuple[list[Example], list[Example]]:
    """(training rows, held-out rows) of task.dataset; all of it trains when eval.dataset is set."""
    rows = _dataset(cfg.task.dataset, cfg)
    if cfg.eval.dataset:
        return list(rows), []
    train, held = data.split(rows, cfg.eval.split_fraction, cfg.eval.seed)
    if not train or not held:
        raise StageError(
            f"task.dataset {cfg.task.dataset}: {len(rows)} rows leave {len(train)} to train on and "
            f"{len(held)} held out at eval.split_fraction={cfg.eval.split_fraction}"
        )
    return train, held


def held_out_config(cfg: RunConfig) -> dict:
    """The settings that choose the held-out rows (part of the identity of every stage that draws)."""
    e = cfg.eval
    return {"dataset": e.dataset, "split_fraction": e.split_fraction, "seed": e.seed}


def eval_prompts(cfg: RunConfig) -> list[Example]:
    """The fixed held-out prompts: eval.dataset, else the held-out split of task.dataset, else the
    task generator's prompts of eval.seed; at most eval.n_prompts, the same every iteration."""
    if cfg.eval.dataset:
        return list(_dataset(cfg.eval.dataset, cfg)[: cfg.eval.n_prompts])
    if cfg.task.dataset:
        return held_out_split(cfg)[1][: cfg.eval.n_prompts]
    return get_task(cfg.task.name, **cfg.task.params).generate(cfg.eval.n_prompts, cfg.eval.seed)


def word_level(tokenizer) -> bool:
    """Whether the tokenizer maps whole words (the tiny models'): only there is `unk` a missing word."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and isinstance(backend.model, tokenizer_models.WordLevel)


@dataclass
class Prompts:
    """An iteration's prompts as the model sees them; those kept, and their own response budgets."""

    model_dir: str
    adapter_dir: str | None  # LoRA: the policy's adapters on top of model_dir
    tokenizer: object
    eos_ids: tuple[int, ...]
    index: list[int]  # position of each kept prompt in the drawn list: its prompt_id
    examples: list[Example]
    texts: list[str]  # rendered: the chat template applied where the prompt format asks
    ids: list[list[int]]
    budgets: list[int]  # min(rollout.max_tokens, context left after the prompt)
    skipped: int
    context: int = 0  # the model's positions (the engine's limit where lower): prompt and response together
    tools: list[dict] | None = None  # episodes: the tools' schemas rendered into each prompt


def policy_and_prompts(
    policy: Committed,
    examples: list[Example],
    cfg: RunConfig,
    base: Committed | None = None,
    tools: list[dict] | None = None,
) -> Prompts:
    """Render and tokenize `examples` for `policy` (a LoRA learn's adapters go on `base`); skip (and
    count) those too long. `tools`: an episode's tools, rendered by the chat template (grpo.episodes.templates.render).

    With a word-level tokenizer a word outside the vocabulary fails, naming the prompt.
    """
    holder, model_dir, adapter_dir = policy_folders(policy, base)
    tokenizer, config = tokenizer_and_config(holder)
    tokenizer = with_thinking(tokenizer, cfg.task.enable_thinking)  # a copy: the cached one stays as loaded
    max_len = config.get_text_config().max_position_embeddings  # a multimodal config holds it in its text part
    if cfg.rollout.backend != "hf" and cfg.rollout.vllm.max_model_len:  # the engine's own limit
        max_len = min(max_len, cfg.rollout.vllm.max_model_len)
    limit = min(max_len - 1, cfg.rollout.max_prompt_tokens or max_len)
    try:
        t = cfg.task
        texts, ids = templates.tokenize_prompts(tokenizer, examples, t.prompt_format, t.system_prompt, tools, limit)
    except data.DatasetError as e:
        raise StageError(f"{cfg.task.dataset or cfg.task.name}: {e}") from e
    if word_level(tokenizer):
        for t, p in zip(texts, ids):
            if p is not None and tokenizer.unk_token_id in p:
                raise StageError(f"prompt {t[:200]!r} has words outside the model's vocabulary")
    keep = [i for i, p in enumerate(ids) if p is not None and len(p) <= limit]
    if not keep:
        raise StageError(
            f"all {len(ids)} prompts are longer than {limit} tokens (rollout.max_prompt_tokens or "
            f"the model's {max_len} positions less one for the response)"
        )
    return Prompts(
        model_dir,
        adapter_dir,
        tokenizer,
        stop_token_ids(tokenizer, model_dir),
        keep,
        [examples[i] for i in keep],
        [texts[i] for i in keep],
        [ids[i] for i in keep],
        [min(cfg.rollout.max_tokens, max_len - len(ids[i])) for i in keep],
        len(ids) - len(keep),
        max_len,
        tools,
    )


def environment_source(cfg: RunConfig, base: Committed | None) -> adapters.Source | None:
    """Where the run's episodes' environment comes from (grpo.episodes.adapters; None: single-turn rollouts), the
    files its settings name read from their copies in the base commit."""
    r, files = cfg.rollout, {}
    named = {"environment": [r.environment] if r.environment else [], "tools": r.tools}
    for setting, specs in named.items():
        if any(functions.is_file_spec(s) for s in specs):
            prefix = adapters.PREFIXES[setting]
            folder = local_checkpoint(base, prefix=prefix)
            for i, spec in enumerate(specs):
                if functions.is_file_spec(spec):
                    files[spec] = f"{folder}/{functions.committed_name(i, spec, prefix)[len(prefix) :]}"
    return adapters.source(r, files)


@dataclass(frozen=True)
class Environments:
    """Where a stage's episodes live: the workers holding their environments, and the tools' schemas every prompt is
    rendered with; both None for single-turn rollouts (episodes without an environment)."""

    workers: Workers | None = None
    tools: list[dict] | None = None


def rollout_function(cfg: RunConfig, base: Committed | None, p: Prompts) -> RolloutFunction | None:
    """rollout.rollout_func as the stage calls it (its file read from the copy in the base commit); None: unset."""
    spec = cfg.rollout.rollout_func
    if spec is None:
        return None
    file = None
    if functions.is_file_spec(spec):
        folder = local_checkpoint(base, prefix=ROLLOUT_FUNC_PREFIX)
        file = f"{folder}/{functions.committed_name(0, spec, ROLLOUT_FUNC_PREFIX)[len(ROLLOUT_FUNC_PREFIX) :]}"
    return RolloutFunction(loaded_rollout_func(spec, file), spec, len(p.tokenizer), p.eos_ids)


def loaded_rollout_func(spec: str | None, file: str | None = None):
    """The function rollout.rollout_func names (None: unset; `file`: its committed copy); one line where it does not
    import or is not there."""
    if spec is None:
        return None
    try:
        return functions.load_object(spec, file, setting="rollout.rollout_func")
    except functions.UserCodeError as e:
        raise ConfigError(str(e)) from e


@contextmanager
def environments(cfg: RunConfig, base: Committed | None):
    """The Environments of a stage's episodes (grpo.episodes.workers; forked before the sampler starts), none for
    single-turn rollouts; an environment that does not build fails in one line."""
    source = environment_source(cfg, base)
    if source is None:
        yield Environments()
        return
    r = cfg.rollout
    adapters.preload(source.kind)  # before the workers fork: rollout.tool_timeout_s bounds the user's code alone
    with WARM_POOLS.pool(r.tool_workers, r.tool_pass_env, "tool") as pool:
        try:
            tools = pool.apply(probe, (source, r.tool_max_memory_mb), timeout=r.tool_timeout_s + GRACE_S)
        except RuntimeError as e:
            where = f"rollout.environment {r.environment!r}" if r.environment else f"rollout.tools {r.tools}"
            raise StageError(f"{where}: {e}") from e
        yield Environments(Workers(pool, source, r.tool_max_memory_mb), tools)


def episode_starts(p: Prompts, chunk: slice, cfg: RunConfig, started: int = 0) -> list[Start]:
    """Where each prompt of `chunk` starts its episodes (grpo.episodes.loop.Start): its chat messages and the dataset
    row reset gets (every column under its own name, as TRL's `reset(**row)`), its rendered prompt, and what its rows
    record; `started`: the iteration that drew it."""
    t = cfg.task
    return [
        Start(
            i,
            templates.chat_messages(e.prompt, t.system_prompt),
            {t.prompt_column: e.prompt, t.answer_column: e.ground_truth, **(e.row or {})},
            text,
            ids,
            budget,
            e.ground_truth,
            data.row_json(e),
            started,
        )
        for i, e, text, ids, budget in zip(
            p.index[chunk], p.examples[chunk], p.texts[chunk], p.ids[chunk], p.budgets[chunk]
        )
    ]


def sampler(p: Prompts, cfg: RunConfig) -> tuple[Generator, dict]:
    """The live generator for the prompts' checkpoint (started, woken, or reloaded in place) and what
    it runs with: backend, dtype and engine settings, for the manifest's summary."""
    backend, why = choose_backend(cfg.rollout.backend, p.model_dir, sampler_device(cfg.rollout))
    settings = engine_settings(backend, cfg.rollout, cfg.model.dtype, p.model_dir, cfg.learn.lora)
    gen = get_generator(backend, p.model_dir, adapter_dir=p.adapter_dir, **settings)
    return gen, {"backend": backend, "why": why, **settings, "logprobs_dtype": gen.logprobs_dtype}
