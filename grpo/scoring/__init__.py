"""The reward engine: scoring samples with verifiable rewards in supervised worker processes, and with a teacher.

  score.py    scoring samples: time limits, errors, the allowed error share, shaping applied
  shaping.py  pure reward shaping: truncated responses, DAPO's overlong punishment
  teacher.py  a teacher model's log-probs of the committed token ids (on-policy distillation), its pin and vocabulary

Its workers are grpo/runtime/pool.py's, which the episode engine's environments run in too. The reward functions
themselves: grpo/tasks/ (a registry of tasks, and the user's reward.functions).
"""
