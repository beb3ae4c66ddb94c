"""Word problems a small model cannot do in its head, and the calculator it may press.

A problem multiplies a one-digit number by a four-digit one, or adds them, in one of a few sentences:

    Ana packs seven boxes with one thousand two hundred nine coins in each. How many coins is that in all?  -> 8463

`Calculator` is written in TRL's `environment_factory` contract and runs unchanged on both sides: one instance per
episode, `reset(**row)` with the dataset row (it keys in the problem's two numbers, the row's `a` and `b`), its public
methods the tools (name, docstring and type hints give the schema), and reward functions reading what the episode
did from `environments`. The model presses an operation (`calculate(operation="multiply")`), the calculator says
"The answer is 8463.", and the model says it again as its answer: which operation the sentence asks for, and that
the calculator is worth calling, are the model's to learn. What makes copying learnable at the recipe's size (a few
hundred thousand weights, minutes of training on 2 CPU cores), as measured with its warm start
(benchmarks/agent_calculator.py, RESULTS.md): the questions spell their numbers in words, so the calculator's are
the only digits in the context; the tokenizer splits digits (`build_chat_model(split_digits=True)`); and every
result of either operation has 4 digits, so the copy is one fixed-offset copy. Before the last, a warm start copied
4-digit results (92% sampled) and never the 2-3 or 5-6 digit ones a wrong operation gave, and GRPO's negative
advantage on those copies broke the copy everywhere (held-out accuracy 0.50 -> 0.12 in two iterations).

The rewards are TRL reward functions (lists in, a float per completion out):

- `correct_answer`: 1 when the last assistant message ends "The answer is N." with the right N;
- `correct_tool_use`: 1 when the episode pressed the operation the problem needs (its result is the answer).

`reward` is the recipe's reward for grpo-flow's `reward.functions` (one episode in, its components out):
correct_answer + 0.5 x correct_tool_use, from the episode's messages and its environment's final state.

    >>> env = Calculator()
    >>> env.reset(question="...", answer="3381", a=23, b=147)
    >>> env.calculate(operation="multiply")
    'The answer is 3381.'
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
PHRASES = {
    "multiply": [
        "{name} packs {a} boxes with {b} {thing} in each. How many {thing} is that in all?",
        "{name} has {a} bags of {b} {thing}. How many {thing} does {name} have?",
    ],
    "add": [
        "{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?",
        "{name} finds {a} {thing}, then {b} {thing} more. How many {thing} in all?",
    ],
}
OPERATIONS = {"add": lambda a, b: a + b, "multiply": lambda a, b: a * b}
TOOL_USE_WEIGHT = 0.5
_ANSWER = re.compile(r"The answer is (-?\d+)\.?\s*$")


ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen".split()
)
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def words(n: int) -> str:
    """A number below 10000 in words, as the problems spell their numbers (so that the only digits a model ever
    reads are the calculator's).

    >>> words(7), words(76), words(598), words(1040), words(3000)
    ('seven', 'seventy-six', 'five hundred ninety-eight', 'one thousand forty', 'three thousand')
    """
    thousands, n = divmod(n, 1000)
    hundreds, rest = divmod(n, 100)
    tens = ONES[rest] if rest < 20 else TENS[rest // 10] + (f"-{ONES[rest % 10]}" if rest % 10 else "")
    said = [f"{ONES[thousands]} thousand"] * bool(thousands) + [f"{ONES[hundreds]} hundred"] * bool(hundreds)
    return " ".join(said + [tens] * bool(rest or not said))


def problem(rng: random.Random) -> dict:
    """One word problem on a one-digit number `a` (2-9) and a four-digit `b` small enough that `a` x `b` has four
    digits too: either operation's result has 4 digits, so whichever the model presses, the calculator's number
    sits at one offset from the answer it writes (copying is one attention head's fixed-offset copy), and an
    episode that pressed the wrong operation copies as surely as a right one. The row's `answer` is the result as
    text, `operation` the one that solves it, `a` and `b` the numbers.

    >>> problem(random.Random(0))
    {'question': 'Lee has eight bags of one thousand ten shells. How many shells does Lee have?', 'answer': '8080', \
'operation': 'multiply', 'a': 8, 'b': 1010}
    """
    operation = rng.choice(sorted(OPERATIONS))
    a = rng.randint(2, 9)
    b = rng.randint(1000, 9999 // a)
    name, thing, phrase = rng.choice(NAMES), rng.choice(THINGS), rng.choice(PHRASES[operation])
    question = phrase.format(name=name, thing=thing, a=words(a), b=words(b))
    return {"question": question, "answer": str(OPERATIONS[operation](a, b)), "operation": operation, "a": a, "b": b}


def final_answer(text: str) -> int | None:
    """The N of a closing "The answer is N."; None when the text does not end so.

    >>> final_answer("The answer is 3381."), final_answer("3381"), final_answer("The answer is 12. Or 13.")
    (3381, None, None)
    """
    match = _ANSWER.search(text.strip())
    return int(match.group(1)) if match else None


class Calculator:
    """A calculator holding the problem's two numbers; it remembers what was pressed (operation, result)."""

    def __init__(self):
        self.a, self.b = 0, 0
        self.calls: list[tuple[str, int]] = []

    def reset(self, **row) -> None:
        """A new episode for a dataset row (its columns as keywords): its numbers keyed in; nothing is added to
        the prompt."""
        self.a, self.b = int(row.get("a", 0)), int(row.get("b", 0))
        self.calls = []

    def calculate(self, operation: str):
        """Apply an operation to the two numbers of the problem and say the result.

        Args:
            operation: "add" or "multiply".
        """
        if operation not in OPERATIONS:
            raise ValueError(f"unknown operation {operation!r}: use 'add' or 'multiply'")
        result = OPERATIONS[operation](self.a, self.b)
        self.calls.append((operation, result))
        return f"The answer is {result}."


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
    """1.0 for an episode that pressed the operation whose result is the answer, whatever it did next; a wrong
    operation earns nothing, nor does no call.

    >>> env = Calculator()
    >>> env.reset(a=23, b=147)
    >>> _ = env.calculate(operation="add")
    >>> correct_tool_use([[]], environments=[env], answer=["3381"])
    [0.0]
    """
    return [float(any(r == int(a) for _, r in env.calls)) for env, a in zip(environments, answer)]


def reward(response: str, ground_truth: str, prompt, environment=None, messages=None) -> dict:
    """The recipe's reward of one episode (grpo-flow's reward function form): `correct` + 0.5 x `tool_use`, the
    two TRL rewards above on its conversation (`messages`, the turns after the prompt) and its environment as it
    ended (`environment.calls`).

    >>> env = Calculator()
    >>> env.reset(a=23, b=147)
    >>> _ = env.calculate(operation="multiply")
    >>> reward("The answer is 3381.", "3381", "...", env, [{"role": "assistant", "content": "The answer is 3381."}])
    {'correct': 1.0, 'tool_use': 1.0, 'total': 1.5}
    """
    messages = messages if messages is not None else [{"role": "assistant", "content": response}]
    right = correct_answer([messages], [ground_truth])[0]
    used = correct_tool_use([messages], [environment], [ground_truth])[0] if environment is not None else 0.0
    return {"correct": right, "tool_use": used, "total": right + TOOL_USE_WEIGHT * used}
