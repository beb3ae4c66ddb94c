"""Any value in any config field gives a valid config or a ConfigError naming the field, never another
exception (property-based: hypothesis throws values of every kind at every field)."""

import dataclasses
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from grpo.config import OPTIONAL_SECTIONS, ConfigError, RunConfig, _hints, _merge, load_config, optional_dataclass

# config fields whose values name files, modules or models: a wrong one fails at `grpo init` (which
# loads them) with a ConfigError too, but that needs a run; here only their types are checked
NAMES_THINGS = {"task.dataset", "eval.dataset", "model.base_model", "reward.functions", "tracking.uri", "tracking.dir"}


def field_paths(cls=RunConfig, prefix=""):
    for f in dataclasses.fields(cls):
        hint = _hints(cls)[f.name]
        if dataclasses.is_dataclass(optional_dataclass(hint)):
            if hint is not optional_dataclass(hint):
                yield f"{prefix}{f.name}"  # the section itself may be null
            hint = optional_dataclass(hint)
            yield from field_paths(hint, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


FIELDS = sorted(field_paths())
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        ["auto", "hf", "vllm", "k3", "bf16", "bfloat16", "sort", "position", "tensorboard", "none", "gspo", "cispo"]
        + ["exact_match", "avg_at_k", "pass_at_k", "reward_mean", "sampler", "recompute"]
        + ["tis", "mis", "icepop", "token", "sequence", "geometric"]
    ),
    st.lists(st.one_of(st.integers(-5, 5), st.floats(), st.text(max_size=4)), max_size=4),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


def nested(path: str, value) -> dict:
    *parents, leaf = path.split(".")
    out = {leaf: value}
    for p in reversed(parents):
        out = {p: out}
    return out


def test_every_field_is_covered():
    assert len(FIELDS) >= 74 and "rollout.vllm.gpu_memory_utilization" in FIELDS and "learn.betas" in FIELDS
    assert set(ADDED) <= set(FIELDS)


# settings added with the loss variants, overlong shaping and reference refresh, thrown at harder (alone and
# beside the settings they depend on)
ADDED = ["learn.dual_clip_c", "reward.overlong_buffer", "reward.overlong_penalty", "learn.ref_update_every"]
ADDED += ["eval.every", "eval.metric"]
BESIDE = [
    {},
    {"learn": {"loss_type": "gspo"}},
    {"learn": {"loss_type": "cispo"}},
    {"rollout": {"max_tokens": 64}},
    {"learn": {"kl_coef": 0.1}},
    {"learn": {"kl_coef": 0.1, "lora": {}}},
    {"eval": {"samples_per_prompt": 4}},
]
ADDED += ["rollout.min_signal_groups", "rollout.max_sampling_rounds"]  # dynamic sampling
BESIDE += [{"rollout": {"min_signal_groups": 32}}, {"rollout": {"shards": 2, "chunk_prompts": 128}}]
ADDED += ["learn.old_logprobs"]  # pi_old from the sampler
BESIDE += [{"learn": {"behavior_correction": "tis"}}, {"learn": {"max_logprob_gap": 0.1}}]
ADDED += ["rollout.staleness", "learn.behavior_level", "learn.mis_bounds", "learn.icepop_bounds"]  # issue 32
BESIDE += [{"learn": {"behavior_correction": c}} for c in ("mis", "icepop")] + [{"rollout": {"staleness": 2}}]


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(FIELDS), value=VALUES)
@example(path="sft", value=None)
@example(path="teacher", value=None)
def test_any_value_in_any_field_is_a_valid_config_or_a_config_error_naming_a_field(path, value):
    try:
        cfg = load_config(nested(path, value))
    except ConfigError as e:
        message = str(e)
        assert "\n" not in message, message  # one line
        # names the field, or (a cross-field check) another field the value conflicts with
        named = re.findall(r"\b([a-z_]+\.[a-z_]+(?:\.[a-z_]+)?)\b", message)
        assert path in message or set(named) & set(FIELDS) or path.split(".")[0] in message, (path, value, message)
        return
    got = {**dict.fromkeys(OPTIONAL_SECTIONS), **cfg.to_dict()}  # to_dict leaves unset optional sections out
    for key in path.split("."):
        got = got[key]
    if value is False and got == "no":  # a choice of "no": YAML reads a bare `no` as false (config._coerce)
        return
    if path not in NAMES_THINGS and value is not None and not isinstance(value, (dict, list)):
        assert got == value or float(got) == float(value), (path, value, got)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(ADDED), value=VALUES, beside=st.sampled_from(BESIDE))
def test_added_settings_give_a_valid_config_or_a_config_error_naming_them(path, value, beside):
    try:
        cfg = load_config(_merge(beside, nested(path, value)))
    except ConfigError as e:
        assert "\n" not in str(e) and path in str(e), (path, value, str(e))
        return
    got = {**dict.fromkeys(OPTIONAL_SECTIONS), **cfg.to_dict()}  # to_dict leaves unset optional sections out
    for key in path.split("."):
        got = got[key]
    assert got == value or float(got) == float(value), (path, value, got)


@pytest.mark.parametrize(
    "overrides,error",
    [
        (["learn.loss_type=gspo", "learn.clip_eps=3e-4", "learn.clip_eps_high=4e-4"], None),  # GSPO's ranges
        (["learn.dual_clip_c=3"], None),
        (["learn.loss_type=gspo", "learn.dual_clip_c=3"], None),
        (["learn.dual_clip_c=1"], "learn.dual_clip_c must be > 1"),
        (["learn.loss_type=cispo", "learn.dual_clip_c=3"], "learn.dual_clip_c"),
        (["rollout.max_tokens=64", "reward.overlong_buffer=16", "reward.overlong_penalty=0.5"], None),
        (["reward.overlong_buffer=5"], None),  # the whole response budget (rollout.max_tokens=5)
        (["reward.overlong_buffer=6"], "reward.overlong_buffer must be in .1, rollout.max_tokens=5."),
        (["reward.overlong_buffer=0"], "reward.overlong_buffer"),
        (["reward.overlong_buffer=4", "reward.overlong_penalty=-1"], "reward.overlong_penalty must be >= 0"),
        (["rollout.min_signal_groups=32", "rollout.max_sampling_rounds=5"], None),  # a minibatch's groups
        (["rollout.min_signal_groups=31"], r"rollout.min_signal_groups must be in \[learn.minibatch_size"),
        (["rollout.min_signal_groups=257"], "rollout.min_signal_groups must be in"),
        (["rollout.max_sampling_rounds=0"], "rollout.max_sampling_rounds must be >= 1"),
        (["rollout.min_signal_groups=64", "rollout.shards=2", "rollout.chunk_prompts=128"], "rollout.shards=2"),
        (["learn.kl_coef=0.05", "learn.ref_update_every=1"], None),
        (["learn.kl_coef=0.05", "learn.ref_update_every=0"], "learn.ref_update_every must be >= 1"),
        (["learn.ref_update_every=2"], "learn.ref_update_every .* needs learn.kl_coef > 0"),  # nothing to refresh
        (
            ["learn.kl_coef=0.05", "learn.lora={}", "learn.ref_update_every=2"],
            "learn.ref_update_every .* no learn.lora",
        ),
        (["eval.every=5", "eval.metric=reward_mean"], None),
        (["eval.samples_per_prompt=4", "eval.metric=avg_at_k"], None),
        (["eval.every=0"], "eval.every must be >= 1"),
        (["eval.metric=pass_at_k"], "eval.metric pass_at_k needs eval.samples_per_prompt > 1"),
        (["eval.metric=accuracy"], "eval.metric: 'accuracy' is not one of"),
        (["rollout.staleness=2", "learn.behavior_correction=mis", "learn.behavior_level=geometric"], None),
        (["learn.behavior_correction=icepop", "learn.icepop_bounds=[0.4, 4]"], None),
        (["rollout.staleness=-1"], "rollout.staleness must be >= 0"),
        (["learn.behavior_correction=icepop", "learn.behavior_level=sequence"], "learn.behavior_level=sequence"),
        (["learn.mis_bounds=[1.5, 3]"], r"learn.mis_bounds must be \[low, high\] with 0 <= low <= 1 <= high"),
        (["learn.icepop_bounds=[0.5]"], "learn.icepop_bounds: expected two numbers"),
        (["learn.behavior_correction=ppo"], "learn.behavior_correction: 'ppo' is not one of"),
        (["learn.importance_correction=tis"], "'learn.importance_correction' is now learn.behavior_correction"),
        (["learn.old_logprobs=sampler", "learn.behavior_correction=mis"], "learn.behavior_correction"),
    ],
)
def test_added_settings_hand_picked(overrides, error):
    if error is None:
        load_config(None, overrides)
        return
    with pytest.raises(ConfigError, match=error):
        load_config(None, overrides)


@pytest.mark.parametrize("raw", [None, [], "x", 3, {"learn": None}, {"learn": []}, {"nope": {}}])
def test_a_config_that_is_not_a_mapping_of_sections_is_a_config_error(raw):
    if raw is None:
        assert load_config(raw) == RunConfig()
        return
    with pytest.raises(ConfigError):
        load_config(raw)
