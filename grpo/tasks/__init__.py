"""Tasks with verifiable rewards, collected in a registry.

A task scores a response (`reward`). The toy tasks also know their vocabulary
(`words`) and make prompts with known answers (`generate`): their prompts and
responses are space-separated words, so a whitespace word-level tokenizer covers
them. A task without `generate` (`math`) scores a dataset (`task.dataset`).

  base.py        Task and Example: what every task gives
  sort.py        sort a list of numbers (the tiny default: rewards as plain functions with doctests)
  arithmetic.py  small sums and products
  math.py        math answers checked by math-verify, for datasets
  calculator.py  word problems a model answers with a calculator tool (the agents recipe; TRL's environment class)
  functions.py   the user's own reward functions (reward.functions): files and module:name, loaded and checked
  trl_rewards.py reward functions in TRL's shape, called as TRL calls them (completions, environments)

    >>> task = get_task("sort", n_numbers=3)
    >>> ex = task.generate(1, seed=0)[0]
    >>> task.reward(ex.ground_truth, ex.ground_truth, ex.prompt)["total"]
    1.0
"""

import dataclasses

from grpo.tasks.arithmetic import ArithmeticTask
from grpo.tasks.base import Example, Task
from grpo.tasks.math import MathTask
from grpo.tasks.sort import SortTask

__all__ = ["Example", "Task", "TASKS", "generates", "get_task"]


TASKS: dict[str, type] = {"sort": SortTask, "arithmetic": ArithmeticTask, "math": MathTask}


def get_task(name: str, **params) -> Task:
    """Build the task registered as `name` with its parameters.

    >>> get_task("sort", n_numbers=4).n_numbers
    4
    >>> get_task("nope")
    Traceback (most recent call last):
    ...
    ValueError: unknown task 'nope'; valid tasks: arithmetic, math, sort
    >>> get_task("sort", size=4)
    Traceback (most recent call last):
    ...
    ValueError: unknown parameter 'size' for task 'sort'; valid parameters: n_numbers, max_value, credit
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")
    cls = TASKS[name]
    valid = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in params:
        if key not in valid:
            raise ValueError(f"unknown parameter {key!r} for task {name!r}; valid parameters: {', '.join(valid)}")
    return cls(**params)


def generates(task: Task) -> bool:
    """Whether the task makes its own prompts (else it needs `task.dataset`)."""
    return callable(getattr(task, "generate", None))


__all__ = ["Example", "Task", "TASKS", "get_task", "generates", "SortTask", "ArithmeticTask", "MathTask"]
