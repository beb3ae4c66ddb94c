"""What a task is (the Task protocol) and gives (Example), and what a reward function of an episode is given beside its
dataset row (its environment's final state and its conversation: `episode_arguments`); the registry is
grpo/tasks/__init__.py."""

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


EPISODE_ARGUMENTS = ("environment", "messages")
"""What a reward function of an episode run may take beside the dataset's columns: the episode's environment as it
ended (FinalState; None when it stored nothing) and its conversation after the prompt (chat messages: each assistant
turn, each tool or observation message appended)."""


class FinalState:
    """An episode's environment as a reward function sees it (its `environment` argument): the final state `final()`
    stored, its keys as attributes (`environment.solved`) and items (`environment["solved"]`); a TRL class's
    `get_reward()` answers what it returned when the episode ended.

    >>> env = FinalState({"solved": True, "get_reward": 1.0})
    >>> env.solved, env["solved"], env.get_reward()
    (True, True, 1.0)
    """

    def __init__(self, state: dict):
        self.__dict__["_state"] = dict(state)

    def __getattr__(self, name: str):
        state = self.__dict__["_state"]
        if name == "get_reward" and "get_reward" in state:
            return lambda: state["get_reward"]
        try:
            return state[name]
        except KeyError:
            raise AttributeError(f"the environment's final state has no {name!r} (it holds {sorted(state)})") from None

    def __getitem__(self, name: str):
        return self.__dict__["_state"][name]

    def __repr__(self) -> str:
        return f"FinalState({self.__dict__['_state']!r})"

    def __reduce__(self):
        return FinalState, (self.__dict__["_state"],)


def episode_arguments(final: dict | None, messages: list[dict]) -> dict:
    """What a reward function is given of an episode beside its dataset row (EPISODE_ARGUMENTS): its environment's
    final state and its conversation after the prompt, as sampled or as its episodes row stored them.

    >>> args = episode_arguments({"solved": True}, [{"role": "assistant", "content": "6"}])
    >>> args["environment"].solved, args["messages"][0]["content"], episode_arguments(None, [])["environment"]
    (True, '6', None)
    """
    return {"environment": None if final is None else FinalState(final), "messages": messages}
