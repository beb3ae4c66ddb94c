"""What a stage's identity covers, and the policy that keeps committed stages theirs when the code changes.

A stage's identity is (run, iteration, stage, the hash of the config it reads, the manifests of its inputs)
(`stage_identity`): run again with the same identity, a stage reuses its commit. The config a stage hashes is
made of sections read through `section`, and every field of those sections is decided here, once:
- IDENTITY_FIELDS: covered by identities since runs were first committed; changing one makes a new stage;
- ADDED_SETTINGS: added after runs were made without them, left out while at the defaults they were added with,
  so the stages those runs committed stay theirs (ADDED_NESTED: the same for a nested section's fields, reward.judge's);
- LEFT_OUT: fields no identity covers (where processes run, shards, when evals run and how they are read).
A new field in none of them makes every identity that reads its section fail (UndecidedSetting), and
tests/test_identity.py fails until it is decided. CHANGED_DEFAULTS: defaults changed after runs were made
with the old one, which such runs keep. A renamed field (grpo.config.RENAMED) keeps its old name in identities.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from grpo.config import RENAMED, ConfigError, RunConfig, load_config
from schemas.manifest import InputRef

IDENTITY_FIELDS = {
    "task": (
        "name", "params", "dataset", "prompt_column", "answer_column", "prompt_format", "system_prompt",
        "skip_invalid_rows",
    ),
    "model": (
        "base_model", "hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position_embeddings",
        "tie_embeddings", "initializer_range", "arch", "dtype",
    ),
    "rollout": (
        "backend", "prompts_per_iteration", "group_size", "temperature", "top_p", "max_tokens", "stop",
        "max_prompt_tokens", "chunk_prompts", "vllm", "keep_engine",
    ),
    "reward": (
        "functions", "weights", "workers", "timeout_s", "max_error_fraction", "truncated_reward", "max_memory_mb",
    ),
    "advantage": ("mode", "eps", "filter_zero_variance"),
    "learn": (
        "loss_type", "agg_mode", "epochs", "minibatch_size", "microbatch_size", "lr", "lr_decay_steps",
        "weight_decay", "betas", "max_grad_norm", "clip_eps", "clip_eps_high", "kl_coef", "kl_estimator",
        "num_processes", "behavior_correction", "tis_cap", "mixed_precision", "gradient_checkpointing",
        "logprob_chunk", "max_logprob_gap", "lora", "sharding",
    ),
    "eval": ("n_prompts", "seed", "dataset", "split_fraction", "samples_per_prompt"),
    "sft": (
        "source", "dataset", "split", "teacher", "samples_per_prompt", "prompts", "history_run", "history_sql",
        "epochs", "steps", "lr", "minibatch_size", "microbatch_size", "max_tokens", "gate_pass_at_k", "gate_k",
    ),
    "teacher": ("model", "revision", "mode", "coef", "top_k", "gkd_coef", "routes", "route_column"),
}  # fmt: skip
"""Per section, the fields every identity reading it has covered since runs were first committed."""

ADDED_SETTINGS = {
    "task": (("enable_thinking",),),
    "learn": (
        ("dual_clip_c",), ("ref_update_every",), ("old_logprobs",), ("padding_free",),
        ("behavior_level", "mis_bounds", "icepop_bounds"), ("microbatch_tokens",),
        ("logprob_kernel",), ("max_token_age",),
    ),
    "reward": (("overlong_buffer", "overlong_penalty"), ("judge",)),
    "rollout": (
        ("min_signal_groups", "max_sampling_rounds"), ("staleness",),
        ("tools", "environment", "max_turns", "tool_timeout_s", "tool_workers", "tool_max_memory_mb"),
        ("segment_tokens",), ("max_observation_bytes",), ("rollout_func",),
    ),
    "eval": (("correct",),),
    "teacher": (("backend",),),
}  # fmt: skip
"""Settings added after runs were made without them, per section, in groups that act together: an identity
leaves a group out while all of it holds its defaults (what runs did before it existed)."""

ADDED_NESTED = {("reward", "judge"): {"backend": "auto"}}
"""Fields added to a nested section (a dict field of a section) after runs were made with it, with the defaults they
were added with: an identity leaves each out while it holds that default."""

LEARN_PLACEMENT = ("nodes", "processes_per_node", "node_timeout_s", "state_every", "device")
"""Where the learner's processes run (and on which device the in-process one trains), how long they wait for each
other and how often their resume state is committed, not what they compute (rank r does the same work on any node;
a replayed update is the committed one; devices of one kind train alike, as the machine is no identity's either):
free to change for an existing run."""

EVAL_READING = ("every", "metric")
"""When evals run and which figure is read as the best: committed evals and skips stay when they change."""

LEFT_OUT = {
    "learn": LEARN_PLACEMENT,
    "eval": EVAL_READING,
    # 1 and N shards sample the same rows; which device samples them (as learn.device); which credentials tools read
    "rollout": ("shards", "device", "tool_pass_env"),
    "reward": ("shards", "pass_env"),  # and score them alike; which credentials reward code may read
    "tracking": ("backend", "uri", "project", "dir"),
    "retention": ("keep_last", "keep_every"),
    "teacher": ("batch_size", "device"),  # how many responses a forward scores, and where: the same log-probs
}
"""Per section, the fields no identity covers."""


class UndecidedSetting(ConfigError):
    """A config field that IDENTITY_FIELDS, ADDED_SETTINGS and LEFT_OUT all leave undecided."""


def undecided(cfg: RunConfig) -> list[str]:
    """`section.field` of every field of cfg's sections that no list here decides."""
    out = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(value):
            continue
        added = {k for group in ADDED_SETTINGS.get(f.name, ()) for k in group}
        decided = set(IDENTITY_FIELDS.get(f.name, ())) | added | set(LEFT_OUT.get(f.name, ()))
        out += [f"{f.name}.{x.name}" for x in dataclasses.fields(value) if x.name not in decided]
    return out


def section(cfg: RunConfig, name: str) -> dict:
    """Section `name` of cfg as identities cover it: LEFT_OUT fields and ADDED_SETTINGS groups at their defaults
    left out. Raises UndecidedSetting for a field not decided here."""
    if missing := [m for m in undecided(cfg) if m.startswith(f"{name}.")]:
        raise UndecidedSetting(
            f"{', '.join(missing)}: decide what identities make of it in grpo/record/identity.py (ADDED_SETTINGS, to "
            "keep the stages runs committed without it; IDENTITY_FIELDS; or LEFT_OUT)"
        )
    values = {k: v for k, v in cfg.to_dict()[name].items() if k not in LEFT_OUT.get(name, ())}
    # a group's defaults as they were when it was added, before any later change of them (CHANGED_DEFAULTS)
    fields = dataclasses.fields(getattr(cfg, name))
    defaults = {f.name: CHANGED_DEFAULTS.get((name, f.name), (_default(f),))[0] for f in fields}
    defaults = {k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items()}  # as to_dict writes them
    groups = ADDED_SETTINGS.get(name, ())
    idle = {k for group in groups if all(values[k] == defaults[k] for k in group) for k in group}
    for (where, sub), added in ADDED_NESTED.items():
        if where == name and isinstance(values.get(sub), dict):
            values[sub] = {k: v for k, v in values[sub].items() if k not in added or v != added[k]}
    old_names = {new: old for (where, old), new in RENAMED.items() if where == name}  # a renamed field's key stays
    return {old_names.get(k, k): v for k, v in values.items() if k not in idle}


def _default(f: dataclasses.Field):
    """A config field's default, a list's (default_factory) included."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


CHANGED_DEFAULTS = {("learn", "mixed_precision"): ("no", "auto"), ("learn", "old_logprobs"): ("recompute", "auto")}
"""Defaults changed after runs were made with the old one, (section, field): (old default, new default). A run
that holds the old default keeps it when a config at the new default (one that does not set the field) comes
to it again (stages.init.write_run_json), a run.json written before the field existed reads as the old default
(stored_config), and a setting added later (ADDED_SETTINGS) is left out of identities at its old default: a
scheduled deployment's run goes on as it started."""


def stored_config(raw: dict | None) -> RunConfig:
    """A run.json's config: load_config, where a field whose default changed (CHANGED_DEFAULTS) and that the
    stored config lacks (written before the field existed) holds the old default, which it ran with, and a field
    stored under its old name (grpo.config.RENAMED) reads as the new one."""
    if isinstance(raw, dict):
        raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
        for (section, old), new in RENAMED.items():  # written before the rename
            if isinstance(raw.get(section), dict) and old in raw[section]:
                raw[section][new] = raw[section].pop(old)
        for (section, name), (was, _) in CHANGED_DEFAULTS.items():
            if isinstance(raw.get(section), dict):
                raw[section].setdefault(name, was)
    return load_config(raw)


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


# change only with tests test_new_attempt_never_overwrites_and_identity_lookup,
# test_rerun_is_noop_and_force_adds_attempt_without_touching_old and test_warm_iterations_commit_what_cold_ones_do
# in view
def stage_identity(run_id: str, iteration: int | None, stage: str, cfg_hash: str, inputs: dict[str, InputRef]) -> str:
    key = {
        "run_id": run_id,
        "iteration": iteration,
        "stage": stage,
        "config_hash": cfg_hash,
        "inputs": {k: v.manifest_sha256 for k, v in sorted(inputs.items())},
    }
    return config_hash(key)


def lineage_identity(iteration: int | None, stage: str, cfg_hash: str, origins: dict[str, str]) -> str:
    """What a stage computes, whichever run computes it: stage_identity without the run id, each input named by
    the manifest sha256 of its origin (the attempt first committed with its files: a fork's attempt that takes
    its parent's by reference stands for that attempt). A fork reuses, by reference, the attempt of its parent
    (or an earlier ancestor) at the same iteration and stage whose lineage identity equals its own (grpo.record.fork):
    same config section, same inputs, so the same output. stage_identity keeps the run id, so the stages a
    run committed stay its own and every committed identity is unchanged."""
    key = {"iteration": iteration, "stage": stage, "config_hash": cfg_hash, "inputs": dict(sorted(origins.items()))}
    return config_hash(key)
