"""What a command's last lines tell the user to type next: grpo as called from here, the commands to try after
the demo, the newest policy with the command that exports it."""

from __future__ import annotations

import sys
from pathlib import Path

from flows.commands.export import default_export, shown_path
from grpo.record.layout import run_dir, stage_dir
from grpo.record.lineage import newest_current_learn
from grpo.record.storage import committed_attempts


def grpo_command(storage_arg: str | None) -> str:
    """How to call grpo again from here: the venv's script (relative when under the working folder)."""
    script = Path(sys.executable).with_name("grpo")
    command = "grpo"
    if script.exists():
        command = str(script.relative_to(Path.cwd())) if script.is_relative_to(Path.cwd()) else str(script)
    return command + (f" --storage {storage_arg}" if storage_arg else "")


def next_steps(storage, run_id: str, storage_arg: str | None) -> str:
    grpo = grpo_command(storage_arg)
    return (
        f"run {run_id}: {storage.uri(run_dir(storage, run_id))}\n"
        f"next: {grpo} status --run {run_id}                 # iterations x stages\n"
        f'      {grpo} query --run {run_id} "SELECT iteration, avg(reward) FROM rewards GROUP BY 1 ORDER BY 1"\n'
        f"      {grpo} report --run {run_id}                 # report.png and report.md in the run folder\n"
        f"      {grpo} run --run {run_id} --iterations 10    # 10 more\n"
        f"      {grpo} export --run {run_id}                 # the newest policy as a Hugging Face folder under the run"
    )


def newest_policy(storage, run_id: str, storage_arg: str | None) -> str:
    """Where the newest current policy is and the command that exports it ('' before the first learn); a stale chain
    (a stage rerun under it) is named as such with the command that rebuilds it, never offered as the newest."""
    k, stale = newest_current_learn(storage, run_id)
    grpo = grpo_command(storage_arg)
    rebuild = (
        f"stale: learn {stale} and what follows it were made from inputs a newer attempt replaced; rebuild them with "
        f"`{grpo} run --run {run_id} --start {stale}`"
        if stale is not None
        else ""
    )
    if k < 0:
        return rebuild
    attempt = committed_attempts(storage, stage_dir(storage, run_id, k, "learn"))[-1]
    into = shown_path(default_export(storage, run_id, k))
    asked = "" if stale is None else f" --iteration {k}"
    lines = [
        f"newest {'current ' if stale is not None else ''}policy: iteration {k}, {storage.uri(attempt)}",
        f"export it: {grpo} export --run {run_id}{asked}   # into {into}",
    ]
    return "\n".join(lines + ([rebuild] if rebuild else []))
