"""GSM8K / MATH-style answers: extract the final answer, compare it with math-verify.

The response's final answer is, in order of preference, the last `\\boxed{...}`, the text
after the last `####`, what follows the last "the answer is", else the last number.
The ground truth is GSM8K's `#### N` suffix when it has one, else the whole string
(MATH's `\\boxed{}` solutions work too). Equivalence is math-verify's: `7` = `7.0` =
`14/2`, fractions, LaTeX. The task has no prompt generator: it scores a dataset
(`task.dataset`).

    total = correct + format_weight * format
"""

import logging
import re
from dataclasses import dataclass
from typing import ClassVar

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")  # 1,200  3.5  14/2  .5
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*(.+)", re.IGNORECASE | re.DOTALL)


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` (braces balanced), or None.

    >>> last_boxed(r"so \\boxed{\\frac{1}{2}} and \\boxed{7}")
    '7'
    >>> last_boxed(r"\\boxed{\\frac{1}{2}}")
    '\\\\frac{1}{2}'
    >>> last_boxed(r"\\boxed{7") is None
    True
    """
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


def _clean(answer: str) -> str:
    """One answer line without the trailing period, dollar signs and thousands commas.

    >>> _clean(" $1,234.  \\nmore")
    '1234'
    """
    answer = answer.strip().splitlines()[0] if answer.strip() else ""
    answer = answer.strip().rstrip(".").replace("$", "").strip()
    return re.sub(r"(?<=\d),(?=\d{3})", "", answer)


def extract_answer(response: str) -> tuple[str | None, bool]:
    """(final answer, whether it was marked as one: boxed, `####` or "the answer is").

    Without a marker the last number counts, unmarked (a policy is rewarded for the
    format only through the `format` component).

    >>> extract_answer(r"2 + 5 = 7, so \\boxed{7}.")
    ('7', True)
    >>> extract_answer("He pays 3 + 4 = 7 dollars.\\n#### 7")
    ('7', True)
    >>> extract_answer("The answer is 1,200.")
    ('1200', True)
    >>> extract_answer("3 apples and 4 more make 7")
    ('7', False)
    >>> extract_answer("The answer is 8. Earlier I wrote 7"), extract_answer("half: 14/2")
    (('8', True), ('14/2', False))
    >>> extract_answer("no idea")
    (None, False)
    """
    boxed = last_boxed(response)
    if boxed is not None:
        return _clean(boxed), True
    if "####" in response:
        return _clean(response.rsplit("####", 1)[1]), True
    found = list(_ANSWER_IS.finditer(response))
    if found:  # a number right after it, else the rest of its sentence
        rest = found[-1].group(1).lstrip("$ ")
        number = _NUMBER.match(rest)
        return _clean(number.group(0) if number else re.split(r"\.\s|\n", rest)[0]), True
    numbers = _NUMBER.findall(response)
    return (_clean(numbers[-1]), False) if numbers else (None, False)


def ground_truth_answer(ground_truth: str) -> str:
    """GSM8K's `#### N` suffix, MATH's last `\\boxed{}`, else the whole string.

    >>> ground_truth_answer("Tom has 3 + 4 = <<3+4=7>>7 apples.\\n#### 7")
    '7'
    >>> ground_truth_answer("7.0")
    '7.0'
    """
    if "####" in ground_truth:
        return _clean(ground_truth.rsplit("####", 1)[1])
    boxed = last_boxed(ground_truth)
    return _clean(boxed if boxed is not None else ground_truth)


def equivalent(answer: str, truth: str) -> bool:
    """Whether two final answers are the same number or expression (math-verify).

    math-verify's own signal-based timeouts are off: the reward pool's per-sample
    alarm bounds the whole call (two alarms in one process would cancel each other).

    >>> equivalent("7", "7.0"), equivalent("14/2", "7"), equivalent("\\\\frac{1}{2}", "0.5"), equivalent("8", "7")
    (True, True, True, False)
    """
    if answer.strip() == truth.strip():
        return True
    for name in ("math_verify.parser", "math_verify.grader"):  # "timeout is disabled": on purpose, see above
        logging.getLogger(name).setLevel(logging.ERROR)
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]

    def parsed(text: str):
        return parse(f"${text}$", extraction_config=configs, parsing_timeout=None) or parse(
            text, extraction_config=configs, parsing_timeout=None
        )

    gold, pred = parsed(truth), parsed(answer)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=None))


def math_reward(response: str, ground_truth: str, format_weight: float = 0.0) -> dict[str, float]:
    """`correct`: the final answer equals the ground truth's; `format`: it was marked as final.

    >>> [math_reward(r, "Janet sells 16 - 3 - 4 = 9 eggs.\\n#### 9")["correct"]
    ...  for r in ("The answer is 9.", "#### 9", r"\\boxed{9}", "9.0", "so 3 + 6 = 9", "8")]
    [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    >>> math_reward("3 + 6 = 9", "9", format_weight=0.1)
    {'correct': 1.0, 'format': 0.0, 'total': 1.0}
    >>> math_reward("#### 9", "9", format_weight=0.1)
    {'correct': 1.0, 'format': 1.0, 'total': 1.1}
    """
    answer, marked = extract_answer(response)
    correct = float(answer is not None and equivalent(answer, ground_truth_answer(ground_truth)))
    fmt = float(marked)
    return {"correct": correct, "format": fmt, "total": correct + format_weight * fmt}


@dataclass(frozen=True)
class MathTask:
    """Final-answer correctness on a dataset of word problems (GSM8K, MATH)."""

    format_weight: float = 0.0
    """Reward added for a marked final answer (`\\boxed{}`, `####`, "the answer is")."""

    name: ClassVar[str] = "math"

    def __post_init__(self):
        if not isinstance(self.format_weight, (int, float)) or self.format_weight < 0:
            raise ValueError(f"format_weight must be a number >= 0, got {self.format_weight!r}")

    def reward(self, response: str, ground_truth: str, prompt: str = "") -> dict[str, float]:
        """See `math_reward`; the prompt is not needed."""
        return math_reward(response, ground_truth, self.format_weight)
