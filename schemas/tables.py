"""Arrow schemas of every Parquet table a stage writes, declared once.

Column names match the argument names of the math in `grpo.core` (`prompt_id`,
`response_ids`, `old_logprobs`, `reward`, `advantage`). Each file carries its
table name and schema version in the Parquet key-value metadata; readers check
both, then every column's presence and type, and name the file and field when
something is off.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 5  # 2: logprobs.ref_logprobs and learn_metrics.kl may be null (no reference scored)
# 3: rollouts.row (the dataset's other columns), eval.avg_at_k and eval.pass_at_k
# 4: rollouts.policy_version is the policy that sampled the row (rollout.staleness), the checkpoint hash it held
#    is rollouts.policy_hash; a version 3 rollouts file reads as version 4 (UPGRADES)
# 5: rollouts.loss_mask (episodes: 0 on the tokens appended between sampled turns), a version 4 rollouts file reads
#    with every token's 1; the turns and episodes tables

_KEYS = [  # identify one sample: (run, iteration, prompt, sample within the group)
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("iteration", pa.int32(), nullable=False),
    pa.field("prompt_id", pa.int64(), nullable=False),
]
_SAMPLE_KEYS = _KEYS + [pa.field("sample_index", pa.int32(), nullable=False)]
_IDS = pa.list_(pa.int32())
FLOAT_LISTS = pa.list_(pa.float32())

PROMPTS = pa.schema(
    _KEYS
    + [
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("ground_truth", pa.string(), nullable=False),
    ]
)

ROLLOUTS = pa.schema(
    _SAMPLE_KEYS
    + [
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("prompt_ids", _IDS, nullable=False),
        pa.field("response", pa.string(), nullable=False),
        pa.field("response_ids", _IDS, nullable=False),
        pa.field("sampler_logprobs", FLOAT_LISTS, nullable=False),  # log-prob of each sampled token (0.0: appended)
        # per response token: 1 sampled (trained on), 0 appended (an episode's observations and template tokens)
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),  # "stop" | "length"
        pa.field("ground_truth", pa.string(), nullable=False),
        pa.field("row", pa.string(), nullable=False),  # JSON object: the dataset row's other columns
        # the policy that sampled the row: the iteration of the learn that committed it, -1 for the base
        pa.field("policy_version", pa.int32(), nullable=False),
        pa.field("policy_hash", pa.string(), nullable=False),  # its checkpoint's content hash (16 hex digits)
    ]
)

DRAWS = pa.schema(  # rollout.min_signal_groups (dynamic sampling): a row per prompt the rollouts stage sampled
    _KEYS
    + [
        pa.field("round", pa.int32(), nullable=False),  # the sampling round that drew it, 0 first
        pa.field("signal", pa.bool_(), nullable=False),  # its group's rewards were unequal when sampled
    ]
)

REWARDS = pa.schema(
    _SAMPLE_KEYS
    + [
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("components", pa.map_(pa.string(), pa.float64()), nullable=False),
        pa.field("error", pa.string(), nullable=True),  # exception or timeout; reward is 0 then
    ]
)

ADVANTAGES = pa.schema(
    _SAMPLE_KEYS
    + [
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("advantage", pa.float64(), nullable=False),
        pa.field("group_mean", pa.float64(), nullable=False),
        pa.field("group_std", pa.float64(), nullable=False),
        pa.field("kept", pa.bool_(), nullable=False),  # false: group dropped (zero reward variance)
    ]
)

LOGPROBS = pa.schema(
    _SAMPLE_KEYS
    + [  # learner's view before any update, for audits
        pa.field("old_logprobs", FLOAT_LISTS, nullable=False),
        pa.field("ref_logprobs", FLOAT_LISTS, nullable=True),  # null: kl_coef 0, no reference scored
    ]
)

LEARN_METRICS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("epoch", pa.int32(), nullable=False),
        pa.field("loss", pa.float64(), nullable=False),
        pa.field("pg_loss", pa.float64(), nullable=False),
        pa.field("kl", pa.float64(), nullable=True),  # null: no reference scored
        pa.field("clip_frac", pa.float64(), nullable=False),
        pa.field("entropy", pa.float64(), nullable=False),
        pa.field("grad_norm", pa.float64(), nullable=False),
        pa.field("ratio_mean", pa.float64(), nullable=False),
        pa.field("ratio_min", pa.float64(), nullable=False),
        pa.field("ratio_max", pa.float64(), nullable=False),
        pa.field("logprob_gap", pa.float64(), nullable=False),  # mean |sampler - trainer| old log-prob
        pa.field("lr", pa.float64(), nullable=False),
        pa.field("n_tokens", pa.int64(), nullable=False),
    ]
)

TURNS = pa.schema(  # episodes (rollout.tools, rollout.environment): a row per sampled assistant turn
    _SAMPLE_KEYS
    + [
        pa.field("turn", pa.int32(), nullable=False),  # 0 first
        pa.field("start", pa.int32(), nullable=False),  # its sampled ids: the rollout's response_ids[start:end]
        pa.field("end", pa.int32(), nullable=False),
        pa.field("text", pa.string(), nullable=False),  # as the model wrote it, its end-of-turn token dropped
        pa.field("finish_reason", pa.string(), nullable=False),  # "stop" | "length" (cut off by the token budget)
        pa.field("tool_names", pa.list_(pa.string()), nullable=False),  # each call's tool, in order ("": unparsed)
        pa.field("tool_arguments", pa.list_(pa.string()), nullable=False),  # each call's arguments, JSON
        pa.field("observation", pa.string(), nullable=True),  # what answered it (its messages' contents); null: none
        pa.field("observation_tokens", pa.int32(), nullable=False),  # tokens appended after it (0: none)
        pa.field("tool_errors", pa.int32(), nullable=False),  # calls that failed (raised, timed out, unknown, unparsed)
        pa.field("error", pa.string(), nullable=True),  # the first of them
        pa.field("policy_version", pa.int32(), nullable=False),  # the policy that sampled it
    ]
)

EPISODES = pa.schema(  # episodes: a row per episode (a rollouts row), how it ended and what its environment left
    _SAMPLE_KEYS
    + [
        pa.field("turns", pa.int32(), nullable=False),
        pa.field("tool_calls", pa.int32(), nullable=False),
        pa.field("tool_errors", pa.int32(), nullable=False),
        pa.field("end", pa.string(), nullable=False),  # "done" | "max_turns" | "budget" | "lost" (grpo/episodes)
        pa.field("messages", pa.string(), nullable=False),  # JSON: the conversation after the prompt
        pa.field("environment", pa.string(), nullable=True),  # JSON: the environment's final state; null: none
    ]
)

EVAL = pa.schema(
    _KEYS
    + [
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("response", pa.string(), nullable=False),
        pa.field("ground_truth", pa.string(), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),  # greedy response
        pa.field("exact", pa.float64(), nullable=False),  # greedy response correct: accuracy
        pa.field("avg_at_k", pa.float64(), nullable=True),  # share of k samples correct; null: k = 1
        pa.field("pass_at_k", pa.float64(), nullable=True),  # any of k samples correct; null: k = 1
    ]
)

SCHEMAS: dict[str, pa.Schema] = {
    "prompts": PROMPTS,
    "rollouts": ROLLOUTS,
    "draws": DRAWS,
    "turns": TURNS,
    "episodes": EPISODES,
    "rewards": REWARDS,
    "advantages": ADVANTAGES,
    "logprobs": LOGPROBS,
    "learn_metrics": LEARN_METRICS,
    "eval": EVAL,
}

# where each table is committed: (stage, file in the stage's attempt); `grpo query` makes a view of each
TABLE_FILES: dict[str, tuple[str, str]] = {
    "rollouts": ("rollouts", "rollouts.parquet"),
    "draws": ("rollouts", "draws.parquet"),
    "turns": ("rollouts", "turns.parquet"),
    "episodes": ("rollouts", "episodes.parquet"),
    "rewards": ("rewards", "rewards.parquet"),
    "advantages": ("advantages", "advantages.parquet"),
    "logprobs": ("learn", "logprobs.parquet"),
    "learn_metrics": ("learn", "metrics.parquet"),
    "eval": ("eval", "eval.parquet"),
}

ROLLOUTS_V4 = pa.schema([f for f in ROLLOUTS if f.name != "loss_mask"])
ROLLOUTS_V3 = pa.schema(
    [f for f in ROLLOUTS_V4 if f.name not in ("policy_version", "policy_hash")]
    + [pa.field("policy_version", pa.string(), nullable=False)]  # then the checkpoint hash
)


def rollouts_from_v3(table: pa.Table) -> pa.Table:
    """A rollouts table of schema version 3 as version 4: its policy_version (the checkpoint hash) is policy_hash,
    and the policy that sampled a row is the previous iteration's learn's (no run was stale then).

    >>> old = pa.table({"iteration": pa.array([0, 2], pa.int32()), "policy_version": ["ab", "cd"]})
    >>> new = rollouts_from_v3(old)
    >>> new.column("policy_version").to_pylist(), new.column("policy_hash").to_pylist()
    ([-1, 1], ['ab', 'cd'])
    """
    import pyarrow.compute as pc

    at = table.schema.get_field_index("policy_version")
    table = table.rename_columns([*table.column_names[:at], "policy_hash", *table.column_names[at + 1 :]])
    version = pc.subtract(table.column("iteration"), pa.scalar(1, pa.int32()))
    table = table.append_column(ROLLOUTS.field("policy_version"), version)
    return table.select([n for n in ROLLOUTS_V4.names if n in table.column_names])  # in the declared order


def rollouts_from_v4(table: pa.Table) -> pa.Table:
    """A rollouts table of schema version 4 as version 5: every response token was sampled (loss_mask 1).

    >>> old = pa.table({"response_ids": pa.array([[5, 6], [], [7]], _IDS)})
    >>> rollouts_from_v4(old).column("loss_mask").to_pylist()
    [[1, 1], [], [1]]
    """
    import numpy as np

    ids = table.column("response_ids").combine_chunks()
    offsets = ids.offsets.to_numpy() - ids.offsets[0].as_py()
    ones = pa.array(np.ones(int(offsets[-1]), dtype=np.int8))
    mask = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), ones, type=ROLLOUTS.field("loss_mask").type)
    table = table.append_column(ROLLOUTS.field("loss_mask"), mask)
    return table.select([n for n in ROLLOUTS.names if n in table.column_names])


UPGRADES = {"rollouts": ((4, ROLLOUTS_V3, rollouts_from_v3), (5, ROLLOUTS_V4, rollouts_from_v4))}
"""Tables whose older files still read: table -> its changes in order, each (the schema version that changed it,
the schema before, the function that makes a table of the schema before that version's)."""

OPTIONAL_TABLES = ("draws", "turns", "episodes")
"""Tables a stage commits only with a setting on (draws: rollout.min_signal_groups; turns and episodes: rollout.tools
or rollout.environment); `grpo query` skips an attempt without one."""


def table_file(table: str) -> str:
    """The file name a table is committed under, in its stage's attempt."""
    return TABLE_FILES[table][1]
