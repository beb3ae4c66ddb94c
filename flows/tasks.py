"""The flow's tasks, one per stage, each a thin wrapper of a stage function that passes storage URIs only, and
what every task does: run or reuse the stage, turn an error the user acts on into the task's one-line Failed
state, retry what storage may mend."""

from __future__ import annotations

import errno

from prefect import get_run_logger, task
from prefect.exceptions import FailedRun
from prefect.states import Failed, State

from grpo import devices
from grpo.config import ConfigError
from grpo.errors import StageError, describe, storage_error
from grpo.record.layout import stages_of
from grpo.record.storage import ArtifactError, Committed, open_storage
from schemas import SchemaError
from stages import stage_function
from stages.init import init_run, run_config


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
def create_run(
    storage_url: str,
    run_id: str,
    config_path: str | None,
    overrides: list[str],
    here: list[str] | None = None,
    named: dict[str, str] | None = None,
) -> str:
    """Write run.json and commit the base model (idempotent); an existing run keeps its config. The devices of
    the stages `here` (those this process runs) and the stages the flow's parameters name (`named`: {stage: the
    parameter}) are checked first: a machine without them, or a stage the run does not run, writes nothing."""
    storage = open_storage(storage_url)
    try:
        cfg = run_config(storage, run_id, config_path, overrides)
        check_named_stages(cfg, named or {})
        devices.check(cfg, set(here or ()))
        base = init_run(storage, run_id, cfg)
    except USER_ERRORS as e:
        return Failed(message=f"init {run_id}: {' '.join(str(e).split())}")
    except Exception as e:
        if not final_storage_error(e):
            raise
        return Failed(message=f"init {run_id}: {describe(e, storage_url)}")
    get_run_logger().info("run %s: base model %s", run_id, base.uri)
    return base.uri


def check_named_stages(cfg, named: dict[str, str]) -> None:
    """Each stage the flow's parameters name ({stage: parameter}: placement, force_stage) is one the run's
    iterations run (grpo.record.layout.stages_of): an optional stage (`teacher`) only where its config section is
    set; else a ConfigError naming the parameter."""
    for stage, parameter in named.items():
        if stage not in stages_of(cfg):
            raise ConfigError(
                f"{parameter}: stage {stage!r} runs only in a run whose config sets the {stage} section (e.g. "
                f"{stage}.model); this run's sets none"
            )


@task(task_run_name="sft {run_id}")
def warm_start(storage_url: str, run_id: str) -> str | None:
    """The warm start the run's config sets (sft), made where none is committed, and its gate: a Failed state in one
    line where GRPO must not start (stages.sft.warm_start); None where the config sets none."""
    from stages.sft import warm_start as made

    try:
        committed = made(open_storage(storage_url), run_id)
    except USER_ERRORS as e:
        return Failed(message=f"sft {run_id}: {' '.join(str(e).split())}")
    return None if committed is None else committed.uri


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


@task(retries=2, retry_delay_seconds=5, retry_condition_fn=transient, task_run_name="teacher {iteration}")
def teacher(storage_url: str, run_id: str, iteration: int, samples: str, force: bool = False) -> str:
    """The teacher's log-probs of every sampled token (on-policy distillation; only with a teacher section)."""
    return run_stage("teacher", storage_url, run_id, iteration, samples, force)


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
    does, and `node_rank` r joins it as node r: grpo.learner.nodes)."""
    return run_stage("learn", storage_url, run_id, iteration, advs, force, node_rank=node_rank)


@task(name="eval", task_run_name="eval {iteration}")
def evaluate(storage_url: str, run_id: str, iteration: int, policy: str, force: bool = False, last: bool = True) -> str:
    """Greedy decoding of the held-out prompts with the new policy (a skipped eval where eval.every says so and
    the iteration is not the flow call's `last`)."""
    return run_stage("eval", storage_url, run_id, iteration, policy, force, last=last)


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
    return checked_uri(out, upstream)


def checked_uri(out: Committed, upstream: str | None) -> str:
    """The committed attempt's URI, which must have read `upstream` (the URI the previous task returned)."""
    if upstream and upstream not in {ref.uri for ref in out.manifest.inputs.values()}:
        raise RuntimeError(
            f"{out.manifest.stage} read other inputs than {upstream}: another writer committed meanwhile"
        )
    return out.uri


def failed(e: Exception, storage_url: str) -> State:
    """The final state of a flow run that `e` ends: a task's one line (FailedRun, from `ok`), the line of one of
    USER_ERRORS raised between the tasks (a damaged tracking.json), or of a storage error no retry mends (no
    credentials); anything else raises on, with its traceback."""
    if isinstance(e, FailedRun):
        return Failed(message=str(e))
    if isinstance(e, USER_ERRORS):
        return Failed(message=" ".join(str(e).split()))
    if final_storage_error(e):
        return Failed(message=describe(e, storage_url))
    raise e


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


TASKS = {
    "snapshot": snapshot,
    "rollouts": rollouts,
    "rewards": rewards,
    "teacher": teacher,
    "advantages": advantages,
    "learn": learn,
    "eval": evaluate,
}
