"""The Prefect flow `grpo`: one GRPO iteration as six tasks over storage.

    snapshot -> rollouts -> rewards -> advantages -> learn -> eval

Each task (flows/tasks.py) wraps one stage function from `stages/` and passes storage URIs only; a stage
runs here or where `placement` puts it (flows/placement.py).
A stage whose output is already committed with the same identity is reused, so
running the flow again after a failure (or `prefect flow-run retry <id>`) picks
up at the first missing stage; `force_stage` reruns one stage, and the stages
after it rerun because their inputs changed. The stages' `grpo` logger (rollout
progress, the learner's torchrun lines) and vLLM's logger go to the run's log, and
a table artifact `<run>-<storage hash>-progress` holds each iteration's reward, loss and eval.

    python -m flows.grpo                          # one iteration, no server needed
    prefect deployment run grpo/iteration         # one iteration per flow run (prefect.yaml)
    prefect deployment run grpo/train             # many iterations in one warm process
"""

from __future__ import annotations

from typing import Literal

from prefect import flow

from flows.artifacts import ProgressTable
from flows.deploy import work_in_checkout  # noqa: F401 (prefect.yaml's pull step, by this module's name too)
from flows.logs import stage_logs_to_prefect
from flows.placement import (
    Placement,
    check_placement,
    stage_flow,  # noqa: F401 (the entrypoint deployments made before flows/placement.py name)
    stages_here,
)
from flows.tasks import create_run, failed, ok, warm_start
from grpo.record.layout import OptionalStageName, StageName
from grpo.record.lineage import next_iteration
from grpo.record.storage import Storage, open_storage
from grpo.runtime.threads import apply_threads
from grpo.tracking import track, tracking
from stages.common import load_run
from stages.iteration import warm_state


def flow_run_label() -> str:
    """flow_run_name of grpo: the run and its iterations, `p1-3` (one) or `p1-3..12` (warm); the run id alone
    where storage cannot say which is next (the flow body then fails with its one line)."""
    from prefect.runtime import flow_run

    p = flow_run.parameters
    try:
        first = resolve_iteration(open_storage(p.get("storage_url")), p["run_id"], p.get("iteration", "next"))
    except Exception:
        return p["run_id"]
    last = first + p.get("iterations", 1) - 1
    return f"{p['run_id']}-{first}" + (f"..{last}" if last > first else "")


@flow(name="grpo", flow_run_name=flow_run_label)
def grpo(
    run_id: str = "demo",
    iteration: int | Literal["next"] = "next",
    iterations: int = 1,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    storage_url: str | None = None,
    force_stage: StageName | OptionalStageName | None = None,
    placement: dict[str, str] | None = None,
) -> dict[str, str]:
    """GRPO iterations of run `run_id`: sample, score, normalize, update, evaluate.

    Runs `iterations` iterations from `iteration` on, in this one process: the sampling engine
    and the learner's model and optimizer stay in memory from one iteration to the next (warm),
    and every stage still commits what a run of one iteration per process would. Returns the
    last iteration's committed URIs. `config_path`/`overrides` create the run if it does not
    exist; `storage_url` defaults to $GRPO_STORAGE or ./storage; `force_stage` reruns that
    stage of the first iteration (and so every later stage; `teacher` only in a run with a teacher section, as in
    `placement`). `placement` ({stage: work pool}) runs those stages as flow runs of deployment
    `grpo-stage/<pool>` (flows/placement.py), the rest here. With
    rollout.staleness >= 1 and learn on a pool of its own, or here on another device than the sampler's
    (learn.device, rollout.device: learn k then runs in a thread of this flow run), iteration k+1 samples (and
    iteration k's eval runs) while learn k runs: which policy samples which rows is fixed by the config, not by
    this overlap. The devices of the stages that run here are checked before anything is written.
    """
    apply_threads()  # GRPO_THREADS (grpo/runtime/threads.py)
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    storage = open_storage(storage_url)
    try:
        with stage_logs_to_prefect(), warm_state() as warm, ProgressTable(storage, run_id) as progress:
            check_placement(placement)
            named = {s: "placement" for s in placement or {}} | ({force_stage: "force_stage"} if force_stage else {})
            ok(create_run(storage.url, run_id, config_path, overrides or [], stages_here(placement), named))
            first, cfg = resolve_iteration(storage, run_id, iteration), load_run(storage, run_id)
            if cfg.sft is not None:  # the warm start before the first iteration, and GRPO only past its gate
                ok(warm_start(storage.url, run_id))
            with tracking(storage, run_id, cfg):  # the tracker run ends FINISHED or FAILED with the flow run
                behind = None  # an iteration whose learn runs (on its pool, or in a thread) while the next one samples

                def finish(done) -> dict[str, str]:  # its eval; then what one process keeps warm, and the tracker
                    out = done.evaluate()
                    progress.add()
                    warm.loaded()  # pool, learner, engine: kept for the next iteration
                    track(storage, run_id, cfg)
                    return out

                for k in range(first, first + iterations):
                    force, last = force_stage if k == first else None, k == first + iterations - 1
                    stage = Placement(placement, storage, run_id, k, cfg, force, last)  # runs a stage, here or placed
                    uris = sample(stage)  # snapshot -> rollouts -> rewards -> advantages
                    if behind:
                        behind.learned()  # learn k-1 ends: iteration k sampled meanwhile
                    learning = stage.learn(uris)  # learn k, where it is placed
                    if behind:
                        uris = finish(behind)  # eval k-1, beside learn k
                    behind = learning if stage.overlaps and not last else None
                    if not behind:
                        uris = finish(learning)
    except Exception as e:  # a stage's one line, a bad setting or a storage error no retry mends: the run's end
        return failed(e, storage.url)
    return uris


def sample(stage: Placement) -> dict[str, str]:
    """One iteration's samples, scored and normalized: the committed URIs of snapshot (learn k-1-S's policy, the
    base before it), rollouts, rewards, the teacher's log-probs (only with a teacher section) and advantages."""
    policy = stage("snapshot", None)
    samples = stage("rollouts", policy)
    scores = stage("rewards", samples)
    uris = {"snapshot": policy, "rollouts": samples, "rewards": scores}
    if stage.distills:  # on-policy distillation: the teacher scores the samples' tokens
        uris["teacher"] = stage("teacher", samples)
    return uris | {"advantages": stage("advantages", scores)}


def resolve_iteration(storage: Storage, run_id: str, iteration: int | str) -> int:
    """An explicit iteration, or "next": the first one not finished (grpo.record.lineage.next_iteration)."""
    return next_iteration(storage, run_id) if iteration == "next" else int(iteration)


if __name__ == "__main__":
    grpo()  # one iteration of run "demo" in $GRPO_STORAGE or ./storage, on an ephemeral Prefect API
