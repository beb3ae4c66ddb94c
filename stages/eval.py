"""Stage 6: held-out evaluation of the iteration's new policy.

The held-out prompts are the same every iteration (stages.rollouts.eval_prompts):
`eval.dataset`, else the held-out split of `task.dataset` (never drawn for training),
else the task generator's prompts of `eval.seed`. Each gets a greedy response
(accuracy); with `eval.samples_per_prompt` k > 1 also k samples at the rollout
temperature (avg@k: the share correct, pass@k: any correct). Responses are scored in
the reward worker pool like the rollouts, with the same per-sample timeout. With episodes
(rollout.tools, rollout.environment) each is an episode as the rollouts sample them, greedy
(the same environments, seeded from eval.seed: the same every iteration).
"""

from __future__ import annotations

from grpo import devices
from grpo.config import RunConfig
from grpo.episodes import adapters
from grpo.record import reward_files
from grpo.record.identity import section
from grpo.record.layout import stage_dir
from grpo.record.lineage import check_chain, committed_input
from grpo.record.storage import Committed, Storage, committed_attempts, latest_committed
from grpo.scoring.score import scorer_key
from schemas import table_file, write_parquet
from stages.common import load_run, measured, run_stage
from stages.held_out import exact_match, held_out_figures  # noqa: F401 (exact_match: where tests look for it)
from stages.prompts import environments, eval_prompts, held_out_config, policy_and_prompts


def due(iteration: int, every: int, last: bool) -> bool:
    """Whether iteration k is evaluated: after every `every`-th learn (k = every-1, 2*every-1, ...), and the
    last iteration of a call whatever its number.

    >>> [k for k in range(5) if due(k, 2, last=k == 4)]
    [1, 3, 4]
    """
    return last or (iteration + 1) % every == 0


@measured
def evaluate(storage: Storage, run_id: str, iteration: int, force: bool = False, last: bool = True) -> Committed:
    """The held-out eval of iteration k's policy; where it is not due (eval.every, `last`: whether k is the last
    iteration its caller runs; a forced eval is always due), a skipped eval instead (see `skip`)."""
    cfg = load_run(storage, run_id)
    inputs = {"policy": committed_input(storage, run_id, iteration, "learn")}
    if cfg.learn.lora is not None or adapters.names_files(
        cfg.rollout
    ):  # the weights under the adapters; tool and environment files
        inputs["base"] = committed_input(storage, run_id, None, "base")
    if cfg.reward.functions:  # the committed copies of reward files (the base, or a fork's own)
        inputs |= reward_files.holder_input(storage, run_id)
    check_chain(storage, run_id, iteration, "eval", inputs)
    if not force and not due(iteration, cfg.eval.every, last):
        return skip(storage, run_id, iteration, inputs)
    k = cfg.eval.samples_per_prompt

    def body(writer):
        with environments(cfg, inputs.get("base")) as env:  # episodes: the rollouts' environments and tools
            return held_out(writer, env)

    def held_out(writer, env):
        p = policy_and_prompts(inputs["policy"], eval_prompts(cfg), cfg, base=inputs.get("base"), tools=env.tools)
        scorer = scorer_key(cfg, reward_files.holder_of(inputs))
        columns, summary = held_out_figures(cfg, p, env, k, f"eval {iteration}", scorer)
        rows = {"run_id": [run_id] * len(p.index), "iteration": [iteration] * len(p.index), **columns}
        write_parquet(storage.fs, writer.path(table_file("eval")), "eval", rows)
        return summary

    with devices.current(devices.sampler_device(cfg.rollout)):  # this thread's CUDA device the sampler's
        return run_stage(
            storage, run_id, iteration, "eval", config=stage_config(cfg), inputs=inputs, body=body, force=force
        )


def skip(storage: Storage, run_id: str, iteration: int, inputs: dict[str, Committed]) -> Committed:
    """An eval that is not due commits an attempt of its own, summary {"skipped": true} and no files, rather than
    nothing: "iteration k is finished" stays "its eval committed and is current" (stages.iteration), so resume,
    status, gc and the report need no copy of the cadence rule, and a rerun learn makes the skip stale like any
    eval. (Counting a committed learn as finished when its eval is not due would not do: whether it is due
    depends on which iteration ends the caller's call, which storage does not record, so a resume could not tell
    a skip from an eval that crashed.) A newest eval that already read this policy is kept as it is: an eval that
    ran because k was the last iteration of an earlier call is never replaced by a skip (and a skip is replaced
    by an eval when a later call ends at k: the real eval's identity differs)."""
    sdir = stage_dir(storage, run_id, iteration, "eval")
    newest = latest_committed(storage, sdir, verify=False) if committed_attempts(storage, sdir) else None
    read = {name: c.manifest_sha256 for name, c in inputs.items()}
    if newest is not None and {name: r.manifest_sha256 for name, r in newest.manifest.inputs.items()} == read:
        return newest
    return run_stage(
        storage, run_id, iteration, "eval", config={"skipped": True}, inputs=inputs, body=lambda w: {"skipped": True}
    )


def stage_config(cfg: RunConfig) -> dict:
    """What the eval stage's identity covers: the held-out prompts, the sampler and the reward (not
    grpo.record.identity.EVAL_READING: when evals run and which figure is read as the best)."""
    config = {
        "task": section(cfg, "task"),
        "eval": section(cfg, "eval"),
        "backend": cfg.rollout.backend,
        "max_tokens": cfg.rollout.max_tokens,
        "max_prompt_tokens": cfg.rollout.max_prompt_tokens,
        "stop": cfg.rollout.stop,
        "reward": {"functions": cfg.reward.functions, "weights": cfg.reward.weights},
    }
    if cfg.eval.samples_per_prompt > 1:
        config["sampling"] = {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p}
    if cfg.task.dataset:
        config["held_out"] = held_out_config(cfg)
    if cfg.rollout.environment_kind() is not None:  # episodes, as the rollouts sample them
        names = ("tools", "environment", "max_turns", "tool_timeout_s", "tool_max_memory_mb")
        config["episodes"] = {name: section(cfg, "rollout")[name] for name in names}
    return config
