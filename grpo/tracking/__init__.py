"""Experiment tracking: each committed iteration sent once to TensorBoard, MLflow or Weights & Biases, keyed by
iteration, as TRL's trackers show a run: its figures grouped by prefix, each reward function's mean and std, a
table of sample completions (where the tracker has tables), every setting as a parameter once, and the tracker run
ended FINISHED or FAILED when the command ends. What is sent: figures.py; to which tracker: senders.py.

The figures come from the committed manifests and tables, so a resumed or rerun iteration sends the values that
were committed, once: `tracking.json` in the run folder records the iterations already sent and the tracker's
own run id, so a later process (a resume, the next `grpo/iteration` flow run) continues the same tracker run; it
is replaced whole (Storage.write_bytes_atomic), never left half-written. `track` is called after every iteration
by stages.iteration.run_warm and the flow `grpo`, `ended` when either ends. A fork (grpo.record.fork) is a tracker
run of its own, tagged with its parent and fork point (`grpo.parent`, `grpo.fork_at`), its referenced iterations
sent as its own.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

from grpo.config import RunConfig, TrackingConfig
from grpo.errors import StageError
from grpo.record.counts import is_local
from grpo.record.fork import fork_of
from grpo.record.layout import run_dir
from grpo.record.storage import Storage
from grpo.report import iteration_rows
from grpo.tracking import figures
from grpo.tracking.senders import SENDERS, Batch


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
    """Where TensorBoard event files go, in a folder named after the run (`tensorboard --logdir` over its parent
    lists the run by its id): <tracking.dir>/<run_id>, else tensorboard/<run_id> in the run folder on local
    storage, else ./tensorboard/<run_id>. A tracker run begun elsewhere (tracking.json) stays where it began."""
    if t.dir:
        return str(Path(t.dir) / run_id)
    if is_local(storage.fs):
        return f"{run_dir(storage, run_id)}/tensorboard/{run_id}"
    return str(Path("tensorboard") / run_id)


_SENT_HERE: set[tuple[str, str]] = set()
"""(storage url, run id) of the runs this process sent to: `ended` ends those (MLflow's import costs seconds)."""


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
    tags = {"grpo.run_id": run_id}
    if fork := fork_of(storage, run_id):  # a fork is a tracker run of its own, tagged with its lineage
        tags.update({"grpo.parent": fork["parent"], "grpo.fork_at": str(fork["at"])})
    batch = Batch(
        metrics=[(r["iteration"], figures.iteration_metrics(storage, run_id, r)) for r in rows],
        completions=[(r["iteration"], figures.completions(storage, run_id, r["iteration"])) for r in rows],
        settings=figures.settings(cfg),
        tags=tags,
    )
    folder = event_dir(storage, run_id, t)
    state["tracker_run_id"] = SENDERS[t.backend].send(folder, t, state.get("tracker_run_id"), batch)
    state["backend"] = t.backend
    state["iterations"] = sorted(sent | {r["iteration"] for r in rows})
    storage.write_bytes_atomic(state_path(storage, run_id), json.dumps(state, indent=1).encode())
    _SENT_HERE.add((storage.url, run_id))
    return [r["iteration"] for r in rows]


def ended(storage: Storage, run_id: str, cfg: RunConfig, failed: bool) -> None:
    """The command that sent to the tracker run ends: MLflow's run FINISHED, or FAILED after an error (W&B's exit
    code 1). A later command that sends again reopens it. Nothing where this process sent nothing."""
    if (storage.url, run_id) not in _SENT_HERE or cfg.tracking.backend == "none":
        return
    _SENT_HERE.discard((storage.url, run_id))
    tracker_id = _load_state(storage, run_id).get("tracker_run_id")
    if tracker_id is not None:
        SENDERS[cfg.tracking.backend].end(cfg.tracking, tracker_id, failed)


@contextmanager
def tracking(storage: Storage, run_id: str, cfg: RunConfig):
    """Around a command's iterations: the tracker run ended when they end, FAILED if they raised."""
    try:
        yield
    except GeneratorExit:  # a caller of a generator of iterations stopped early (the demo reached its target)
        ended(storage, run_id, cfg, failed=False)
        raise
    except BaseException:
        ended(storage, run_id, cfg, failed=True)
        raise
    ended(storage, run_id, cfg, failed=False)
