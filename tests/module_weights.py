"""The order pytest-xdist hands the test modules to its workers: heaviest first. `--dist loadfile` gives a worker a
whole module, in the order collected (pyproject.toml's `--no-loadscope-reorder` keeps that order: xdist would
otherwise start with the modules of most tests, which are fast, and leave the long one-test e2e modules for last,
where one worker runs them alone while the other idles). Longest first, the two workers end within a module or two of
each other, whatever the weights' machine: only their order matters.

SECONDS: each module's setup + call + teardown, summed from a full `pytest -n 2 --dist loadfile --durations=0` on
2 cores (commit c834870; modules under 5 s left out: they weigh 0 and fill the end). Remeasure when modules move:

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=0 > durations.log
    python tests/module_weights.py durations.log
"""

from __future__ import annotations

import collections
import re
import sys

SECONDS = {
    "test_overlap_resume": 266,
    "test_sharding": 216,
    "test_nodes": 188,
    "test_placement_e2e": 169,
    "test_flow_e2e": 159,
    "test_flow": 158,
    "test_readme": 146,
    "test_gpu_check": 127,
    "test_lora": 124,
    "test_report": 117,
    "test_readme_tools": 108,
    "test_episodes": 92,
    "test_first_hour": 79,
    "test_stages": 75,
    "test_real_path": 72,
    "test_prefect_quiet": 68,
    "test_sft": 62,
    "test_resume": 62,
    "test_stage_workers_e2e": 60,
    "test_episode_segments": 58,
    "test_no_orphans": 57,
    "test_family_iterations": 55,
    "test_checkpoint_families": 46,
    "test_state": 41,
    "test_overlap_e2e": 39,
    "test_overlap_one_process": 31,
    "test_trust_rewards": 31,
    "test_loss_mask": 29,
    "test_openenv": 28,
    "test_tiny_model": 26,
    "test_fork": 23,
    "test_push_to_hub": 23,
    "test_threads": 22,
    "test_gc": 20,
    "test_agent_calculator": 20,
    "test_segments": 20,
    "test_vllm_scoring": 22,
    "test_generation": 17,
    "test_teacher": 16,
    "test_placement_check": 16,
    "test_io": 15,
    "test_s3server": 14,
    "test_staleness": 14,
    "test_trust_record": 14,
    "test_judge": 13,
    "test_api": 13,
    "test_learn": 13,
    "test_first_hour_four": 12,
    "test_eval_cadence": 12,
    "test_retention": 11,
    "test_precision": 10,
    "test_cli_speed": 10,
    "test_query": 10,
    "test_progress": 9,
    "test_no_dead_ends": 8,
    "test_family_sampling": 8,
    "test_trust_answers": 8,
    "test_episode_parts": 7,
    "test_trust_inputs": 6,
    "test_openenv_sessions": 5,
    "test_token_age": 5,
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
