"""Tasks: hand-computed rewards, deterministic generation, registry errors."""

import doctest
import random
from collections import Counter

import pytest

import grpo.tasks
import grpo.tasks.arithmetic
import grpo.tasks.sort
from grpo.tasks import TASKS, Example, generates, get_task
from grpo.tasks.arithmetic import arithmetic_reward
from grpo.tasks.sort import overlap, parse_numbers, sort_reward

GENERATORS = sorted(n for n in TASKS if generates(get_task(n)))  # the toy tasks; math scores a dataset


@pytest.mark.parametrize("module", [grpo.tasks, grpo.tasks.sort, grpo.tasks.arithmetic])
def test_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted > 0
    assert result.failed == 0


# sort: (response, present, ordered, exact) against "1 1 3 4 5"
SORT_CASES = {
    "correct": ("1 1 3 4 5", 1.0, 1.0, 1.0),
    "reversed": ("5 4 3 1 1", 1.0, 0.25, 0.0),
    "missing two": ("1 3 4", 0.6, 0.5, 0.0),
    # 10 numbers, 5 of them right: 5 / max(5, 10); the first five are the sorted pairs
    "padded": ("1 1 3 4 5 5 5 5 5 5", 0.5, 1.0, 0.0),
    "extra word": ("so 1 1 3 4 5", 1.0, 1.0, 0.0),
    "wrong numbers": ("0 0 0 0 0", 0.0, 0.0, 0.0),  # sorted but unrelated: no credit
    "sorted subset": ("1 3 5", 0.6, 0.25, 0.0),  # (1,3) is a neighbouring pair, (3,5) is not
    "empty": ("", 0.0, 0.0, 0.0),
    "garbage": ("sort : : sort", 0.0, 0.0, 0.0),
}


@pytest.mark.parametrize("case", SORT_CASES)
def test_sort_reward_hand_values(case):
    response, present, ordered, exact = SORT_CASES[case]
    r = sort_reward(response, "1 1 3 4 5")
    assert r["present"] == pytest.approx(present)
    assert r["ordered"] == pytest.approx(ordered)
    assert r["exact"] == exact
    assert r["total"] == pytest.approx((present + ordered) / 4 + exact / 2)


# position credit against "1 1 3 4 5": (response, position)
POSITION_CASES = {
    "correct": ("1 1 3 4 5", 1.0),
    "distinct values": ("1 3 4 5", 0.2),  # only the first 1 sits right
    "one wrong": ("1 1 3 9 5", 0.8),
    "shifted": ("0 1 1 3 4", 0.2),
    "word in place": ("1 1 : 4 5", 0.8),
    "extra number": ("1 1 3 4 5 5", 5 / 6),
    "empty": ("", 0.0),
}


@pytest.mark.parametrize("case", POSITION_CASES)
def test_sort_position_credit_hand_values(case):
    response, position = POSITION_CASES[case]
    r = sort_reward(response, "1 1 3 4 5", credit="position")
    assert r["position"] == pytest.approx(position)
    assert r["total"] == pytest.approx(r["present"] / 4 + position / 4 + r["exact"] / 2)
    # the default credit reports the same components and weighs `ordered` instead
    d = sort_reward(response, "1 1 3 4 5")
    assert {k: v for k, v in d.items() if k != "total"} == {k: v for k, v in r.items() if k != "total"}
    assert d["total"] == pytest.approx(d["present"] / 4 + d["ordered"] / 4 + d["exact"] / 2)


def test_sort_credit_is_a_task_parameter():
    task = get_task("sort", credit="position")
    assert task.reward("1 3 4 5", "1 1 3 4 5", "")["total"] == pytest.approx(0.8 / 4 + 0.2 / 4)
    with pytest.raises(ValueError, match="credit must be one of ordered, position"):
        get_task("sort", credit="pairs")


def test_overlap_is_the_multiset_intersection():
    rng = random.Random(0)
    for _ in range(2000):
        a, b = ([rng.randint(0, 3) for _ in range(rng.randint(0, 7))] for _ in range(2))
        pairs_a, pairs_b = list(zip(a, a[1:])), list(zip(b, b[1:]))
        assert overlap(a, b) == sum((Counter(a) & Counter(b)).values())
        assert overlap(pairs_a, pairs_b) == sum((Counter(pairs_a) & Counter(pairs_b)).values())


def test_sort_reward_only_exact_reaches_one():
    for response, *_ in SORT_CASES.values():
        r = sort_reward(response, "1 1 3 4 5")
        assert 0.0 <= r["total"] <= 1.0
        assert (r["total"] == 1.0) == (r["exact"] == 1.0)


def test_sort_task_reward_matches_plain_function():
    task = get_task("sort")
    ex = task.generate(1, seed=3)[0]
    assert sorted(parse_numbers(ex.prompt)) == parse_numbers(ex.ground_truth)
    assert task.reward(ex.ground_truth, ex.ground_truth, ex.prompt)["total"] == 1.0
    assert task.credit == "position"  # the task's default; the plain function's is `ordered`
    assert task.reward("x", ex.ground_truth, ex.prompt) == sort_reward("x", ex.ground_truth, credit="position")


@pytest.mark.parametrize(
    "response, fmt, correct",
    [("11", 1.0, 1.0), ("12", 1.0, 0.0), ("11 =", 0.0, 0.0), ("", 0.0, 0.0), ("+ *", 0.0, 0.0)],
)
def test_arithmetic_reward_hand_values(response, fmt, correct):
    assert arithmetic_reward(response, "11") == {"format": fmt, "correct": correct, "total": correct}


def test_arithmetic_answers_follow_precedence():
    task = get_task("arithmetic", max_operand=9)
    for ex in task.generate(200, seed=0):
        expr = ex.prompt.removesuffix(" =")
        assert int(ex.ground_truth) == eval(expr)  # python has the same precedence
        assert set(ex.prompt.split()) <= set(task.words())
        assert ex.ground_truth in task.words()


def test_toy_tasks_generate_and_math_does_not():
    assert GENERATORS == ["arithmetic", "sort"]


@pytest.mark.parametrize("name", GENERATORS)
def test_generate_is_deterministic_per_seed(name):
    task = get_task(name)
    a = task.generate(20, seed=7)
    assert a == task.generate(20, seed=7)
    assert a != task.generate(20, seed=8)
    assert all(isinstance(ex, Example) for ex in a)


@pytest.mark.parametrize("name", GENERATORS)
def test_words_cover_prompts_and_answers(name):
    task = get_task(name)
    vocab = set(task.words())
    assert len(vocab) == len(task.words())  # no duplicates
    for ex in task.generate(50, seed=1):
        assert set(ex.prompt.split()) <= vocab
        assert set(ex.ground_truth.split()) <= vocab


def test_sort_params_shape_prompts():
    task = get_task("sort", n_numbers=3, max_value=4)
    for ex in task.generate(50, seed=0):
        nums = parse_numbers(ex.prompt)
        assert len(nums) == 3 and max(nums) <= 4
        assert ex.prompt.startswith("sort ") and ex.prompt.endswith(" :")


def test_unknown_task_lists_valid_names():
    with pytest.raises(ValueError, match="arithmetic, math, sort"):
        get_task("reverse")


def test_unknown_param_is_named():
    with pytest.raises(ValueError, match="'max_operand'.*n_numbers, max_value"):
        get_task("sort", max_operand=3)


@pytest.mark.parametrize(
    "name, params, bad",
    [
        ("sort", {"n_numbers": 0}, "n_numbers"),
        ("sort", {"max_value": 0}, "max_value"),
        ("arithmetic", {"max_operand": 0}, "max_operand"),
    ],
)
def test_bad_param_value_is_named(name, params, bad):
    with pytest.raises(ValueError, match=bad):
        get_task(name, **params)
