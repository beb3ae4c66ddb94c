"""Experiment tracking: each committed iteration's figures (grpo.report.iteration_rows) sent once to
TensorBoard, MLflow or Weights & Biases, keyed by iteration.

The figures come from the committed manifests, so a resumed or rerun iteration sends the values that
were committed, once: `tracking.json` in the run folder records the iterations already sent and the
tracker's own run id, so a later process (a resume, the next `grpo/iteration` flow run) continues the
same tracker run; it is replaced whole (Storage.write_bytes_atomic), never left half-written. Called
after every iteration by stages.iteration.run_warm and the flow `grpo`. A fork (grpo.record.fork) is a tracker run of
its own, tagged with its parent and fork point (`grpo.parent`, `grpo.fork_at`), its referenced iterations sent
as its own.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from grpo.config import RunConfig, TrackingConfig
from grpo.errors import StageError
from grpo.record.counts import is_local
from grpo.record.fork import fork_of
from grpo.record.layout import run_dir
from grpo.record.storage import Storage
from grpo.report import iteration_rows


def state_path(storage: Storage, run_id: str) -> str:
    return f"{run_dir(storage, run_id)}/tracking.json"


def _load_state(storage: Storage, run_id: str) -> dict:
    """What tracking.json says was sent ({} before the first send); a damaged one fails naming it."""
    path = state_path(storage, run_id)
    if not storage.exists(path):
        return {}
    try:
        state = json.loads(storage.read_bytes(path))
    except ValueError:  # JSONDecodeError, UnicodeDecodeError: a file cut short or overwritten
        state, why = None, "not valid JSON"
    else:
        why = "not the state grpo writes"
    sent = state.get("iterations", []) if isinstance(state, dict) else None
    if not isinstance(sent, list) or not all(isinstance(k, int) for k in sent):
        raise StageError(
            f"{storage.uri(path)}: damaged ({why}); delete it and rerun: tracking restarts a new tracker run"
        )
    return state


def event_dir(storage: Storage, run_id: str, t: TrackingConfig) -> str:
    """Where TensorBoard event files go: tracking.dir, else the run folder on local storage, else
    ./tensorboard/<run_id>."""
    if t.dir:
        return str(Path(t.dir) / run_id)
    if is_local(storage.fs):
        return f"{run_dir(storage, run_id)}/tensorboard"
    return str(Path("tensorboard") / run_id)


def track(storage: Storage, run_id: str, cfg: RunConfig) -> list[int]:
    """Send every committed iteration not sent yet; returns the iterations sent now."""
    t = cfg.tracking
    if t.backend == "none":
        return []
    state = _load_state(storage, run_id)
    sent = set(state.get("iterations", []))
    rows = iteration_rows(storage, run_id, skip=sent)
    if not rows:
        return []
    metrics = [
        (r["iteration"], {k: float(v) for k, v in r.items() if k != "iteration" and v is not None}) for r in rows
    ]
    tags = {"grpo.run_id": run_id}
    if fork := fork_of(storage, run_id):  # a fork is a tracker run of its own, tagged with its lineage
        tags.update({"grpo.parent": fork["parent"], "grpo.fork_at": str(fork["at"])})
    state["tracker_run_id"] = SENDERS[t.backend](storage, run_id, t, state.get("tracker_run_id"), metrics, tags)
    state["backend"] = t.backend
    state["iterations"] = sorted(sent | {k for k, _ in metrics})
    storage.write_bytes_atomic(state_path(storage, run_id), json.dumps(state, indent=1).encode())
    return [k for k, _ in metrics]


def _tensorboard(storage, run_id, t, tracker_id, metrics, tags) -> str:
    from torch.utils.tensorboard import SummaryWriter

    folder = event_dir(storage, run_id, t)
    with SummaryWriter(log_dir=folder) as writer:  # a new event file beside the earlier ones: one run
        if tracker_id is None:  # the run's tags, once, as text (TensorBoard has no run tags)
            writer.add_text("grpo", ", ".join(f"{k}={v}" for k, v in tags.items()))
        for step, values in metrics:
            for key, value in values.items():
                writer.add_scalar(key, value, global_step=step)
    return tracker_id or folder


def _mlflow(storage, run_id, t, tracker_id, metrics, tags) -> str:
    """MLflow: one log_batch call (one transaction of its store) per MLFLOW_BATCH values: 10-25 ms an iteration on
    SQLite here, where a log_metric call per value (~25 an iteration) committed each on its own, 0.1-0.4 s. What
    stays is MLflow's own start: importing mlflow and its SQL store, ~5 s a process, and a new SQLite store's
    creation, once (its 72 schema migrations, 4-10 s on 2 busy cores)."""
    import mlflow
    from mlflow.entities import Metric

    client = mlflow.tracking.MlflowClient(t.uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db")
    if tracker_id is None:
        experiment = client.get_experiment_by_name(t.project)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(t.project)
        tracker_id = client.create_run(experiment_id, run_name=run_id, tags=tags).info.run_id
    now = int(time.time() * 1000)
    values = [Metric(key.replace("@", "_at_"), v, now, step) for step, row in metrics for key, v in row.items()]
    for i in range(0, len(values), MLFLOW_BATCH):
        client.log_batch(tracker_id, metrics=values[i : i + MLFLOW_BATCH])
    return tracker_id


MLFLOW_BATCH = 1000  # the most metrics MLflow's log_batch takes in one call


def _wandb(storage, run_id, t, tracker_id, metrics, tags) -> str:
    import wandb

    labels = [f"{k.removeprefix('grpo.')}:{v}" for k, v in tags.items() if k != "grpo.run_id"]
    run = wandb.init(
        project=t.project, name=run_id, id=tracker_id, resume="allow", reinit=True, tags=labels, config=tags
    )
    try:
        for step, values in metrics:
            run.log(values, step=step)
        return run.id
    finally:
        run.finish()


SENDERS = {"tensorboard": _tensorboard, "mlflow": _mlflow, "wandb": _wandb}
