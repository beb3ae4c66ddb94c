"""The reward engine: scoring samples with verifiable rewards in supervised worker processes.

  score.py    scoring samples: time limits, errors, the allowed error share, shaping applied
  shaping.py  pure reward shaping: truncated responses, DAPO's overlong punishment

Its workers are grpo/runtime/pool.py's, which the episode engine's environments run in too. The reward functions
themselves: grpo/tasks/ (a registry of tasks, and the user's reward.functions).
"""
