"""`grpo export`: a run's committed policy (the newest, the best, or iteration k's) as a self-contained Hugging
Face folder, written by default under the run's folder."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from grpo.record.counts import is_local
from grpo.record.layout import export_dir, stage_dir
from grpo.record.storage import Storage, committed_attempts, url_to_fs
from grpo.report import best_iteration
from stages import StageError


def newest_learn(storage, run_id: str) -> int:
    """The last iteration of the unbroken chain of committed learns from 0 (-1: none yet)."""
    k = -1
    while committed_attempts(storage, stage_dir(storage, run_id, k + 1, "learn")):
        k += 1
    return k


def cmd_export(args, storage):
    from grpo.record.checkpoint import export_policy
    from grpo.record.lineage import committed_input
    from stages.common import load_run

    load_run(storage, args.run)
    if args.dir is not None and args.out is not None:
        raise StageError("export: name the folder to write once: `grpo export --run R DIR` or `--out DIR`")
    which = ""
    k = newest_learn(storage, args.run) if args.iteration is None else args.iteration
    if args.best:
        best = best_iteration(storage, args.run)
        if best is None:
            raise StageError(f"run {args.run}: no eval has run yet, so none is best; export --latest or --iteration K")
        if best.all_zero:
            raise StageError(
                f"run {args.run}: every eval so far scored {best.metric} 0, so none is best; "
                "export --latest or --iteration K"
            )
        k, which = best.iteration, f" (the best: {best.metric} {best.value:.4g})"
    base = committed_input(storage, args.run, None, "base")
    policy = base if k < 0 else export_source(storage, args.run, k)
    out = args.dir or args.out or default_export(storage, args.run, None if k < 0 else k)
    what = f"{'the base model' if k < 0 else f'the policy of iteration {k}'} of run {args.run}{which}"
    source = {"run_id": args.run, "iteration": None if k < 0 else k, **dataclasses.asdict(policy.ref())}
    fs, root = url_to_fs(out)
    try:
        export_policy(policy, base, out)
    except FileExistsError as e:
        if args.dir is None and args.out is None and _exported_from(fs, root) == source:
            print(f"{what}: exported already, {shown_path(out)}")
            return
        raise StageError(str(e)) from e
    fs.pipe_file(f"{root}/{EXPORT_SOURCE}", json.dumps(source, indent=1).encode())  # last: the export is whole
    print(f"{what}: {shown_path(out)}")


EXPORT_SOURCE = "grpo_export.json"
"""Written into an exported folder last: the run, iteration and committed attempt it holds (so a second export to
the default folder knows it is there already)."""


def default_export(storage: Storage, run_id: str, k: int | None) -> str:
    """Where `grpo export` writes without a folder named (layout.export_dir): a local path, or a URL."""
    path = export_dir(storage, run_id, k)
    return path if is_local(storage.fs) else storage.uri(path)


def _exported_from(fs, root: str) -> dict | None:
    """What an exported folder's EXPORT_SOURCE says it holds (None: none, or not readable)."""
    try:
        return json.loads(fs.cat_file(f"{root}/{EXPORT_SOURCE}"))
    except (OSError, ValueError):
        return None


def shown_path(out: str) -> str:
    """A local folder relative to the working folder where under it (to paste into from_pretrained), else as is."""
    path = Path(out)
    return str(path.relative_to(Path.cwd())) if path.is_absolute() and path.is_relative_to(Path.cwd()) else out


def export_source(storage, run_id: str, k: int):
    """Iteration k's committed learn, verified; one line when it has none, its files changed after the commit
    (committed_input says so) or `grpo gc --retention` collected its policy."""
    from grpo.record.checkpoint import ADAPTER_PREFIX, CHECKPOINT_PREFIX
    from grpo.record.lineage import committed_input

    if not committed_attempts(storage, stage_dir(storage, run_id, k, "learn")):
        n = newest_learn(storage, run_id)
        newest = f"the newest committed is iteration {n}" if n >= 0 else "none is committed yet"
        raise StageError(f"run {run_id}: iteration {k} has no committed learn (its policy is not committed; {newest})")
    policy = committed_input(storage, run_id, k, "learn")
    if any(p.startswith((CHECKPOINT_PREFIX, ADAPTER_PREFIX)) for p in policy.collected):
        raise StageError(f"run {run_id}: the policy of iteration {k} was collected by `grpo gc --retention`")
    return policy
