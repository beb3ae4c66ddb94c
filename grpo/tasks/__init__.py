"""Tasks with verifiable rewards, collected in a registry.

A task scores a response (`reward`). The toy tasks also know their vocabulary
(`words`) and make prompts with known answers (`generate`): their prompts and
responses are space-separated words, so a whitespace word-level tokenizer covers
them. A task without `generate` (`math`) scores a dataset (`task.dataset`).

    >>> task = get_task("sort", n_numbers=3)
    >>> ex = task.generate(1, seed=0)[0]
    >>> task.reward(ex.ground_truth, ex.ground_truth, ex.prompt)["total"]
    1.0
"""

import dataclasses
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Example:
    """One prompt and the answer its reward is checked against."""

    prompt: str | list[dict]
    """Text, or chat messages `{role, content}` (rendered with the model's chat template)."""
    ground_truth: str
    row: dict | None = None
    """A dataset row's other columns, passed to user reward functions as keyword arguments."""


class Task(Protocol):
    """What every task provides; see `sort.SortTask` for an example."""

    name: str

    def words(self) -> list[str]:
        """Every word a prompt or a correct answer can contain."""
        ...

    def generate(self, n: int, seed: int) -> list[Example]:
        """`n` examples, the same ones for the same seed."""
        ...

    def reward(self, response: str, ground_truth: str, prompt: str) -> dict[str, float]:
        """Named reward components in [0, 1]; `"total"` is the scalar reward."""
        ...


# imported after Example is defined: the task modules import it from here
from grpo.tasks.arithmetic import ArithmeticTask  # noqa: E402
from grpo.tasks.math import MathTask  # noqa: E402
from grpo.tasks.sort import SortTask  # noqa: E402

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
