"""Long-lived stage workers: a Prefect task worker that serves some stages' tasks and keeps what they load
(the sampling engine, the learner's model and optimizer, the reward pool) between iterations.

    python -m flows.stage_worker rollouts eval                 # the sampler's GPU: its engine stays loaded
    python -m flows.stage_worker learn                         # the learner's GPU: model and AdamW stay loaded
    python -m flows.stage_worker rewards advantages snapshot   # on a CPU machine

A worker runs one task at a time, so learn has a worker of its own: with rollout.staleness >= 1 it runs while the
sampling workers sample the next iteration (docs/prefect.md, "Warm stage workers").

The flow `grpo` sends a stage placed on `warm` (`placement={"rollouts": "warm", ...}`) to whichever
worker serves it (`Task.delay`) and waits; the stage commits to storage as everywhere else, and the
flow reads its manifest there. Prefect hands a task run's parameters to the worker through result
storage: on one machine the default local folder; across machines set PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK
(or PREFECT_LOCAL_STORAGE_PATH on a shared mount) to a store both sides reach. A worker runs torch on half
the machine's cores unless told otherwise (`--threads`, GRPO_THREADS: grpo/runtime/threads.py), as two share one
in the README's layout.
"""

from __future__ import annotations

import argparse
import os
import signal

from prefect.task_worker import serve

from flows.logs import stage_logs_to_prefect
from flows.tasks import TASKS
from grpo.runtime import threads
from stages.iteration import warm_state


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flows.stage_worker", description=__doc__.split("\n")[0])
    p.add_argument("stages", nargs="+", choices=sorted(TASKS), help="the stages this machine runs")
    p.add_argument(
        "--threads",
        default=os.environ.get(threads.ENV, threads.SHARED_MACHINE),
        help="torch's CPU threads: N, or cores/K for K processes sharing the machine (default $GRPO_THREADS, else "
        f"{threads.SHARED_MACHINE}: this worker and another on one machine)",
    )
    args = p.parse_args(argv)
    # started with `&` from a script, SIGINT comes ignored, and the Ctrl-C or `kill -INT` (or Prefect's SIGTERM
    # turned into SIGINT) that stops a worker would do nothing: one signal stops it, as in a terminal
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ[threads.ENV] = args.threads
    threads.apply_threads()  # before any stage: its tasks run in this process
    # one task at a time: a stage owns the machine's accelerator while it runs
    with stage_logs_to_prefect(), warm_state():
        serve(*(TASKS[s] for s in dict.fromkeys(args.stages)), limit=1)


if __name__ == "__main__":
    main()
