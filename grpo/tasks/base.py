"""What a task is (the Task protocol) and gives (Example); the registry is grpo/tasks/__init__.py."""

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
