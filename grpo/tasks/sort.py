"""Sort a list of small numbers: the headline toy task.

Prompt ``"sort 3 1 4 1 5 :"``, answer ``"1 1 3 4 5"``. The reward gives
partial credit, so a random policy already sees a useful signal:

    total = present / 4 + ordered / 4 + exact / 2      (credit="ordered", sort_reward's default)
    total = present / 4 + position / 4 + exact / 2     (credit="position", the task's default)

A perfect answer scores 1.0; anything short of exact scores at most 0.5.
"ordered" credits neighbouring pairs of the sorted answer wherever they sit;
"position" credits each answer position the response has right, so
"1 3 4 5" for "1 1 3 4 5" (the distinct values, a trap the policy falls into)
earns 0.2 instead of 0.75 and learning to repeat a number pays at once.
"""

import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, Literal

from grpo.tasks.base import Example

_NUMBER = re.compile(r"-?[0-9]+")


def parse_numbers(text: str) -> list[int]:
    """The integer words of `text`, in order; other words are skipped.

    >>> parse_numbers("1 1 3 4 5")
    [1, 1, 3, 4, 5]
    >>> parse_numbers("sort 3 x 4 :")
    [3, 4]
    >>> parse_numbers("")
    []
    """
    return [int(w) for w in text.split() if _NUMBER.fullmatch(w)]


def overlap(got: Iterable, want: Iterable) -> int:
    """Size of the multiset intersection of `got` and `want` (what `Counter & Counter` counts,
    without building two Counters: rewards score every sample, and this is their inner loop).

    >>> overlap([1, 3, 3, 4], [1, 1, 3, 4, 5]), overlap([(1, 1)], [(1, 1), (1, 1)]), overlap([], [2])
    (3, 1, 0)
    """
    left: dict = {}
    for x in want:
        left[x] = left.get(x, 0) + 1
    hits = 0
    for x in got:
        if left.get(x, 0) > 0:
            left[x] -= 1
            hits += 1
    return hits


def present_score(got: list[int], want: list[int]) -> float:
    """Multiset overlap of `got` with `want`, over max(len(want), len(got)).

    Dividing by the longer list penalises padding the answer with extra numbers.

    >>> present_score([1, 3, 4], [1, 1, 3, 4, 5])
    0.6
    >>> present_score([1, 1, 3, 4, 5, 5, 5, 5, 5, 5], [1, 1, 3, 4, 5])
    0.5
    >>> present_score([], [1, 2])
    0.0
    """
    return overlap(got, want) / max(len(want), len(got), 1)


def ordered_score(got: list[int], want: list[int]) -> float:
    """Fraction of the adjacent pairs of sorted(`want`) that `got[:n]` has as adjacent pairs.

    A pair counts only if it is a neighbouring pair of the sorted answer, so a
    constant or an unrelated sorted list earns nothing: an earlier "any
    non-decreasing pair" rule let the policy settle on "0 0 0 0 0".

    >>> ordered_score([1, 3, 4], [1, 1, 3, 4, 5])  # (1,3) and (3,4) of (1,1) (1,3) (3,4) (4,5)
    0.5
    >>> ordered_score([0, 0, 0, 0, 0], [1, 1, 3, 4, 5])
    0.0
    >>> ordered_score([5, 4, 3, 1, 1], [1, 1, 3, 4, 5])  # only (1,1)
    0.25
    >>> ordered_score([7], [7]), ordered_score([], [7])
    (1.0, 0.0)
    """
    target, n = sorted(want), len(want)
    if n <= 1:
        return float(got[:1] == target)
    head = got[:n]
    return overlap(zip(head, head[1:]), zip(target, target[1:])) / (n - 1)


def position_score(words: list[str], want: list[int]) -> float:
    """Fraction of the answer's positions where the response's word is the answer's number,
    over max(len(want), len(words)); a non-number word is a wrong position.

    >>> position_score("1 3 4 5".split(), [1, 1, 3, 4, 5])  # only the first 1
    0.2
    >>> position_score("1 1 3 9 5".split(), [1, 1, 3, 4, 5])
    0.8
    >>> position_score("1 1 3 4 5 5".split(), [1, 1, 3, 4, 5])  # an extra number costs
    0.8333333333333334
    >>> position_score("1 1 : 4 5".split(), [1, 1, 3, 4, 5]), position_score([], [7])
    (0.8, 0.0)
    """
    hits = sum(w == str(n) for w, n in zip(words, want))
    return hits / max(len(want), len(words), 1)


Credit = Literal["ordered", "position"]
CREDITS = ("ordered", "position")


def sort_reward(response: str, ground_truth: str, credit: Credit = "ordered") -> dict[str, float]:
    """Score `response` against the sorted numbers in `ground_truth`.

    total = present / 4 + (ordered or position, by `credit`) / 4 + exact / 2; every
    component is reported whichever `credit` weighs in.

    >>> sort_reward("1 1 3 4 5", "1 1 3 4 5")
    {'present': 1.0, 'ordered': 1.0, 'position': 1.0, 'exact': 1.0, 'total': 1.0}
    >>> sort_reward("1 3 4", "1 1 3 4 5")["total"]  # (0.6 + 0.5) / 4
    0.275
    >>> sort_reward("1 3 4 5", "1 1 3 4 5", credit="position")["total"]  # (0.8 + 0.2) / 4
    0.25
    >>> sort_reward("answer 1 1 3 4 5", "1 1 3 4 5")["total"]  # extra word: not exact
    0.5
    >>> sort_reward("", "1 1 3 4 5")["total"]
    0.0
    """
    if credit not in CREDITS:
        raise ValueError(f"unknown credit {credit!r}; valid: {', '.join(CREDITS)}")
    want = parse_numbers(ground_truth)
    got = parse_numbers(response)
    words = response.split()
    scores = {
        "present": present_score(got, want),
        "ordered": ordered_score(got, want),
        "position": position_score(words, want),
    }
    # any non-number word spoils an exact match
    scores["exact"] = float(got == want and len(got) == len(words))
    scores["total"] = scores["present"] / 4 + scores[credit] / 4 + scores["exact"] / 2
    return scores


@dataclass(frozen=True)
class SortTask:
    """Sort `n_numbers` integers drawn from 0..`max_value`."""

    n_numbers: int = 5
    """How many numbers each prompt holds."""
    max_value: int = 9
    """Largest number that can appear (the smallest is 0)."""
    credit: Credit = "position"
    """Partial credit beside `present`: `position` (right places) or `ordered` (neighbouring pairs, with
    which a policy can settle on sorting the distinct values: benchmarks/RESULTS.md)."""

    name: ClassVar[str] = "sort"

    def __post_init__(self):
        if self.n_numbers < 1:
            raise ValueError(f"n_numbers must be >= 1, got {self.n_numbers}")
        if self.max_value < 1:
            raise ValueError(f"max_value must be >= 1, got {self.max_value}")
        if self.credit not in CREDITS:
            raise ValueError(f"credit must be one of {', '.join(CREDITS)}, got {self.credit!r}")

    def words(self) -> list[str]:
        """'sort', ':' and the numbers 0..max_value."""
        return ["sort", ":"] + [str(i) for i in range(self.max_value + 1)]

    def generate(self, n: int, seed: int) -> list[Example]:
        """`n` random lists; the same seed gives the same lists."""
        rng = random.Random(seed)
        examples = []
        for _ in range(n):
            nums = [rng.randint(0, self.max_value) for _ in range(self.n_numbers)]
            prompt = "sort " + " ".join(map(str, nums)) + " :"
            examples.append(Example(prompt, " ".join(map(str, sorted(nums)))))
        return examples

    def reward(self, response: str, ground_truth: str, prompt: str = "") -> dict[str, float]:
        """See `sort_reward`; the prompt's numbers are those of `ground_truth`."""
        return sort_reward(response, ground_truth, self.credit)
