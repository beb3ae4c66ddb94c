"""Where the flow's stages run: here (the default), as flow runs of deployment `grpo-stage/<pool>` on other work
pools, on long-lived stage workers (`warm`), in shards, or on learn.nodes machines; `Placement` dispatches one
iteration's stages and waits for them, reading each result from storage; `overlapping` says when learn k runs
while iteration k+1 samples (on its pool, or here in a thread of this flow run, on a device of its own)."""

from __future__ import annotations

import logging
import time
from typing import Callable

from prefect import flow
from prefect.states import Failed, State

from flows.logs import stage_logs_to_prefect
from flows.tasks import TASKS, checked_uri, failure_line, ok
from grpo import devices
from grpo.config import ConfigError, RunConfig
from grpo.record import dispatches
from grpo.record.layout import OPTIONAL_STAGES, STAGES, OptionalStageName, StageName, shard_stage, stage_dir
from grpo.record.liveness import lost_attempts
from grpo.record.storage import Storage, latest_committed, list_attempts
from grpo.runtime.threads import SHARED_MACHINE, apply_threads

WARM_WORKERS = "warm"  # a placement that sends the stage to a long-lived stage worker, not a work pool
log = logging.getLogger("grpo.placement")
WATCH_S = 5.0  # how often a placed stage waited for is checked for a lost process (Watch)


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
    stage: StageName | OptionalStageName,
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
        args, kwargs = task_arguments(stage, storage_url, run_id, iteration, upstream, force, shard, node_rank, last)
        return TASKS[stage](*args, **kwargs)


def task_arguments(
    stage: str,
    storage_url: str,
    run_id: str,
    iteration: int,
    upstream: str | None,
    force: bool,
    shard: int | None = None,
    node_rank: int = 0,
    last: bool = True,
) -> tuple[tuple, dict]:
    """(args, kwargs) of stage `stage`'s task (flows/tasks.py): snapshot takes no upstream, only a sharded stage a
    shard, only learn on several nodes a node rank, only eval `last`."""
    args = (storage_url, run_id, iteration) + ((upstream,) if stage != "snapshot" else ())
    kwargs = (
        {"force": force} | ({} if shard is None else {"shard": shard}) | ({"node_rank": node_rank} if node_rank else {})
    )
    return args, kwargs | ({"last": last} if stage == "eval" else {})


def check_placement(placement: dict[str, str] | None) -> None:
    """A placement names stages only (an optional one, OPTIONAL_STAGES, is refused later where the run's config
    lacks its section: flows.tasks.create_run), and for each pool it names the deployment `grpo-stage/<pool>` and
    the work pool exist: a ConfigError, before anything runs, names what is missing and what creates it. `warm` is
    not looked up (Prefect lists no task workers); a pool no worker polls is logged, not refused (one may start
    later)."""
    unknown = sorted(set(placement or {}) - {*STAGES, *OPTIONAL_STAGES})
    if unknown:
        raise ConfigError(f"placement: unknown stage(s) {unknown}; stages: {[*STAGES, *OPTIONAL_STAGES]}")
    pools = sorted({pool for pool in (placement or {}).values() if pool != WARM_WORKERS})
    if pools:
        check_pools({pool: [s for s, p in placement.items() if p == pool] for pool in pools})


def check_pools(stages_on: dict[str, list[str]]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    deploy = "`prefect --no-prompt deploy --all --prefect-file deploy/placement/prefect.yaml`"
    with get_client(sync_client=True) as client:
        for pool, stages in stages_on.items():
            where = f"placement: {', '.join(stages)} on pool {pool!r}"
            try:
                deployment = client.read_deployment_by_name(f"grpo-stage/{pool}")
            except ObjectNotFound:
                how = deploy if pool in ("gpu", "cpu") else f"a deployment named {pool} like grpo-stage/gpu's in "
                how += "" if pool in ("gpu", "cpu") else "deploy/placement/prefect.yaml, then " + deploy
                raise ConfigError(
                    f"{where}: no deployment grpo-stage/{pool}; create its work pool (`prefect work-pool create "
                    f"{pool} --type process`) and the deployment: {how} (docs/prefect.md, Across machines)"
                ) from None
            try:
                client.read_work_pool(deployment.work_pool_name)
            except ObjectNotFound:
                raise ConfigError(
                    f"{where}: deployment grpo-stage/{pool} sends its flow runs to work pool "
                    f"{deployment.work_pool_name!r}, which does not exist: `prefect work-pool create "
                    f"{deployment.work_pool_name} --type process`"
                ) from None
            online = [w for w in client.read_workers_for_work_pool(deployment.work_pool_name) if w.status == "ONLINE"]
            if not online:
                log.warning(
                    "%s: no worker of work pool %s is online; the stage waits until one starts (`prefect worker "
                    "start --pool %s`)",
                    where,
                    deployment.work_pool_name,
                    deployment.work_pool_name,
                )


def stages_here(placement: dict[str, str] | None) -> list[str]:
    """The stages this process runs: those `placement` sends nowhere (their devices are this machine's; an optional
    stage's only where the run has its section: grpo.devices.check)."""
    return [name for name in (*STAGES, *OPTIONAL_STAGES) if name not in (placement or {})]


def overlapping(cfg: RunConfig, placement: dict[str, str]) -> bool:
    """Whether iteration k+1 samples (and iteration k's eval runs) while learn k runs: rollout.staleness >= 1, and
    learn on a pool of its own, or here on another device than the sampler's (grpo.devices.apart: learn k then
    runs in a thread of this flow run). Never where they share a device in one process: there the sampler sleeps
    while the learner runs, and the learner waits in CPU memory while the sampler does."""
    if cfg.rollout.staleness < 1:
        return False
    return placement.get("learn") is not None or devices.apart(cfg)


class Placement:
    """One iteration's stages, each where it is placed: `stage(name, upstream)` runs it here, on its work pool, on
    the stage workers, or in shards (wherever the stage runs, then merged here), and returns the committed URI."""

    def __init__(
        self,
        placement: dict[str, str] | None,
        storage: Storage,
        run_id: str,
        iteration: int,
        cfg: RunConfig,
        force_stage: str | None = None,
        last: bool = True,
    ):
        self.placement, self.storage, self.url = placement or {}, storage, storage.url
        self.run_id, self.k, self.last = run_id, iteration, last
        self.force = {name: name == force_stage for name in (*STAGES, *OPTIONAL_STAGES)}
        self.distills = cfg.teacher is not None  # the teacher stage runs (grpo.record.layout.stages_of)
        self.shards = {"rollouts": cfg.rollout.shards, "rewards": cfg.reward.shards}
        self.nodes = cfg.learn.nodes
        self.overlaps = overlapping(cfg, self.placement)  # iteration k+1 samples while learn k runs

    def __call__(self, stage: str, upstream: str | None) -> str:
        """Run (or reuse) `stage` where it is placed: its committed URI; a failure raises FailedRun (`ok`)."""
        return ok(self.placed(stage, upstream) or self.here(stage, upstream))

    def here(self, stage: str, upstream: str | None) -> str | State:
        """The stage's task in this flow run."""
        args, kwargs = task_arguments(stage, self.url, self.run_id, self.k, upstream, self.force[stage], last=self.last)
        return TASKS[stage](*args, **kwargs)

    def placed(self, stage: str, upstream: str | None) -> str | State | None:
        """A placed or sharded stage run where it belongs (what its task would return); None for one run here."""
        pool, n = self.placement.get(stage), self.shards.get(stage, 1)
        if n > 1:
            return self.sharded(stage, upstream, pool, n)
        waiting = self.start(stage, upstream)
        return waiting() if waiting else None

    def start(self, stage: str, upstream: str | None) -> Callable[[], str | State] | None:
        """Start an unsharded placed stage and return what waits for it: a flow run on its pool, or a task run of the
        stage workers; learn on learn.nodes machines one a node, node 0 (the stage, which commits) first, all at
        once (the pool's concurrency limit must let them run, one a machine). None for a stage run here."""
        pool = self.placement.get(stage)
        if pool is None:
            return None
        nodes, watch = range(self.nodes if stage == "learn" else 1), self.watch(stage)
        dispatches.note_sent(self.storage, self.run_id, self.k, stage)  # `grpo timeline`: its start-up apart
        if pool == WARM_WORKERS:
            futures = [self.delay(stage, upstream, None, r) for r in nodes]
            return lambda: self.wait_tasks(stage, futures, upstream, watch)
        runs = [self.flow_run(pool, stage, upstream, None, r) for r in nodes]
        return lambda: self.wait_flow_runs(stage, runs, upstream, watch)

    def learn(self, uris: dict[str, str]) -> Learning:
        """Start the iteration's learn on `uris` (snapshot to advantages) where it is placed; here, in a thread of
        this flow run where it overlaps the next iteration's sampling, else now."""
        upstream = uris["advantages"]
        waiting = self.start("learn", upstream) or (
            self.beside("learn", upstream) if self.overlaps else lambda: self.here("learn", upstream)
        )
        return Learning(self, uris, waiting)

    def beside(self, stage: str, upstream: str | None) -> Callable[[], str]:
        """Start the stage's task in a thread of this flow run (its task runner) and return what waits for it: its
        committed URI, or the FailedRun of its one line (a bug raises with its traceback), as `here` and `ok`."""
        args, kwargs = task_arguments(stage, self.url, self.run_id, self.k, upstream, self.force[stage], last=self.last)
        return TASKS[stage].submit(*args, **kwargs).result

    def sharded(self, stage: str, upstream: str | None, pool: str | None, n: int) -> str | State:
        """Every shard as its own task run: here one after the other, on the pool as concurrent flow runs
        (each on whichever worker takes it), or by the stage workers; then the shards merged here (reading
        them from storage). A failed shard fails the stage once all have ended; the others stay committed."""
        if pool is None:
            for k in range(n):
                args, kwargs = task_arguments(stage, self.url, self.run_id, self.k, upstream, self.force[stage], k)
                done = TASKS[stage](*args, **kwargs)
                if isinstance(done, State):
                    return done
        elif pool == WARM_WORKERS:
            watch = self.watch(stage, n)
            futures = [self.delay(stage, upstream, k) for k in range(n)]
            done = self.wait_tasks(stage, futures, upstream, watch, shards=True)
        else:
            watch = self.watch(stage, n)
            runs = [self.flow_run(pool, stage, upstream, k) for k in range(n)]
            done = self.wait_flow_runs(stage, runs, upstream, watch, shards=True)
        if isinstance(done, State):
            return done
        return TASKS[stage](self.url, self.run_id, self.k, upstream)  # reuses the shards: merges them

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

    def watch(self, stage: str, shards: int = 0) -> Watch:
        """The Watch of `stage` (or of its `shards` shards) of this iteration, made before it is sent off."""
        names = [shard_stage(stage, k, shards) for k in range(shards)] if shards else [stage]
        return Watch(self.storage, [stage_dir(self.storage, self.run_id, self.k, name) for name in names])

    def wait_flow_runs(
        self, stage: str, runs: list, upstream: str | None, watch: Watch, shards: bool = False
    ) -> str | State:
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
                    if lost := watch.lost():
                        return Failed(message=failure_line(stage, self.k, lost))
                    time.sleep(2)
        return self.outcome(stage, [ended[run.id] for run in runs], upstream, shards)

    def delay(self, stage: str, upstream: str | None, shard: int | None, node_rank: int = 0):
        """The stage's task (or one shard's, or one node's of learn) sent to the long-lived stage workers that
        serve it (flows/stage_worker.py)."""
        from prefect.client.orchestration import get_client

        force = self.force[stage]
        args, kwargs = task_arguments(
            stage, self.url, self.run_id, self.k, upstream, force, shard, node_rank, self.last
        )
        future = TASKS[stage].delay(*args, **kwargs)
        name = (
            f"{stage} {self.k}"
            + ("" if shard is None else f" shard {shard}")
            + (f" node {node_rank}" if node_rank else "")
        )
        with get_client(sync_client=True) as client:  # named as a task run here is (`eval 3`), not Prefect's `eval-2`
            client.set_task_run_name(future.task_run_id, name)
        return future

    def wait_tasks(
        self, stage: str, futures: list, upstream: str | None, watch: Watch, shards: bool = False
    ) -> str | State:
        for future in futures:
            stateless = 0  # looks in a row at a task run the server gives no state: wait() raises then
            while not future.state.is_final():
                if lost := watch.lost():
                    return Failed(message=failure_line(stage, self.k, lost))
                try:
                    future.wait(timeout=WATCH_S if stateless == 0 else 0)
                    stateless = 0
                except RuntimeError as e:  # no state yet, or read between two (PrefectHQ/prefect#18280)
                    if "has no state" not in str(e) or stateless >= 60:
                        raise
                    stateless += 1
                    time.sleep(1)
        return self.outcome(stage, [future.state for future in futures], upstream, shards)

    def outcome(self, stage: str, states: list[State], upstream: str | None, shards: bool) -> str | State:
        """The first failed run's one line (a task that returned Failed, one of USER_ERRORS, ended in that
        state), or the committed URI of the stage; with `shards`, "" (the caller merges)."""
        for k, state in enumerate(states):
            if not state.is_completed():
                where = f"shard {k}: " if shards else ""
                return Failed(message=failure_line(stage, self.k, where + (state.message or state.name)))
        return "" if shards else committed_uri(self.storage, self.run_id, self.k, stage, upstream)


def committed_uri(storage: Storage, run_id: str, iteration: int, stage: str, upstream: str | None) -> str:
    """The URI of the newest committed attempt of a stage, which must have read `upstream`."""
    committed = latest_committed(storage, stage_dir(storage, run_id, iteration, stage), verify=False)  # readers check
    return checked_uri(committed, upstream)


class Watch:
    """What tells, while a placed stage is waited for, that the process running it was lost (a SIGKILL, a machine
    gone): Prefect never ends a task run whose stage worker died, nor a flow run whose machine is gone, but the
    stage's attempt, begun since the stage was sent off, stops beating without a commit (grpo.gc.lost_attempts:
    gc's lease)."""

    def __init__(self, storage: Storage, dirs: list[str]):
        self.storage, self.dirs = storage, dirs
        self.before = {d: set(list_attempts(storage, d)) for d in dirs}  # earlier tries' attempts: not this one's
        self.checked = time.monotonic()

    def lost(self) -> str | None:
        """The line saying the stage's process was lost, or None (storage read every WATCH_S at most)."""
        if time.monotonic() - self.checked < WATCH_S:
            return None
        self.checked = time.monotonic()
        for d in self.dirs:
            for attempt, age in lost_attempts(self.storage, d).items():
                if attempt.rsplit("/", 1)[-1] not in self.before[d]:
                    return (
                        f"{self.storage.uri(attempt)} stopped beating {age:.0f} s ago, uncommitted: the process "
                        "running it was lost; run the flow again (iteration next), with a worker serving the stage"
                    )
        return None


class Learning:
    """An iteration from its learn on: the learn, started where it is placed (a pool, a thread of this flow run, or
    now), waited for; then its eval."""

    def __init__(self, stage: Placement, uris: dict[str, str], waiting: Callable[[], str | State]):
        self.stage, self.uris, self.waiting = stage, dict(uris), waiting

    def learned(self) -> str:
        """The committed learn's URI, once it ended (FailedRun with its line if it failed)."""
        if "learn" not in self.uris:
            self.uris["learn"] = ok(self.waiting())
        return self.uris["learn"]

    def evaluate(self) -> dict[str, str]:
        """The eval of the learned policy; the iteration's committed URIs, stage by stage."""
        self.uris["eval"] = self.stage("eval", self.learned())
        return self.uris
