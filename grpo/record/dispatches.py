"""When the orchestrating flow sent each placed stage off: `runs/<id>/dispatches.json`, {"<iteration>/<stage>": the
time it was sent}, written by flows/placement.py as it starts a stage's flow run on a pool (or its task on the stage
workers), read by `grpo timeline`: from then to the attempt's start the stage waited for its process (a worker to
take the flow run, a new Python process, its imports), apart from its work. Nothing else reads it; a stage run
again (a retry, the next flow run) replaces its time."""

from __future__ import annotations

import datetime as dt
import json
import threading

from grpo.record.layout import run_dir
from grpo.record.storage import Storage, now

_LOCK = threading.Lock()  # one orchestrator's threads (a learn beside the sampling) write it in turn


def path(storage: Storage, run_id: str) -> str:
    return f"{run_dir(storage, run_id)}/dispatches.json"


def note_sent(storage: Storage, run_id: str, iteration: int, stage: str) -> None:
    """Record that the flow sent iteration `iteration`'s `stage` off now."""
    with _LOCK:
        sent = _read(storage, run_id)
        sent[f"{iteration}/{stage}"] = now()
        storage.write_bytes_atomic(path(storage, run_id), json.dumps(sent, indent=1, sort_keys=True).encode())


def sent_times(storage: Storage, run_id: str) -> dict[tuple[int, str], dt.datetime]:
    """{(iteration, stage): when the flow sent it off} of the run's placed stages ({} where none was placed)."""
    out = {}
    for key, at in _read(storage, run_id).items():
        k, _, stage = key.partition("/")
        out[int(k), stage] = dt.datetime.fromisoformat(at)
    return out


def _read(storage: Storage, run_id: str) -> dict[str, str]:
    try:
        sent = json.loads(storage.read_bytes(path(storage, run_id)))
    except FileNotFoundError:
        return {}
    except ValueError:  # replaced whole, so never half-written; an edited one starts again
        return {}
    return sent if isinstance(sent, dict) else {}
