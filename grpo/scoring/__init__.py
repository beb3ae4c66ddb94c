"""The reward engine: scoring samples with verifiable rewards in supervised worker processes, with a judge model
and with a teacher.

  score.py    scoring samples: time limits, errors, the allowed error share, shaping applied
  shaping.py  pure reward shaping: truncated responses, DAPO's overlong punishment
  teacher.py  a teacher model's log-probs of the committed token ids (on-policy distillation), its pin and vocabulary
  judge_format.py  a judge's prompt and how its answer is read (reward.judge): pure text
  judge.py    a judge over a stage's rows as one batch: an endpoint or a local model, its cache in storage
  judge_cache.py  where the judge cache lives and which of its answers no committed judge table refers to (`grpo gc`)

Its workers are grpo/runtime/pool.py's, which the episode engine's environments run in too. The reward functions
themselves: grpo/tasks/ (a registry of tasks, and the user's reward.functions).
"""
