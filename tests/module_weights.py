"""The order pytest-xdist hands the test modules to its workers: heaviest first. `--dist loadfile` gives a worker a
whole module, in the order collected (pyproject.toml's `--no-loadscope-reorder` keeps that order: xdist would
otherwise start with the modules of most tests, which are fast, and leave the long one-test e2e modules for last,
where one worker runs them alone while the other idles). Longest first, the two workers end within a module or two of
each other, whatever the weights' machine: only their order matters.

SECONDS: each module's setup + call + teardown, summed from a full `pytest -n 2 --dist loadfile --durations=0` on
2 cores (commit 263fbb7; modules under 5 s left out: they weigh 0 and fill the end). Remeasure when modules move:

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=0 > durations.log
    python tests/module_weights.py durations.log
"""

from __future__ import annotations

import collections
import re
import sys

SECONDS = {
    "test_sharding": 292,
    "test_flow": 282,
    "test_report": 273,
    "test_nodes": 247,
    "test_flow_e2e": 242,
    "test_overlap_resume": 240,
    "test_readme": 194,
    "test_family_iterations": 180,  # added after that run: -n 0 beside other work (16 families on hf 65 s, 3 vLLM 96 s)
    "test_placement_e2e": 168,
    "test_episodes": 150,
    "test_episode_segments": 150,  # added after that run: its -n 0 time beside other work (80-100 s)
    "test_lora": 136,
    "test_real_path": 118,
    "test_first_hour": 108,
    "test_readme_tools": 93,
    "test_gpu_check": 88,
    "test_stages": 75,
    "test_no_orphans": 74,
    "test_overlap_one_process": 68,
    "test_state": 66,
    "test_loss_mask": 65,
    "test_fork": 62,
    "test_family_sampling": 60,  # added after that run: -n 0 beside other work
    "test_trust_rewards": 59,
    "test_tiny_model": 58,
    "test_resume": 58,
    "test_prefect_quiet": 57,
    "test_stage_workers_e2e": 55,
    "test_segments": 51,
    "test_overlap_e2e": 50,
    "test_threads": 48,
    "test_io": 36,
    "test_agent_calculator": 35,
    "test_gc": 34,
    "test_generation": 28,
    "test_trust_record": 28,
    "test_eval_cadence": 27,
    "test_no_dead_ends": 27,
    "test_precision": 23,
    "test_query": 23,
    "test_learn": 22,
    "test_s3server": 22,
    "test_cli_speed": 19,
    "test_openenv": 18,
    "test_staleness": 18,
    "test_api": 17,
    "test_retention": 14,
    "test_dynamic_sampling": 12,
    "test_episode_parts": 12,
    "test_tracking": 9,
    "test_progress": 9,
    "test_small_truths": 8,
    "test_config_fuzz": 7,
    "test_shards": 7,
    "test_trust_inputs": 6,
    "test_old_logprobs": 6,
    "test_trust_limits": 5,
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
