"""The Prefect flow `grpo`: one GRPO iteration as six tasks over storage.

    snapshot -> rollouts -> rewards -> advantages -> learn -> eval

Each task wraps one stage function from `stages/` and passes storage URIs only.
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

import base64
import errno
import hashlib
import logging
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.exceptions import FailedRun
from prefect.logging.handlers import APILogHandler
from prefect.states import Failed, State

from grpo.config import ConfigError
from grpo.errors import StageError, describe, storage_error
from grpo.layout import STAGES, StageName, stage_dir
from grpo.quiet import HarmlessFilter, quiet_libraries
from grpo.report import best_iteration, figure_png, headline, iteration_rows, markdown_table, write_report
from grpo.storage import ArtifactError, latest_committed, open_storage
from grpo.threads import SHARED_MACHINE, apply_threads
from grpo.tracking import track
from schemas import SchemaError
from stages import stage_function
from stages.common import load_run
from stages.init import init_run, run_config
from stages.iteration import next_iteration, warm_state

FORWARDED_LOGGERS = ("grpo", "vllm")


def flow_run_label() -> str:
    """flow_run_name of grpo: the run and its iterations, `p1-3` (one) or `p1-3..12` (warm); the run id alone
    where storage cannot say which is next (the flow body then fails with its one line)."""
    from prefect.runtime import flow_run

    p = flow_run.parameters
    try:
        first = resolve_iteration(open_storage(p.get("storage_url")).url, p["run_id"], p.get("iteration", "next"))
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
    force_stage: StageName | None = None,
    placement: dict[str, str] | None = None,
) -> dict[str, str]:
    """GRPO iterations of run `run_id`: sample, score, normalize, update, evaluate.

    Runs `iterations` iterations from `iteration` on, in this one process: the sampling engine
    and the learner's model and optimizer stay in memory from one iteration to the next (warm),
    and every stage still commits what a run of one iteration per process would. Returns the
    last iteration's committed URIs. `config_path`/`overrides` create the run if it does not
    exist; `storage_url` defaults to $GRPO_STORAGE or ./storage; `force_stage` reruns that
    stage of the first iteration (and so every later stage). `placement` ({stage: work pool})
    runs those stages as flow runs of deployment `grpo-stage/<pool>` (`placed`), the rest here.
    """
    apply_threads()  # GRPO_THREADS (grpo/threads.py)
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    unknown = sorted(set(placement or {}) - set(STAGES))
    if unknown:
        return Failed(message=f"placement: unknown stage(s) {unknown}; stages: {list(STAGES)}")
    url = open_storage(storage_url).url
    progress = ProgressTable(url, run_id)
    with stage_logs_to_prefect(), warm_state() as warm:  # pool, learner, engine: kept between iterations
        try:
            ok(create_run(url, run_id, config_path, overrides or []))
            first = resolve_iteration(url, run_id, iteration)
            storage = open_storage(url)
            cfg = load_run(storage, run_id)  # for the tracker
            shards = {"rollouts": cfg.rollout.shards, "rewards": cfg.reward.shards}
            for k in range(first, first + iterations):
                force = {name: name == force_stage and k == first for name in STAGES}
                last = k == first + iterations - 1  # evaluated whatever eval.every says (stages.eval.due)
                at = Placement(placement or {}, url, run_id, k, force, shards, last)
                policy = ok(at("snapshot", None) or snapshot(url, run_id, k, force=force["snapshot"]))
                samples = ok(at("rollouts", policy) or rollouts(url, run_id, k, policy, force=force["rollouts"]))
                scores = ok(at("rewards", samples) or rewards(url, run_id, k, samples, force=force["rewards"]))
                advs = ok(at("advantages", scores) or advantages(url, run_id, k, scores, force=force["advantages"]))
                new_policy = ok(at("learn", advs) or learn(url, run_id, k, advs, force=force["learn"]))
                report = ok(at("eval", new_policy) or evaluate(url, run_id, k, new_policy, force["eval"], last))
                uris = {
                    "snapshot": policy,
                    "rollouts": samples,
                    "rewards": scores,
                    "advantages": advs,
                    "learn": new_policy,
                    "eval": report,
                }
                progress.add()
                warm.loaded()
                track(storage, run_id, cfg)
        except FailedRun as e:  # a stage's one-line error (USER_ERRORS): the flow run's final state
            progress.publish()
            return Failed(message=str(e))
        except USER_ERRORS as e:  # one raised between the tasks (a damaged tracking.json): its one line too
            progress.publish()
            return Failed(message=" ".join(str(e).split()))
        except Exception as e:  # storage read between the tasks (which iteration is next): no credentials...
            if not final_storage_error(e):
                raise
            return Failed(message=describe(e, url))
    progress.publish()
    return uris


# ---------------------------------------------------------------- tasks: one per stage


def ok(result: str | State) -> str:
    """A task's committed URI; the Failed state a task returns for one of USER_ERRORS ends the flow
    run with that state's one line (FailedRun, caught in the flow body)."""
    if isinstance(result, State):
        raise FailedRun(result.message)
    return result


def retried(exc: BaseException) -> bool:
    """Storage hiccups (OSError: I/O, connection, timeout) are retried; not a missing file, a refused
    permission, a full disk or a stage's checks."""
    return (
        isinstance(exc, OSError)
        and not isinstance(exc, (FileNotFoundError, PermissionError))
        and exc.errno != errno.ENOSPC
    )


def transient(task, task_run, state) -> bool:
    """retry_condition_fn of the tasks that retry: `retried` of the exception the task raised."""
    return retried(state.result(raise_on_failure=False))


@task(retries=2, retry_delay_seconds=5, retry_condition_fn=transient, task_run_name="init {run_id}")
def create_run(storage_url: str, run_id: str, config_path: str | None, overrides: list[str]) -> str:
    """Write run.json and commit the base model (idempotent); an existing run keeps its config."""
    storage = open_storage(storage_url)
    try:
        base = init_run(storage, run_id, run_config(storage, run_id, config_path, overrides))
    except USER_ERRORS as e:
        return Failed(message=f"init {run_id}: {' '.join(str(e).split())}")
    except Exception as e:
        if not final_storage_error(e):
            raise
        return Failed(message=f"init {run_id}: {describe(e, storage_url)}")
    get_run_logger().info("run %s: base model %s", run_id, base.uri)
    return base.uri


@task(retries=2, retry_delay_seconds=5, retry_condition_fn=transient, task_run_name="snapshot {iteration}")
def snapshot(storage_url: str, run_id: str, iteration: int, force: bool = False) -> str:
    """Freeze the policy of iteration k: the base model, or the previous iteration's learner output."""
    return run_stage("snapshot", storage_url, run_id, iteration, None, force)


def shard_run_name(stage: str):
    """task_run_name of a sharded stage's task: `rollouts 3`, or `rollouts 3 shard 1` for one shard."""

    def name() -> str:
        from prefect.runtime import task_run

        params = task_run.parameters
        shard = params.get("shard")
        return f"{stage} {params['iteration']}" + ("" if shard is None else f" shard {shard}")

    return name


@task(task_run_name=shard_run_name("rollouts"))
def rollouts(
    storage_url: str, run_id: str, iteration: int, policy: str, force: bool = False, shard: int | None = None
) -> str:
    """Sample G responses per prompt from the snapshot, with the sampler's log-probs (one shard of them, or
    with shard None all, then the shards merged: stages.shards)."""
    return run_stage("rollouts", storage_url, run_id, iteration, policy, force, shard)


@task(task_run_name=shard_run_name("rewards"))
def rewards(
    storage_url: str, run_id: str, iteration: int, samples: str, force: bool = False, shard: int | None = None
) -> str:
    """Score every sample with the task's verifiable reward (one shard of them, or with shard None all, then
    the shards merged: stages.shards)."""
    return run_stage("rewards", storage_url, run_id, iteration, samples, force, shard)


@task(retries=2, retry_delay_seconds=5, retry_condition_fn=transient, task_run_name="advantages {iteration}")
def advantages(storage_url: str, run_id: str, iteration: int, scores: str, force: bool = False) -> str:
    """Group-normalize the rewards of each prompt's G samples."""
    return run_stage("advantages", storage_url, run_id, iteration, scores, force)


def learn_run_name() -> str:
    """task_run_name of learn: `learn 3`, or `learn 3 node 1` for a node joining a learner on learn.nodes."""
    from prefect.runtime import task_run

    params = task_run.parameters
    return f"learn {params['iteration']}" + (f" node {params['node_rank']}" if params.get("node_rank") else "")


@task(task_run_name=learn_run_name)
def learn(storage_url: str, run_id: str, iteration: int, advs: str, force: bool = False, node_rank: int = 0) -> str:
    """Clipped policy gradient + KL to the reference; commits the next policy (with learn.nodes > 1 node 0
    does, and `node_rank` r joins it as node r: stages.nodes)."""
    return run_stage("learn", storage_url, run_id, iteration, advs, force, node_rank=node_rank)


@task(name="eval", task_run_name="eval {iteration}")
def evaluate(storage_url: str, run_id: str, iteration: int, policy: str, force: bool = False, last: bool = True) -> str:
    """Greedy decoding of the held-out prompts with the new policy (a skipped eval where eval.every says so and
    the iteration is not the flow call's `last`)."""
    return run_stage("eval", storage_url, run_id, iteration, policy, force, last=last)


# ---------------------------------------------------------------- stages on other work pools

WARM_WORKERS = "warm"  # a placement that sends the stage to a long-lived stage worker, not a work pool
TASKS = {"snapshot": snapshot, "rollouts": rollouts, "rewards": rewards, "advantages": advantages}
TASKS |= {"learn": learn, "eval": evaluate}


def stage_run_name() -> str:
    """flow_run_name of grpo-stage: `demo rewards 3`, `demo rewards 3 shard 1`."""
    from prefect.runtime import flow_run

    p = flow_run.parameters
    name = f"{p['run_id']} {p['stage']} {p['iteration']}" + ("" if p.get("shard") is None else f" shard {p['shard']}")
    return name + (f" node {p['node_rank']}" if p.get("node_rank") else "")


@flow(name="grpo-stage", flow_run_name=stage_run_name)
def stage_flow(
    storage_url: str,
    run_id: str,
    iteration: int,
    stage: StageName,
    upstream: str | None = None,
    force: bool = False,
    shard: int | None = None,
    node_rank: int = 0,
    last: bool = True,
) -> str:
    """One stage of one iteration (or one shard of it, or one node of learn), run by a worker of the pool it is
    placed on (deployment `grpo-stage/<pool>`); the same task, retries included, as in the flow `grpo`. Its
    result is the committed manifest in storage: the orchestrating flow reads it there, no result storage needed."""
    apply_threads(SHARED_MACHINE)  # GRPO_THREADS, else half the cores: the pools' stages may share a machine
    with stage_logs_to_prefect():
        args = (storage_url, run_id, iteration) + ((upstream,) if stage != "snapshot" else ())
        node = {"node_rank": node_rank} if node_rank else {}
        node |= {"last": last} if stage == "eval" else {}
        return TASKS[stage](*args, force=force, **({} if shard is None else {"shard": shard}), **node)


class Placement:
    """Dispatch of placed and sharded stages: `at(stage, upstream)` runs a stage on its work pool (or its
    shards, wherever the stage runs, then merges them here) and returns what its task would (the committed
    URI, or a Failed state with its one line); None for an unsharded stage run here."""

    def __init__(
        self,
        placement: dict[str, str],
        url: str,
        run_id: str,
        iteration: int,
        force: dict,
        shards: dict[str, int],
        last: bool = True,
    ):
        self.placement, self.url, self.run_id, self.k, self.force = placement, url, run_id, iteration, force
        self.shards, self.last = shards, last

    def __call__(self, stage: str, upstream: str | None) -> str | State | None:
        pool, n = self.placement.get(stage), self.shards.get(stage, 1)
        if n > 1:
            return self.sharded(stage, upstream, pool, n)
        if pool is None:
            return None
        if stage == "learn" and (nodes := load_run(open_storage(self.url), self.run_id).learn.nodes) > 1:
            return self.learn_nodes(pool, upstream, nodes)
        if pool == WARM_WORKERS:
            return self.wait_tasks(stage, [self.delay(stage, upstream, None)], upstream)
        return self.wait_flow_runs(stage, [self.flow_run(pool, stage, upstream, None)], upstream)

    def sharded(self, stage: str, upstream: str | None, pool: str | None, n: int) -> str | State:
        """Every shard as its own task run: here one after the other, on the pool as concurrent flow runs
        (each on whichever worker takes it), or by the stage workers; then the shards merged here (reading
        them from storage). A failed shard fails the stage once all have ended; the others stay committed."""
        if pool is None:
            args = (self.url, self.run_id, self.k, upstream)
            for k in range(n):
                done = TASKS[stage](*args, force=self.force[stage], shard=k)
                if isinstance(done, State):
                    return done
        elif pool == WARM_WORKERS:
            done = self.wait_tasks(stage, [self.delay(stage, upstream, k) for k in range(n)], upstream, shards=True)
        else:
            runs = [self.flow_run(pool, stage, upstream, k) for k in range(n)]
            done = self.wait_flow_runs(stage, runs, upstream, shards=True)
        if isinstance(done, State):
            return done
        return TASKS[stage](self.url, self.run_id, self.k, upstream)  # reuses the shards: merges them

    def learn_nodes(self, pool: str, upstream: str | None, nodes: int) -> str | State:
        """learn on learn.nodes machines: node 0 (the stage, which commits) and nodes 1..n-1 at once, each a
        flow run on the pool (whose concurrency limit must let n run, one per machine) or a task run on the
        stage workers; node 0's line comes first when they fail."""
        if pool == WARM_WORKERS:
            return self.wait_tasks("learn", [self.delay("learn", upstream, None, r) for r in range(nodes)], upstream)
        return self.wait_flow_runs(
            "learn", [self.flow_run(pool, "learn", upstream, None, r) for r in range(nodes)], upstream
        )

    def flow_run(self, pool: str, stage: str, upstream: str | None, shard: int | None, node_rank: int = 0):
        """A flow run of the stage (or one shard, or one node of learn) on `pool`, scheduled; the caller waits
        for it."""
        from prefect.deployments import run_deployment
        from prefect.runtime import flow_run

        # one child flow run per stage (shard), iteration and try of this flow run: a retried orchestrator
        # starts the stages again (each reuses what committed), a repeated call in one try does not
        key = (
            f"{flow_run.get_id()}/{flow_run.get_run_count()}/{self.k}/{stage}"
            + ("" if shard is None else f"/shard-{shard}")
            + (f"/node-{node_rank}" if node_rank else "")
        )
        parameters = {
            "storage_url": self.url,
            "run_id": self.run_id,
            "iteration": self.k,
            "stage": stage,
            "upstream": upstream,
            "force": self.force[stage],
        }
        if shard is not None:
            parameters["shard"] = shard
        if node_rank:
            parameters["node_rank"] = node_rank
        if stage == "eval":
            parameters["last"] = self.last
        return run_deployment(f"grpo-stage/{pool}", parameters=parameters, idempotency_key=key, timeout=0)

    def wait_flow_runs(self, stage: str, runs: list, upstream: str | None, shards: bool = False) -> str | State:
        from prefect.client.orchestration import get_client

        ended = {}
        with get_client(sync_client=True) as client:
            while len(ended) < len(runs):
                for run in runs:
                    if run.id not in ended:
                        state = client.read_flow_run(run.id).state
                        if state is not None and state.is_final():
                            ended[run.id] = state
                if len(ended) < len(runs):
                    time.sleep(2)
        return self.outcome(stage, [ended[run.id] for run in runs], upstream, shards)

    def delay(self, stage: str, upstream: str | None, shard: int | None, node_rank: int = 0):
        """The stage's task (or one shard's, or one node's of learn) sent to the long-lived stage workers that
        serve it (flows/stage_worker.py)."""
        args = (self.url, self.run_id, self.k) + ((upstream,) if stage != "snapshot" else ())
        extra = ({} if shard is None else {"shard": shard}) | ({"node_rank": node_rank} if node_rank else {})
        extra |= {"last": self.last} if stage == "eval" else {}
        return TASKS[stage].delay(*args, force=self.force[stage], **extra)

    def wait_tasks(self, stage: str, futures: list, upstream: str | None, shards: bool = False) -> str | State:
        for future in futures:
            for _ in range(60):  # a task run the server has not given its first state yet: wait() raises
                try:
                    future.wait()  # (PrefectHQ/prefect#18280)
                    break
                except RuntimeError as e:
                    if "has no state" not in str(e):
                        raise
                    time.sleep(1)
            else:
                future.wait()
        return self.outcome(stage, [future.state for future in futures], upstream, shards)

    def outcome(self, stage: str, states: list[State], upstream: str | None, shards: bool) -> str | State:
        """The first failed run's one line (a task that returned Failed, one of USER_ERRORS, ended in that
        state), or the committed URI of the stage; with `shards`, "" (the caller merges)."""
        for k, state in enumerate(states):
            if not state.is_completed():
                where = f"shard {k}: " if shards else ""
                return Failed(message=failure_line(stage, self.k, where + (state.message or state.name)))
        return "" if shards else committed_uri(self.url, self.run_id, self.k, stage, upstream)


def committed_uri(storage_url: str, run_id: str, iteration: int, stage: str, upstream: str | None) -> str:
    """The URI of the newest committed attempt of a stage, which must have read `upstream`."""
    storage = open_storage(storage_url)
    out = latest_committed(storage, stage_dir(storage, run_id, iteration, stage))
    if upstream and upstream not in {ref.uri for ref in out.manifest.inputs.values()}:
        raise RuntimeError(f"{stage} read other inputs than {upstream}: another writer committed meanwhile")
    return out.uri


# ---------------------------------------------------------------- what every task does


# errors the user acts on (a bad setting or input, a stale chain, a failed check): the task run fails
# with their one line as its state's message, no traceback; anything else raises as it is
USER_ERRORS = (StageError, ConfigError, ArtifactError, SchemaError)


def run_stage(
    name: str,
    storage_url: str,
    run_id: str,
    iteration: int,
    upstream: str | None,
    force: bool,
    shard: int | None = None,
    node_rank: int = 0,
    last: bool | None = None,
) -> str | State:
    """Run or reuse stage `name` (it logs which), or one shard of it (or join learn as node `node_rank`; eval:
    `last`, whether the iteration ends the flow call);
    return the committed attempt's URI (or, for one of USER_ERRORS, a Failed state with its line).

    `upstream` is the URI the previous task returned: the stage must have read exactly that.
    """
    try:
        kwargs = ({} if shard is None else {"shard": shard}) | ({"node_rank": node_rank} if node_rank else {})
        kwargs |= {} if last is None else {"last": last}
        out = stage_function(name)(open_storage(storage_url), run_id, iteration, force=force, **kwargs)
    except USER_ERRORS as e:
        return Failed(message=failure_line(name, iteration, str(e)))
    except Exception as e:
        if not final_storage_error(e):
            raise  # a bug keeps its traceback; a transient storage error is retried (the task's retries)
        return Failed(message=failure_line(name, iteration, describe(e, storage_url)))
    if upstream and upstream not in {ref.uri for ref in out.manifest.inputs.values()}:
        raise RuntimeError(f"{name} read other inputs than {upstream}: another writer committed meanwhile")
    return out.uri


def final_storage_error(e: BaseException) -> bool:
    """A storage error no retry mends (no credentials, a refused key, a full disk): its one line is the
    flow run's message, with no traceback; a transient one is retried, a bug keeps its traceback."""
    return storage_error(e) and not (isinstance(e, OSError) and retried(e))


def failure_line(name: str, iteration: int, error: str) -> str:
    """A failed task's state message: one line, `<stage> iteration <k>: ` once, though the stage's own
    error may start with its name already (the CLI prints it alone).

    >>> failure_line("rewards", 0, "rewards: 4/64 samples failed")
    'rewards iteration 0: 4/64 samples failed'
    >>> failure_line("learn", 1, "learn iteration 1: input advantages is stale:\\n  rerun")
    'learn iteration 1: input advantages is stale: rerun'
    """
    text = " ".join(error.split())
    for prefix in (f"{name} iteration {iteration}: ", f"{name}: "):
        text = text.removeprefix(prefix)
    return f"{name} iteration {iteration}: {text}"


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
    every `every_s` seconds and once at the end when something changed: each artifact costs the server
    ~15 ms of CPU, which a warm run of sub-second iterations
    would pay every iteration on the cores it trains on.
    """

    def __init__(self, storage_url: str, run_id: str, every_s: float = 30.0):
        self.storage, self.run_id, self.every_s = open_storage(storage_url), run_id, every_s
        self.changed = False
        self.published_at = time.monotonic()

    def add(self) -> None:
        """An iteration committed."""
        self.changed = True
        if time.monotonic() - self.published_at >= self.every_s:
            self.publish()

    def publish(self) -> None:
        if not self.changed:
            return
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
        self.changed, self.published_at = False, time.monotonic()


def resolve_iteration(storage_url: str, run_id: str, iteration: int | str) -> int:
    """An explicit iteration, or "next": the first one not finished (stages.iteration.next_iteration)."""
    if iteration != "next":
        return int(iteration)
    return next_iteration(open_storage(storage_url), run_id)


@contextmanager
def stage_logs_to_prefect():
    """Send the stages' and vLLM's log records to the Prefect run log while the flow runs; libraries quiet
    as in the CLI (no progress bars between the worker's lines)."""
    quiet_libraries()  # VLLM_CONFIGURE_LOGGING=0 among them: else importing vLLM drops our handler
    added = []
    for name in FORWARDED_LOGGERS:
        logger = logging.getLogger(name)
        if any(isinstance(h, APILogHandler) for h in logger.handlers):
            continue  # already sent (PREFECT_LOGGING_EXTRA_LOGGERS names it)
        handler = APILogHandler()
        if name == "vllm":  # the run log carries vLLM's warnings that matter, not its INFO
            handler.addFilter(HarmlessFilter())
        added.append((logger, handler, logger.level))
        logger.addHandler(handler)
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
    try:
        yield
    finally:
        for logger, handler, level in added:
            logger.removeHandler(handler)
            logger.setLevel(level)


# ---------------------------------------------------------------- deployment


def work_in_checkout() -> dict[str, str]:
    """Prefect pull step (prefect.yaml): run the flow from the checkout this module is in.

    It runs on the worker's machine when a flow run starts, so the deployment stores no path;
    relative paths (GRPO_STORAGE=storage, a config file) then mean what they mean in a shell at
    the repo root. A process worker would otherwise start each flow run in a temporary folder.
    """
    root = Path(__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file():
        raise RuntimeError(f"{root} is not a grpo-flow checkout: install with `./setup.sh` in a clone")
    os.chdir(root)
    return {"directory": str(root)}


if __name__ == "__main__":
    grpo()  # one iteration of run "demo" in $GRPO_STORAGE or ./storage, on an ephemeral Prefect API
