"""Word problems a small model cannot do in its head, and the calculator it may call.

A problem multiplies a 2-digit by a 3-digit number, in one of a few sentences:

    Ana packs 23 boxes with 147 coins in each. How many coins is that in all?     ->  3381

`Calculator` is written in TRL's `environment_factory` contract, unchanged on both sides: one instance
per episode, `reset(**row)` with the dataset row, its public methods the tools (name, docstring and
type hints give the schema), and reward functions reading what the episode did from `environments`.
The rewards are TRL reward functions (lists in, a float per completion out):

- `correct_answer`: 1 when the last assistant message ends "The answer is N." with the right N;
- `correct_tool_use`: 1 when the episode called `multiply` with the problem's two numbers.

`reward` is the recipe's reward for grpo-flow's `reward.functions` (one episode in, its components out):
correct_answer + 0.5 x correct_tool_use, from the episode's messages and its environment's final state.

    >>> env = Calculator()
    >>> env.reset(question="...", answer="3381")
    >>> env.multiply(a=23, b=147)
    '3381'
    >>> episode = [{"role": "assistant", "content": "The answer is 3381."}]
    >>> correct_answer([episode], answer=["3381"]), correct_tool_use([episode], environments=[env], answer=["3381"])
    ([1.0], [1.0])
"""

from __future__ import annotations

import random
import re

NAMES = ["Tom", "Ana", "Lee", "Mia", "Sam", "Zoe"]
THINGS = ["apples", "books", "coins", "cards", "shells"]
SYSTEM = "Solve the problem. End with: The answer is N."
_ANSWER = re.compile(r"The answer is (-?\d+)\.?\s*$")


PHRASES = [
    "{name} packs {a} boxes with {b} {thing} in each. How many {thing} is that in all?",
    "{name} has {a} bags of {b} {thing}. How many {thing} does {name} have?",
    "{name} collects {b} {thing} a day for {a} days. How many {thing} is that?",
]


def problem(rng: random.Random) -> dict:
    """One word problem: the product of a 2-digit and a 3-digit number, in one of a few phrasings.
    `answer` is the product as text (a dataset column); `a` and `b` the multiply call that solves it.

    >>> problem(random.Random(0))["question"]
    'Mia packs 44 boxes with 624 cards in each. How many cards is that in all?'
    """
    name, thing, phrase = rng.choice(NAMES), rng.choice(THINGS), rng.choice(PHRASES)
    a, b = rng.randint(11, 99), rng.randint(101, 999)
    return {"question": phrase.format(name=name, thing=thing, a=a, b=b), "answer": str(a * b), "a": a, "b": b}


def final_answer(text: str) -> int | None:
    """The N of a closing "The answer is N."; None when the text does not end so.

    >>> final_answer("The answer is 3381."), final_answer("3381"), final_answer("The answer is 12. Or 13.")
    (3381, None, None)
    """
    match = _ANSWER.search(text.strip())
    return int(match.group(1)) if match else None


class Calculator:
    """A calculator; it remembers the calls of its episode (a, b, result)."""

    def __init__(self):
        self.calls: list[tuple[int, int, int]] = []

    def reset(self, **row) -> None:
        """A new episode for a dataset row (its columns as keywords); nothing is added to the prompt."""
        self.calls: list[tuple[int, int, int]] = []

    def multiply(self, a: int, b: int):
        """Multiply two whole numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return self._record(a, b, int(a) * int(b))

    def _record(self, a: int, b: int, result: int) -> str:
        self.calls.append((int(a), int(b), result))
        return str(result)


def last_assistant(messages: list[dict]) -> str:
    """The text of an episode's last assistant message ("" when there is none).

    >>> last_assistant([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "b"}])
    'a'
    """
    return next((m.get("content") or "" for m in reversed(messages) if m["role"] == "assistant"), "")


def correct_answer(completions: list[list[dict]], answer: list[str], **_) -> list[float]:
    """1.0 for an episode whose last assistant message states the right answer, else 0.0.

    >>> correct_answer([[{"role": "assistant", "content": "The answer is 7."}]], answer=["8"])
    [0.0]
    """
    return [float(final_answer(last_assistant(c)) == int(a)) for c, a in zip(completions, answer)]


def correct_tool_use(completions: list, environments: list[Calculator], answer: list[str], **_) -> list[float]:
    """1.0 for an episode that called the calculator with the problem's two numbers (its result is the
    answer), whatever it did next; calls that miss earn nothing, nor do none.

    >>> env = Calculator()
    >>> env.reset()
    >>> _ = env.multiply(a=23, b=148)
    >>> correct_tool_use([[]], environments=[env], answer=["3381"])
    [0.0]
    """
    return [float(any(r == int(a) for *_, r in env.calls)) for env, a in zip(environments, answer)]


TOOL_USE_WEIGHT = 0.5


def reward(response: str, ground_truth: str, prompt, environment=None, messages=None) -> dict:
    """The recipe's reward of one episode (grpo-flow's reward function form): `correct` + 0.5 x `tool_use`, the
    two TRL rewards above on its conversation (`messages`, the turns after the prompt) and its environment as it
    ended (`environment.calls`).

    >>> env = Calculator()
    >>> env.reset()
    >>> _ = env.multiply(a=23, b=147)
    >>> reward("The answer is 3381.", "3381", "...", env, [{"role": "assistant", "content": "The answer is 3381."}])
    {'correct': 1.0, 'tool_use': 1.0, 'total': 1.5}
    """
    messages = messages if messages is not None else [{"role": "assistant", "content": response}]
    right = correct_answer([messages], [ground_truth])[0]
    used = correct_tool_use([messages], [environment], [ground_truth])[0] if environment is not None else 0.0
    return {"correct": right, "tool_use": used, "total": right + TOOL_USE_WEIGHT * used}
