"""The order pytest-xdist hands the test modules to its workers: heaviest first. `--dist loadfile` gives a worker a
whole module, in the order collected (pyproject.toml's `--no-loadscope-reorder` keeps that order: xdist would
otherwise start with the modules of most tests, which are fast, and leave the long one-test e2e modules for last,
where one worker runs them alone while the other idles). Longest first, the two workers end within a module or two of
each other, whatever the weights' machine: only their order matters.

SECONDS: each module's setup + call + teardown, summed from a full `pytest -n 2 --dist loadfile --durations=0` on
2 cores (commit 9a70f76; modules under 5 s left out: they weigh 0 and fill the end). Remeasure when modules move:

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=0 > durations.log
    python tests/module_weights.py durations.log
"""

from __future__ import annotations

import collections
import re
import sys

SECONDS = {
    "test_overlap_resume": 291,
    "test_sharding": 236,
    "test_nodes": 211,
    "test_flow": 201,
    "test_placement_e2e": 189,
    "test_flow_e2e": 182,
    "test_report": 177,
    "test_readme": 168,
    "test_first_hour": 126,
    "test_lora": 118,
    "test_readme_tools": 109,
    "test_gpu_check": 101,
    "test_stages": 89,
    "test_prefect_quiet": 89,
    "test_sft": 86,
    "test_real_path": 80,
    "test_episodes": 71,
    "test_checkpoint_families": 67,
    "test_no_orphans": 66,
    "test_resume": 63,
    "test_stage_workers_e2e": 59,
    "test_episode_segments": 56,
    "test_state": 53,
    "test_overlap_e2e": 52,
    "test_family_iterations": 51,
    "test_openenv": 49,
    "test_trust_rewards": 48,
    "test_push_to_hub": 47,
    "test_fork": 44,
    "test_loss_mask": 44,
    "test_threads": 37,
    "test_overlap_one_process": 33,
    "test_tiny_model": 29,
    "test_trust_record": 24,
    "test_agent_calculator": 22,
    "test_api": 21,
    "test_gc": 19,
    "test_vllm_scoring": 17,
    "test_teacher": 17,
    "test_judge": 16,
    "test_segments": 16,
    "test_learn": 15,
    "test_generation": 15,
    "test_staleness": 15,
    "test_io": 14,
    "test_s3server": 14,
    "test_retention": 12,
    "test_first_hour_four": 11,
    "test_no_dead_ends": 11,
    "test_precision": 10,
    "test_query": 10,
    "test_eval_cadence": 10,
    "test_cli_speed": 9,
    "test_trust_answers": 9,
    "test_progress": 8,
    "test_family_sampling": 8,
    "test_token_age": 7,
    "test_dynamic_sampling": 6,
    "test_episode_parts": 6,
    "test_old_logprobs": 5,
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
