"""Arrow schemas of every Parquet table a stage writes, declared once.

Column names match the argument names of the math in `grpo.core` (`prompt_id`,
`response_ids`, `old_logprobs`, `reward`, `advantage`). Each file carries its
table name and schema version in the Parquet key-value metadata; readers check
both, then every column's presence and type, and name the file and field when
something is off.
"""

from __future__ import annotations

import pyarrow as pa

from schemas.files import OPTIONAL_TABLES, TABLE_FILES, table_file  # noqa: F401 (where each table lives)

SCHEMA_VERSION = 5  # 2: logprobs.ref_logprobs and learn_metrics.kl may be null (no reference scored)
# 3: rollouts.row (the dataset's other columns), eval.avg_at_k and eval.pass_at_k
# 4: rollouts.policy_version is the policy that sampled the row (rollout.staleness), the checkpoint hash it held
#    is rollouts.policy_hash; a version 3 rollouts file reads as version 4 (UPGRADES)
# 5: rollouts.loss_mask (which tokens of an episode the sampler produced) and rollouts.token_versions (the policy that
#    sampled each token; null: the row's policy_version); an older rollouts file reads as all ones and null; the
#    turns and episodes tables (rollout.tools, rollout.environment)
# the carried and segments tables (rollout.segment_tokens) are new tables, no other changed: still version 5, so every
# file a run without them writes keeps its bytes (the version is in each file's metadata); so is the judge table
# (reward.judge)

_KEYS = [  # identify one sample: (run, iteration, prompt, sample within the group)
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("iteration", pa.int32(), nullable=False),
    pa.field("prompt_id", pa.int64(), nullable=False),
]
_SAMPLE_KEYS = _KEYS + [pa.field("sample_index", pa.int32(), nullable=False)]
_IDS = pa.list_(pa.int32())
FLOAT_LISTS = pa.list_(pa.float32())
MASKS = pa.list_(pa.int8())

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
        pa.field("sampler_logprobs", FLOAT_LISTS, nullable=False),  # log-prob of each sampled token, 0.0 elsewhere
        # one entry per token of response_ids: 1 where the sampler produced it, 0 on the observation, tool-result and
        # chat-template tokens an episode appends between turns; the learner trains on the 1s only
        pa.field("loss_mask", MASKS, nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),  # "stop" | "length"
        pa.field("ground_truth", pa.string(), nullable=False),
        pa.field("row", pa.string(), nullable=False),  # JSON object: the dataset row's other columns
        # the policy that sampled the row: the iteration of the learn that committed it, -1 for the base
        pa.field("policy_version", pa.int32(), nullable=False),
        pa.field("policy_hash", pa.string(), nullable=False),  # its checkpoint's content hash (16 hex digits)
        # the policy version that sampled each token of response_ids (a response continued across iterations holds
        # several); null: every token was sampled by the row's policy_version
        pa.field("token_versions", _IDS, nullable=True),
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

TEACHER = pa.schema(  # teacher: a row per sample, the teacher's view of its committed token ids (stages/teacher.py)
    _SAMPLE_KEYS
    + [
        pa.field("teacher", pa.string(), nullable=False),  # the teacher that scored it (teacher.model or a route's)
        # one entry per token of response_ids: the teacher's log-prob of that token after the prompt and the tokens
        # before it (float32 forward), 0.0 where loss_mask is 0 (an episode's observation tokens: context only)
        pa.field("teacher_logprobs", FLOAT_LISTS, nullable=False),
        # teacher.top_k: per loss token, the teacher's k most likely ids and their log-probs, and the probability
        # mass outside them (the tail); null: top-k not asked
        pa.field("topk_ids", pa.list_(_IDS), nullable=True),
        pa.field("topk_logprobs", pa.list_(FLOAT_LISTS), nullable=True),
        pa.field("topk_tail", FLOAT_LISTS, nullable=True),
    ]
)

TOKEN_ADVANTAGES = pa.schema(  # advantages with a teacher: a row per kept or dropped sample, one advantage a token
    _SAMPLE_KEYS
    + [
        # grpo.core.teacher_advantages: coef * -(sampler - teacher log-prob), alone or plus the sample's advantage;
        # 0 where loss_mask is 0
        pa.field("token_advantage", FLOAT_LISTS, nullable=False),
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
        pa.field("token_start", pa.int32(), nullable=False),  # its sampled ids: response_ids[token_start:token_end]
        pa.field("token_end", pa.int32(), nullable=False),
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
        pa.field("ended_by", pa.string(), nullable=False),  # "done" | "max_turns" | "budget" | "lost" (grpo/episodes)
        pa.field("messages", pa.string(), nullable=False),  # JSON: the conversation after the prompt
        pa.field("environment", pa.string(), nullable=True),  # JSON: the environment's final state; null: none
    ]
)

CARRIED = pa.schema(  # rollout.segment_tokens: a row per response the rollouts stage hands on to the next iteration's
    _SAMPLE_KEYS  # prompt_id: the group's place in the run's prompts, started x prompts_per_iteration + its place there
    + [
        pa.field("started", pa.int32(), nullable=False),  # the iteration whose prompts its group was among
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("prompt_ids", _IDS, nullable=False),
        pa.field("budget", pa.int32(), nullable=False),  # its most tokens after the prompt (max_tokens, context)
        pa.field("response_ids", _IDS, nullable=False),  # so far: the next segment continues from exactly these
        pa.field("sampler_logprobs", FLOAT_LISTS, nullable=False),
        pa.field("loss_mask", MASKS, nullable=False),
        pa.field("token_versions", _IDS, nullable=False),  # the policy version that sampled each token
        pa.field("finish_reason", pa.string(), nullable=True),  # null: not ended, continued; else its group waits
        pa.field("ground_truth", pa.string(), nullable=False),
        pa.field("row", pa.string(), nullable=False),
        pa.field("policy_hash", pa.string(), nullable=False),  # of the policy that sampled its newest token
        pa.field("episode", pa.string(), nullable=True),  # JSON: an episode's conversation and turns so far; null: none
    ]
)

SEGMENTS = pa.schema(  # rollout.segment_tokens: a row per response an iteration held, what became of it there
    _SAMPLE_KEYS
    + [
        pa.field("started", pa.int32(), nullable=False),  # the iteration whose prompts its group was among
        pa.field("tokens_before", pa.int32(), nullable=False),  # its response_ids when the iteration began
        pa.field("tokens", pa.int32(), nullable=False),  # and when it ended
        pa.field("sampled", pa.int32(), nullable=False),  # of those, tokens this iteration's policy sampled
        # released (its group went on to rewards and learn), finished (ended; its group waits) or carried (unfinished)
        pa.field("state", pa.string(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=True),  # null while unfinished
        pa.field("policy_version", pa.int32(), nullable=False),  # the policy this iteration sampled with
    ]
)

JUDGE = pa.schema(  # reward.judge: a row per rewards row, the judge call that scored it (a group's call: ranking)
    _SAMPLE_KEYS
    + [
        pa.field("judge_revision", pa.string(), nullable=False),  # hub id@commit, folder:<hash>, or model@url
        pa.field("prompt_hash", pa.string(), nullable=False),  # sha256 of the call's messages and sampling settings
        pa.field("raw", pa.string(), nullable=True),  # the judge's answer as written; null: every try failed
        pa.field(  # each criterion's (ranking: the response's rank) reason, verdict and its score; null: no parse
            "verdicts",
            pa.list_(
                pa.struct(
                    [
                        pa.field("criterion", pa.string(), nullable=False),
                        pa.field("reason", pa.string(), nullable=False),
                        pa.field("verdict", pa.string(), nullable=False),
                        pa.field("score", pa.float64(), nullable=False),
                    ]
                )
            ),
            nullable=True,
        ),
        pa.field("score", pa.float64(), nullable=False),  # in [0, 1]; reward.judge.parse_error_reward on an error
        pa.field("error", pa.string(), nullable=True),  # what did not parse, or the last try's failure
        pa.field("attempts", pa.int32(), nullable=False),  # calls made for it by this attempt; 0: from the cache
        pa.field("cached", pa.bool_(), nullable=False),  # its answer came from the judge cache
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

SFT = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("conversation", pa.int64(), nullable=False),  # its place among the source's conversations
        pa.field("source", pa.string(), nullable=False),  # sft.source: dataset, teacher or history
        # JSON object: where it came from (a dataset row; a teacher's prompt and sample; a run's iteration and sample)
        pa.field("origin", pa.string(), nullable=False),
        pa.field("messages", pa.string(), nullable=False),  # JSON list of the chat messages
        pa.field("prompt_ids", _IDS, nullable=False),  # the messages before the first assistant turn, rendered
        pa.field("response_ids", _IDS, nullable=False),  # every token after them (cut at sft.max_tokens)
        pa.field("loss_mask", MASKS, nullable=False),  # 1 on the assistant's tokens, the ones trained on
        pa.field("truncated", pa.bool_(), nullable=False),  # cut at sft.max_tokens
        pa.field("draws", pa.int32(), nullable=False),  # how many times the warm start trained on it
    ]
)

SCHEMAS: dict[str, pa.Schema] = {
    "prompts": PROMPTS,
    "rollouts": ROLLOUTS,
    "draws": DRAWS,
    "turns": TURNS,
    "episodes": EPISODES,
    "carried": CARRIED,
    "segments": SEGMENTS,
    "rewards": REWARDS,
    "judge": JUDGE,
    "advantages": ADVANTAGES,
    "teacher": TEACHER,
    "token_advantages": TOKEN_ADVANTAGES,
    "logprobs": LOGPROBS,
    "learn_metrics": LEARN_METRICS,
    "eval": EVAL,
    "sft": SFT,
    "sft_metrics": LEARN_METRICS,
}

ROLLOUTS_V4 = pa.schema([f for f in ROLLOUTS if f.name not in ("loss_mask", "token_versions")])

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
    """A rollouts table of schema version 4 as version 5: every token of a response was sampled (loss_mask all ones,
    as long as its response_ids), by the row's policy (token_versions null).

    >>> new = rollouts_from_v4(pa.table({"response_ids": pa.array([[5, 6], [], [7]], pa.list_(pa.int32()))}))
    >>> new.column("loss_mask").to_pylist(), new.column("token_versions").to_pylist()
    ([[1, 1], [], [1]], [None, None, None])
    """
    import numpy as np
    import pyarrow.compute as pc

    lengths = pc.list_value_length(table.column("response_ids")).to_numpy(zero_copy_only=False)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]), pa.int32())
    ones = pa.array(np.ones(int(lengths.sum()), np.int8))
    table = table.append_column(ROLLOUTS.field("loss_mask"), pa.ListArray.from_arrays(offsets, ones, MASKS))
    table = table.append_column(ROLLOUTS.field("token_versions"), pa.nulls(len(table), _IDS))
    return table.select([n for n in ROLLOUTS.names if n in table.column_names])  # in the declared order


UPGRADES = {"rollouts": ((4, ROLLOUTS_V3, rollouts_from_v3), (5, ROLLOUTS_V4, rollouts_from_v4))}
"""Tables whose older files still read: table -> its changes in order, each (the schema version that changed it,
the schema before, the function that makes a table of the version before that one's)."""
