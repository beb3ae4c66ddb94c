"""The run's progress as Prefect artifacts: a table of each iteration's headline figures and a report with
the plots of `grpo report`."""

from __future__ import annotations

import base64
import contextvars
import hashlib
import re
import threading
import time

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.exceptions import FailedRun

from flows.tasks import USER_ERRORS
from grpo.record.storage import Storage
from grpo.report import best_iteration, figure_png, headline, iteration_rows, markdown_table, write_report

PLOT_DPI = 50  # the report artifact's embedded plot: ~600 x 325 pixels, tens of kB in the server's database


def artifact_key(storage_url: str, run_id: str) -> str:
    """`<run>-<6 hex of the storage URL>`: runs of one name in two storages keep artifacts of their own
    (a Prefect artifact key allows lowercase letters, digits and dashes).

    >>> artifact_key("s3://bucket/prefix", "My_Run")
    'my-run-9737a7'
    """
    digest = hashlib.sha256(storage_url.encode()).hexdigest()[:6]
    return re.sub(r"[^a-z0-9-]+", "-", run_id.lower()) + f"-{digest}"


class ProgressTable:
    """The run's progress as artifacts (keys `artifact_key(...)-progress` and `-report`): a table with a row
    of headline figures per committed iteration of the run, this flow's and earlier ones'
    (grpo.report.iteration_rows), reward and eval first; and a markdown report showing the plots of
    report.png in the run folder (`grpo report`), embedded, and naming that file. Republished at most
    every `every_s` seconds, in a thread beside the flow, and once at the end when something changed: each
    artifact costs the server ~15 ms of CPU, which a warm run of sub-second iterations would pay every
    iteration on the cores it trains on.
    """

    def __init__(self, storage: Storage, run_id: str, every_s: float = 30.0):
        self.storage, self.run_id, self.every_s = storage, run_id, every_s
        self.changed = False
        self.published_at = time.monotonic()
        self.beside: threading.Thread | None = None  # a publish under way beside the flow
        self.error: Exception | None = None  # what that publish raised, raised again by `wait`

    def __enter__(self) -> ProgressTable:
        return self

    def __exit__(self, kind, error, tb) -> None:
        """Published once more at the end: of the flow, or of a failure with a one-line cause (not a storage
        error, which publishing would meet again)."""
        if self.beside:
            self.beside.join()
        if error is None or isinstance(error, (FailedRun, *USER_ERRORS)):
            self.wait()
            self.publish()

    def add(self) -> None:
        """An iteration committed. Published in a thread beside the flow, which goes on to dispatch its next
        stages: the plots take seconds of CPU (3-9 s on 2 busy cores), which with stages placed elsewhere the
        next iteration's sampling waited for (benchmarks/overlap.py)."""
        self.changed = True
        if time.monotonic() - self.published_at >= self.every_s and not (self.beside and self.beside.is_alive()):
            self.wait()
            run = contextvars.copy_context().run  # the flow run's context: the artifacts belong to it
            self.beside = threading.Thread(target=run, args=(self._publish_beside,), daemon=True)
            self.beside.start()

    def _publish_beside(self) -> None:
        try:
            self.publish()
        except Exception as e:  # raised in the flow by the next `wait`
            self.error = e

    def wait(self) -> None:
        """The publish beside the flow ended; what it raised is raised here."""
        if self.beside:
            self.beside.join()
            self.beside = None
        if self.error:
            error, self.error = self.error, None
            raise error

    def publish(self) -> None:
        if not self.changed:
            return
        self.changed = False  # before reading: an iteration added meanwhile is published next time
        committed = iteration_rows(self.storage, self.run_id)
        if not committed:  # no iteration of the run committed yet
            return
        rows = [{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()} for row in committed]
        key, where = artifact_key(self.storage.url, self.run_id), f"run {self.run_id} in {self.storage.url}"
        span = f"iterations {rows[0]['iteration']}..{rows[-1]['iteration']}"
        create_table_artifact(rows, key=f"{key}-progress", description=f"{where}, {span}")
        png, _ = write_report(self.storage, self.run_id, committed)
        best = best_iteration(self.storage, self.run_id, [r["iteration"] for r in committed])
        plot = base64.b64encode(figure_png(committed, f"run {self.run_id}: {span}", PLOT_DPI, best)).decode()
        create_markdown_artifact(
            f"# Run {self.run_id}, {span}\n\n{headline(committed, best)}\n\n![mean reward, held-out eval, KL, clip "
            f"fraction, entropy, response length](data:image/png;base64,{plot})\n\n(full size: {png})\n\n"
            + markdown_table(
                rows[-20:], ["iteration", "reward_mean", "eval_exact_match", "kl", "clip_frac", "entropy"]
            ),
            key=f"{key}-report",
            description=f"{where}: plots and the last 20 iterations",
        )
        self.published_at = time.monotonic()
