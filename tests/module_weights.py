"""The order pytest-xdist hands the test modules to its workers: heaviest first. `--dist loadfile` gives a worker a
whole module, in the order collected (pyproject.toml's `--no-loadscope-reorder` keeps that order: xdist would
otherwise start with the modules of most tests, which are fast, and leave the long one-test e2e modules for last,
where one worker runs them alone while the other idles). Longest first, the two workers end within a module or two of
each other, whatever the weights' machine: only their order matters.

SECONDS: each module's setup + call + teardown, summed from a full `pytest -n 2 --dist loadfile --durations=0` on
2 cores (commit f5baeda; modules under 5 s left out: they weigh 0 and fill the end). Remeasure when modules move:

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=0 > durations.log
    python tests/module_weights.py durations.log
"""

from __future__ import annotations

import collections
import re
import sys

SECONDS = {
    "test_sharding": 225,
    "test_overlap_resume": 218,
    "test_flow": 214,
    "test_nodes": 183,
    "test_flow_e2e": 175,
    "test_report": 151,
    "test_placement_e2e": 148,
    "test_readme": 133,
    "test_gpu_check": 96,
    "test_lora": 88,
    "test_prefect_quiet": 79,
    "test_first_hour": 79,
    "test_checkpoint_families": 66,
    "test_episodes": 66,
    "test_readme_tools": 65,
    "test_stages": 64,
    "test_stage_workers_e2e": 56,
    "test_no_orphans": 55,
    "test_episode_segments": 53,
    "test_real_path": 50,
    "test_state": 49,
    "test_overlap_one_process": 49,
    "test_overlap_e2e": 47,
    "test_trust_rewards": 41,
    "test_family_iterations": 40,
    "test_loss_mask": 40,
    "test_openenv": 38,
    "test_push_to_hub": 37,
    "test_resume": 58,  # the earlier run's: it failed early in the one below
    "test_fork": 35,
    "test_tiny_model": 34,
    "test_threads": 32,
    "test_agent_calculator": 31,
    "test_segments": 28,
    "test_io": 27,
    "test_generation": 27,
    "test_gc": 23,
    "test_learn": 23,
    "test_trust_record": 22,
    "test_first_hour_four": 21,
    "test_staleness": 20,
    "test_query": 19,
    "test_api": 19,
    "test_s3server": 19,
    "test_retention": 17,
    "test_precision": 17,
    "test_cli_speed": 14,
    "test_eval_cadence": 13,
    "test_trust_answers": 12,
    "test_no_dead_ends": 11,
    "test_progress": 11,
    "test_family_sampling": 9,
    "test_tracking": 7,
    "test_old_logprobs": 7,
    "test_model_families": 6,
    "test_token_age": 6,
    "test_shards": 6,
    "test_episode_parts": 6,
    "test_kubernetes": 6,
    "test_dynamic_sampling": 12,  # the earlier run's: it failed early in the one below
    "test_rollout_func": 5,
    "test_small_truths": 5,
    "test_config_fuzz": 5,
}
NEW_SLOW = 60
"""A module marked slow that SECONDS does not know yet (new since it was measured) weighs this."""


def weight(module: str, slow: bool) -> int:
    """The seconds `module` (tests/test_x.py) is expected to take; `slow`: it holds a test marked slow."""
    return SECONDS.get(module.removeprefix("tests/").removesuffix(".py"), NEW_SLOW if slow else 0)


def measured(log: str) -> dict[str, int]:
    """{module: seconds} from a `--durations=0` report, heaviest first, those of 5 s or more."""
    total: dict[str, float] = collections.Counter()
    for line in log.splitlines():
        found = re.match(r"\s*([\d.]+)s (?:setup|call|teardown)\s+tests/(\w+)\.py::", line)
        if found:
            total[found.group(2)] += float(found.group(1))
    return {module: round(s) for module, s in total.most_common() if s >= 5}


if __name__ == "__main__":
    print("SECONDS = {\n" + "".join(f'    "{m}": {s},\n' for m, s in measured(open(sys.argv[1]).read()).items()) + "}")
