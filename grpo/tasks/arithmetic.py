"""Evaluate a three-operand expression with operator precedence.

Prompt ``"3 + 4 * 2 ="``, answer ``"11"``. Forms: a + b * c, a * b + c and
a + b + c. The reward is all or nothing: total = correct.
"""

import random
import re
from dataclasses import dataclass
from typing import ClassVar

from grpo.tasks.base import Example

_INTEGER = re.compile(r"-?[0-9]+")

# (op1, op2) of each form; '*' binds tighter than '+'
FORMS = (("+", "*"), ("*", "+"), ("+", "+"))


def evaluate(a: int, op1: str, b: int, op2: str, c: int) -> int:
    """Value of `a op1 b op2 c` with '*' before '+'.

    >>> evaluate(3, "+", 4, "*", 2), evaluate(3, "*", 4, "+", 2), evaluate(3, "+", 4, "+", 2)
    (11, 14, 9)
    """
    if op2 == "*":
        return a + b * c if op1 == "+" else a * b * c
    return (a + b if op1 == "+" else a * b) + c


def arithmetic_reward(response: str, ground_truth: str) -> dict[str, float]:
    """`format`: the response is one integer word; `correct`: it is the answer.

    >>> arithmetic_reward("11", "11")
    {'format': 1.0, 'correct': 1.0, 'total': 1.0}
    >>> arithmetic_reward("12", "11")
    {'format': 1.0, 'correct': 0.0, 'total': 0.0}
    >>> arithmetic_reward("11 11", "11")
    {'format': 0.0, 'correct': 0.0, 'total': 0.0}
    >>> arithmetic_reward("", "11")["format"]
    0.0
    """
    words = response.split()
    fmt = float(len(words) == 1 and _INTEGER.fullmatch(words[0]) is not None)
    correct = float(words == [ground_truth])
    return {"format": fmt, "correct": correct, "total": correct}


@dataclass(frozen=True)
class ArithmeticTask:
    """a + b * c, a * b + c or a + b + c with operands 0..`max_operand`."""

    max_operand: int = 9
    """Largest operand (the smallest is 0)."""

    name: ClassVar[str] = "arithmetic"

    def __post_init__(self):
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")

    def max_result(self) -> int:
        """Largest answer any form can have."""
        m = self.max_operand
        return max(m + m * m, 3 * m)

    def words(self) -> list[str]:
        """The numbers 0..max_result, '+', '*' and '='."""
        return [str(i) for i in range(self.max_result() + 1)] + ["+", "*", "="]

    def generate(self, n: int, seed: int) -> list[Example]:
        """`n` random expressions; the same seed gives the same ones."""
        rng = random.Random(seed)
        examples = []
        for _ in range(n):
            op1, op2 = rng.choice(FORMS)
            a, b, c = (rng.randint(0, self.max_operand) for _ in range(3))
            prompt = f"{a} {op1} {b} {op2} {c} ="
            examples.append(Example(prompt, str(evaluate(a, op1, b, op2, c))))
        return examples

    def reward(self, response: str, ground_truth: str, prompt: str = "") -> dict[str, float]:
        """See `arithmetic_reward`; the prompt is not needed."""
        return arithmetic_reward(response, ground_truth)
