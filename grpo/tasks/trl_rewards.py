"""Reward functions in TRL's shape, `(completions, **kwargs) -> list[float]`, run as TRL runs them: one sample at a
time, with lists of one, and in a run of episodes with what TRL gives an environment_factory's rewards (`completions`
as message lists, `environments` as the episodes' stored final states); one that a run cannot give its `environments`
is refused at `grpo init` (environments_refused), never called without them.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "environments")
"""Parameters of TRL's reward functions that no function of the per-sample shape names: a function that takes any
(and no `response`) is called as TRL calls it (per_sample)."""


def trl_shaped(fn: Callable) -> bool:
    """Whether `fn` is a reward function in TRL's shape, `(completions, **kwargs)` or `(environments, **kwargs)`.

    >>> trl_shaped(lambda completions, **kw: []), trl_shaped(lambda environments, **kw: [])
    (True, True)
    >>> trl_shaped(lambda response, ground_truth, prompt, **row: 0.0)
    False
    """
    names = inspect.signature(fn).parameters
    return "response" not in names and any(n in names for n in TRL_ARGUMENTS)


def per_sample(fn: Callable) -> Callable:
    """A reward function in TRL's shape, `(completions, **kwargs) -> list`, as one of (response, ground_truth,
    prompt, **row): called with lists of one sample. In a run of episodes it gets what TRL gives an
    environment_factory's rewards: `completions`, each a list of the episode's messages after the prompt, and
    `environments`, each the episode's environment as it ended (its stored final state: FinalState); a function
    that takes `environments` is never called without them (the sample fails naming why).

    >>> f = per_sample(lambda completions, ground_truth, **_: [float(completions == ground_truth)])
    >>> f("3 4", "3 4", "sort: 4 3"), f("4 3", "3 4", "sort: 4 3", level=2)
    (1.0, 0.0)
    >>> tool = per_sample(lambda completions, environments, **_: [len(completions[0]) + environments[0]["calls"]])
    >>> tool("7", "7", "3 + 4 =", environment={"calls": 2}, messages=[{"role": "assistant", "content": "7"}])
    3
    """
    takes = inspect.signature(fn).parameters

    @functools.wraps(fn)
    def reward(response, ground_truth, prompt, **row):
        episode = {k: row.pop(k) for k in ("environment", "messages") if k in row}  # functions.EPISODE_ARGUMENTS
        given = {"completions": [response]}
        if "messages" in episode:  # a run of episodes, as TRL gives them
            given = {"completions": [episode["messages"]]}
            if episode.get("environment") is not None:
                given["environments"] = [episode["environment"]]
        if "environments" in takes and "environments" not in given:
            raise TypeError(
                f"{fn.__name__} takes `environments` and this sample has none (its episode stored no final state)"
            )
        got = fn(prompts=[prompt], ground_truth=[ground_truth], **given, **{k: [v] for k, v in row.items()})
        return got[0] if isinstance(got, (list, tuple)) and len(got) == 1 else got

    del reward.__wrapped__  # its signature is the per-sample one
    given = {"prompts", "completions", "ground_truth", "kwargs"}
    reward.trl_needs = {  # what the run must give it: dataset columns, and `environments` however it is declared
        n for n, p in takes.items() if (p.default is p.empty and p.kind is not p.VAR_KEYWORD and n not in given)
    } | ({"environments"} & set(takes))
    return reward


def environments_problem(spec: str, needed: list[str], kind: str | None) -> str | None:
    """Why reward function `spec` (what it `needed`: required_columns) cannot run where it takes TRL's `environments`
    and the run's episodes (adapter `kind`) have no environment to give: one line showing the wrapper that scores it
    there (grpo init refuses with it); None where it can."""
    if "environments" not in needed or kind in ("environment", "openenv"):
        return None
    name = spec.rpartition(":")[2]  # a spec init has checked
    return (
        f"reward.functions: {spec!r} takes `environments` (TRL's environment_factory rewards) and this run has no "
        "environment (rollout.environment: a class `file.py:Class` or an OpenEnv URL); set one, or score without "
        f"it through a wrapper: `def {name}_alone(completions, **kw): return {name}(completions, "
        "environments=[None] * len(completions), **kw)`"
    )
