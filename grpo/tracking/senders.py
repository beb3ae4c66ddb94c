"""One sender a tracker: `send` puts a Batch into the tracker run (made on the first send) and returns its id,
`end` marks it ended when the command ends (MLflow FINISHED or FAILED, W&B's exit code). TensorBoard has no run
state and no tables: its settings go in as hparams and a text table, its completions as text."""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field


@dataclass
class Batch:
    """What one send carries."""

    metrics: list[tuple[int, dict[str, float]]]
    """(iteration, {tracked name: value}), ascending."""
    completions: list[tuple[int, list[dict]]]
    """(iteration, rows of {iteration, prompt_id, prompt, response, reward})."""
    settings: dict[str, str | int | float | bool]
    """Every setting (figures.settings), sent with the tracker run's first batch."""
    tags: dict[str, str] = field(default_factory=dict)
    """grpo.run_id, and a fork's grpo.parent and grpo.fork_at."""


COLUMNS = ["iteration", "prompt_id", "prompt", "response", "reward"]


def markdown(rows: list[dict], columns: list[str], limit: int = 500) -> str:
    """A markdown table of `rows` (TensorBoard's text), each cell cut at `limit` characters.

    >>> print(markdown([{"a": 1, "b": "x|y"}], ["a", "b"]))
    | a | b |
    | --- | --- |
    | 1 | x\\|y |
    """

    def cell(v) -> str:
        return " ".join(str(v).split())[:limit].replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    return "\n".join(lines + ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in rows])


class TensorBoard:
    @staticmethod
    def send(folder: str, t, tracker_id: str | None, batch: Batch) -> str:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        with SummaryWriter(log_dir=tracker_id or folder) as writer:  # a new event file beside the earlier ones
            if tracker_id is None:  # once: the run's tags and settings (hparams: the HParams tab; text: a table)
                writer.add_text("grpo", ", ".join(f"{k}={v}" for k, v in batch.tags.items()))
                for summary in hparams(batch.settings, {}):
                    writer.file_writer.add_summary(summary)
                rows = [{"setting": k, "value": v} for k, v in batch.settings.items()]
                writer.add_text("settings", markdown(rows, ["setting", "value"]))
            for step, values in batch.metrics:
                for key, value in values.items():
                    writer.add_scalar(key, value, global_step=step)
            for step, rows in batch.completions:
                writer.add_text("completions", markdown(rows, COLUMNS), global_step=step)
        return tracker_id or folder

    @staticmethod
    def end(t, tracker_id: str, failed: bool) -> None:
        """Event files have no run state."""


class MLflow:
    """One log_batch call (one transaction of its store) per MLFLOW_BATCH values: 10-25 ms an iteration on SQLite
    here, where a log_metric call per value committed each on its own, 0.1-0.4 s. What stays is MLflow's own
    start: importing mlflow and its SQL store, ~5 s a process, and a new SQLite store's creation, once (its 72
    schema migrations, 4-10 s on 2 busy cores)."""

    BATCH = 1000  # the most metrics (or params) MLflow's log_batch takes in one call
    VALUE = 6000  # the longest param value MLflow keeps

    @staticmethod
    def client(t):
        import mlflow

        return mlflow.tracking.MlflowClient(t.uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db")

    @classmethod
    def send(cls, folder: str, t, tracker_id: str | None, batch: Batch) -> str:
        from mlflow.entities import Metric, Param

        client = cls.client(t)
        if tracker_id is None:
            experiment = client.get_experiment_by_name(t.project)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(t.project)
            tracker_id = client.create_run(experiment_id, run_name=batch.tags["grpo.run_id"], tags=batch.tags)
            tracker_id = tracker_id.info.run_id
            params = [Param(k, str(v)[: cls.VALUE]) for k, v in batch.settings.items()]
            for i in range(0, len(params), cls.BATCH):
                client.log_batch(tracker_id, params=params[i : i + cls.BATCH])
        elif client.get_run(tracker_id).info.status != "RUNNING":  # a later command goes on with the run
            client.update_run(tracker_id, status="RUNNING")
        now = int(time.time() * 1000)
        values = [Metric(k.replace("@", "_at_"), v, now, step) for step, row in batch.metrics for k, v in row.items()]
        for i in range(0, len(values), cls.BATCH):
            client.log_batch(tracker_id, metrics=values[i : i + cls.BATCH])
        for step, rows in batch.completions:
            with warnings.catch_warnings():  # pandas 3 on mlflow's select_dtypes("object"): nothing to act on
                warnings.filterwarnings("ignore", message=".*select_dtypes.*")
                table = {c: [r[c] for r in rows] for c in COLUMNS}
                client.log_table(tracker_id, table, f"completions/iter-{step:04d}.json")
        return tracker_id

    @classmethod
    def end(cls, t, tracker_id: str, failed: bool) -> None:
        cls.client(t).set_terminated(tracker_id, status="FAILED" if failed else "FINISHED")


class WandB:
    @staticmethod
    def start(t, tracker_id: str | None, batch: Batch | None = None):
        import wandb

        tags = batch.tags if batch else {}
        labels = [f"{k.removeprefix('grpo.')}:{v}" for k, v in tags.items() if k != "grpo.run_id"]
        config = {**batch.settings, **tags} if batch else None
        return wandb.init(project=t.project, name=tags.get("grpo.run_id"), id=tracker_id, resume="allow",
                          reinit=True, tags=labels, config=config)  # fmt: skip

    @classmethod
    def send(cls, folder: str, t, tracker_id: str | None, batch: Batch) -> str:
        import wandb

        run = cls.start(t, tracker_id, batch)
        try:
            tables = dict(batch.completions)
            for step, values in batch.metrics:
                rows = tables.get(step, [])
                table = {"completions": wandb.Table(columns=COLUMNS, data=[[r[c] for c in COLUMNS] for r in rows])}
                run.log({**values, **(table if rows else {})}, step=step)
            return run.id
        finally:
            run.finish()

    @classmethod
    def end(cls, t, tracker_id: str, failed: bool) -> None:
        """Each send finished the run with exit code 0; a failed command marks it failed."""
        if failed:
            cls.start(t, tracker_id).finish(exit_code=1)


SENDERS = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB}
