"""Reward shaping, pure: what a cut-off response scores (reward.truncated_reward) and DAPO's soft overlong
punishment (reward.overlong_buffer, reward.overlong_penalty)."""

from __future__ import annotations


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment, added to the reward of a response of `length` tokens: 0 up to
    max_tokens - buffer tokens, then falling linearly to -penalty at max_tokens (and no further).

    >>> [overlong_penalty(n, max_tokens=10, buffer=4, penalty=1.0) for n in (3, 6, 7, 9, 10)]
    [0.0, 0.0, -0.25, -0.75, -1.0]
    """
    over = min(length - (max_tokens - buffer), buffer)
    return -penalty * over / buffer if over > 0 else 0.0


def overlong(scored: tuple, length: int, max_tokens: int, buffer: int, penalty: float) -> tuple:
    """A scored sample with overlong_penalty added to its reward and recorded as the component `overlong`
    (0 for a response short enough); a sample that erred keeps its reward 0."""
    reward, components, error = scored
    if error is not None:
        return scored
    term = overlong_penalty(length, max_tokens, buffer, penalty)
    return reward + term, {**components, "overlong": term}, error


def truncated(scored: tuple, finish_reason: str, value: float) -> tuple:
    """A response cut off at max_tokens is no answer: its reward becomes `value`.

    The task's components stay for audits, with `truncated` = 1 beside them.
    """
    reward, components, error = scored
    if finish_reason != "length":
        return reward, components, error
    return (value if error is None else reward), {**components, "truncated": 1.0}, error
