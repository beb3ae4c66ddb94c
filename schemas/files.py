"""Where each table is committed: its stage and its file in the stage's attempt. Plain names, no pyarrow: a
reader of manifests (`grpo status`) finds a table's file without loading the schemas of schemas/tables.py."""

# (stage, file in the stage's attempt); `grpo query` makes a view of each
TABLE_FILES: dict[str, tuple[str, str]] = {
    "rollouts": ("rollouts", "rollouts.parquet"),
    "draws": ("rollouts", "draws.parquet"),
    "turns": ("rollouts", "turns.parquet"),
    "episodes": ("rollouts", "episodes.parquet"),
    "carried": ("rollouts", "carried.parquet"),
    "segments": ("rollouts", "segments.parquet"),
    "rewards": ("rewards", "rewards.parquet"),
    "judge": ("rewards", "judge.parquet"),
    "advantages": ("advantages", "advantages.parquet"),
    "teacher": ("teacher", "teacher.parquet"),
    "token_advantages": ("advantages", "token_advantages.parquet"),
    "logprobs": ("learn", "logprobs.parquet"),
    "learn_metrics": ("learn", "metrics.parquet"),
    "eval": ("eval", "eval.parquet"),
    "sft": ("sft", "sft.parquet"),
    "sft_metrics": ("sft", "metrics.parquet"),
}

RUN_TABLES = ("sft", "sft_metrics")
"""Tables of a stage the run commits once (the warm start: `grpo sft`), not every iteration."""

OPTIONAL_TABLES = ("draws", "turns", "episodes", "carried", "segments", "token_advantages", "judge")
"""Tables a stage commits only with a setting on (draws: rollout.min_signal_groups; turns and episodes: rollout.tools
or rollout.environment; carried and segments: rollout.segment_tokens; token_advantages: teacher; judge:
reward.judge); `grpo query` skips an attempt without one. The teacher table's stage runs only with teacher set
(grpo.record.layout.OPTIONAL_STAGES)."""


def table_file(table: str) -> str:
    """The file name a table is committed under, in its stage's attempt."""
    return TABLE_FILES[table][1]
