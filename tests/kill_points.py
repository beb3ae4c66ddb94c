"""Test-only holds at named points of the stages, for SIGKILL tests: a process that reaches a point writes
`<folder>/<point>` and waits there until the test, seeing the file, kills it (or lets it go on: `<folder>/<point>.go`).
The kill then lands at that point whatever the machine's speed: no sleep guesses.

    python -c "import kill_points; kill_points.install('/tmp/held', ['learn:2', 'rollouts:3']); ..."

Points (iteration k):
    learn:k     learn k after its first optimizer step, before its second (the update half done)
    rollouts:k  rollouts k after its first chunk's rows reached the file, before the next chunk is sampled
    rewards:k   rewards k committing: its files written and hashed, its manifest not yet written
    episodes:k  rollouts k with episodes (grpo/episodes), every environment's first answer in, no second turn sampled
    segments:k  rollouts k with rollout.segment_tokens, its first sampler call's responses continued, nothing written
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def hold(folder: str, point: str) -> None:
    """Say this process reached `point` (a file the test waits for), then wait to be killed or let go."""
    Path(folder, point).write_text("")
    while not Path(folder, f"{point}.go").exists():
        time.sleep(0.05)


def kill_iterations_at(point: str, url: str, run_id: str, iterations: int, tmp: Path, last: bool = True) -> None:
    """Run iterations 0..iterations-1 of `run_id` (stages.iteration.run_iteration, `last` as given) in a new process,
    hold it at `point`, then SIGKILL its process group (the stage process and every worker it started) at once. Its
    output goes to `tmp`/killed.log, shown if it ends before reaching the point."""
    held = tmp / "held"
    held.mkdir()
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import kill_points;"
        f"kill_points.install(sys.argv[2], [{point!r}]);"
        "from grpo.record.storage import open_storage; from stages.iteration import run_iteration;"
        f"[run_iteration(open_storage(sys.argv[3]), {run_id!r}, k, last={last}) for k in range({iterations})]"
    )
    env = {**os.environ, "GRPO_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    args = [sys.executable, "-c", code, str(HERE), str(held), url]
    with open(tmp / "killed.log", "wb") as log:
        proc = subprocess.Popen(args, cwd=HERE.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    while not (held / point).exists():
        assert proc.poll() is None, (tmp / "killed.log").read_text()[-3000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def install(folder: str, points: list[str]) -> None:
    """Patch this process so that it holds at each of `points`."""
    import grpo.learner.loop
    import grpo.record.storage
    import schemas.parquet

    for point in points:
        stage, k = point.split(":")
        if stage == "learn":  # train reports each optimizer step as it ends: `learn k`, step n of N
            report = grpo.learner.loop.progress

            def progress(label, n, *a, _report=report, _label=f"learn {k}", _point=point, **kw):
                _report(label, n, *a, **kw)
                if label == _label and n == 1:
                    hold(folder, _point)

            grpo.learner.loop.progress = progress
        elif stage == "rollouts":  # each chunk of prompts is one row group, written as it is sampled
            write = schemas.parquet.ParquetWriter.write

            def write_rows(self, rows, _write=write, _dir=f"/iter-{int(k):04d}/rollouts/", _point=point):
                _write(self, rows)
                if self.name == "rollouts" and _dir in self.path:
                    self._file.flush()  # its bytes on disk, the file unfinished (no Parquet footer)
                    hold(folder, _point)

            schemas.parquet.ParquetWriter.write = write_rows
        elif stage == "rewards":  # the manifest, written last, is what commits an attempt
            put = grpo.record.storage.Storage.write_bytes_atomic

            def write_bytes_atomic(self, path, data, _put=put, _dir=f"/iter-{int(k):04d}/rewards/", _point=point):
                if _dir in path and path.endswith(f"/{grpo.record.storage.MANIFEST_NAME}"):
                    hold(folder, _point)
                _put(self, path, data)

            grpo.record.storage.Storage.write_bytes_atomic = write_bytes_atomic
        elif stage == "episodes":  # every environment has answered a turn; the episodes go on
            _hold_mid_episodes(folder, point, int(k))
        elif stage == "segments":  # the carried responses and the new ones, one sampler call into the round
            _hold_mid_segments(folder, point, int(k))
        else:
            raise ValueError(f"unknown kill point {point!r}")


def _hold_mid_episodes(folder: str, point: str, k: int) -> None:
    """Hold once iteration k's episode loop has its environments' first answers (every episode half done)."""
    import grpo.episodes.loop
    import grpo.episodes.workers

    at = {"iteration": None}
    sample, run = grpo.episodes.loop.Loop.run, grpo.episodes.workers.Workers.run

    def sample_chunk(self, starts, *a, **kw):
        at["iteration"] = starts[0].started if starts else None  # the iteration whose rollouts drew them
        return sample(self, starts, *a, **kw)

    def run_op(self, op, items):
        out = run(self, op, items)
        if op == "respond" and at["iteration"] == k:
            hold(folder, point)
        return out

    grpo.episodes.loop.Loop.run, grpo.episodes.workers.Workers.run = sample_chunk, run_op


def _hold_mid_segments(folder: str, point: str, k: int) -> None:
    """Hold once iteration k's segmented rollouts (stages/segments.py) have their first sampler call's answer."""
    import stages.segments

    sample = stages.segments.sample_segments

    def sample_iteration(loop, responses, cfg, iteration, *a, **kw):
        if iteration == k:
            generate = loop.gen.generate

            def generate_once(*args, **kwargs):
                out = generate(*args, **kwargs)
                hold(folder, point)
                return out

            loop.gen.generate = generate_once  # this generator, in this process only: it is killed here
        return sample(loop, responses, cfg, iteration, *a, **kw)

    stages.segments.sample_segments = sample_iteration
