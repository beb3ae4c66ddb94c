"""The reward engine: scoring samples with verifiable rewards in supervised worker processes.

  pool.py     the worker pool (deaths named, hung samples killed, printed output captured) and warm pools
  score.py    scoring samples: time limits, errors, the allowed error share, shaping applied
  shaping.py  pure reward shaping: truncated responses, DAPO's overlong punishment
  secrets.py  credentials kept from reward workers, their values redacted from what comes back

The reward functions themselves: grpo/tasks/ (a registry of tasks, and the user's reward.functions).
"""
