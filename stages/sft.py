"""The warm start (`grpo sft`): supervised cross-entropy on the assistant tokens of conversations, before iteration 0.

A stage the run commits once (runs/<run>/sft/attempt-*, beside `base`), its policy the version -1 iteration 0
samples (the snapshot takes it instead of the base where the config sets `sft`: grpo.record.lineage.first_policy) and,
with full fine-tuning, the KL reference (the SFT model, as InstructGPT's and DeepSeekMath's; LoRA's stays the base with
the adapters off). Each conversation becomes ids and a loss mask as the episodes build theirs
(grpo.episodes.transcripts: 1 on the assistant's tokens, 0 on system, user and tool messages), and trains on the RL
learner (grpo.learner.sft: the policy-gradient loss with advantage 1 is the cross-entropy; LoRA, fsdp2, torchrun and
every family's path as the learns take them). The conversations come from one of three sources (sft.source): a
dataset in TRL's shapes, a teacher model's sampled responses to the run's training prompts, or the rows a SQL query
selects from a run's committed history; the manifest pins what was read (the dataset's fingerprint, the teacher's
folder hash, the query and each committed attempt it read). The attempt holds the policy (policy/ or adapter/), the
conversations trained on (`sft.parquet`, the `sft` view of `grpo query`) and every step's metrics (`metrics.parquet`,
the `sft_metrics` view). With sft.gate_pass_at_k the held-out pass@k of the new policy is measured (the eval's
figures: stages/held_out.py) and recorded in the summary; `grpo run` and the flow start GRPO only where it reaches
the gate (gate_problem).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

from grpo import devices
from grpo.config import ConfigError, RunConfig
from grpo.errors import DatasetError
from grpo.record import reward_files
from grpo.record.checkpoint import carry_checkpoint_files, local_checkpoint, staging_folder, tokenizer_and_config
from grpo.record.counts import is_local
from grpo.record.identity import section
from grpo.record.layout import Salt, iteration_seed, stage_dir
from grpo.record.lineage import committed_input
from grpo.record.storage import Committed, Storage, committed_attempts, latest_committed
from schemas import read_parquet, table_file, write_parquet
from stages.common import StageError, load_run, measured, run_stage
from stages.sft_sources import Conversation, source

STAGE = "sft"


def stage_config(cfg: RunConfig, pinned: dict) -> dict:
    """What the stage's identity covers: the seed, the sft and learn sections (the learner it runs on), and what its
    source read (`pinned`: a dataset's fingerprint, a teacher's, a history query's committed attempts)."""
    return {"seed": cfg.seed, "sft": section(cfg, "sft"), "learn": section(cfg, "learn"), "read": pinned}


@measured
def sft(storage: Storage, run_id: str, iteration: int | None = None, force: bool = False) -> Committed:
    """The warm start of run `run_id` (`iteration` is not read: the stage is the run's, once)."""
    cfg = load_run(storage, run_id)
    if cfg.sft is None:
        raise StageError(
            f"run {run_id}: its config has no sft section, so iteration 0 samples the base; a warm start is set "
            f"when the run is made (`grpo init --run NEW --set sft.dataset=conversations.jsonl`)"
        )
    inputs = {"base": committed_input(storage, run_id, None, "base")}
    if cfg.sft.gate_pass_at_k is not None and cfg.reward.functions:  # the gate scores with the run's reward files
        inputs |= reward_files.holder_input(storage, run_id)
    pinned, read, load = source(storage, cfg, run_id, inputs["base"])
    inputs |= read  # a history query's committed attempts
    left: dict = {}

    def body(writer) -> dict:
        try:
            rows = load()
        except DatasetError as e:
            raise ConfigError(str(e)) from e
        local = is_local(storage.fs)
        out_dir = writer.attempt_dir if local else staging_folder()
        left["made"] = None if local else out_dir
        with tempfile.TemporaryDirectory() as tmp:
            summary = train(storage, cfg, run_id, inputs, rows, out_dir, tmp)
            if cfg.sft.gate_pass_at_k is not None:
                summary |= gate_figures(cfg, inputs, out_dir)
        if not local:
            from grpo.record.checkpoint import upload_folder

            upload_folder(writer, out_dir, prefix="")
        return summary

    config = stage_config(cfg, pinned)
    try:
        with devices.current(devices.learner_device(cfg.learn) if cfg.learn.num_processes == 1 else None):
            return run_stage(storage, run_id, None, STAGE, config=config, inputs=inputs, body=body, force=force)
    finally:
        if left.get("made"):
            shutil.rmtree(left["made"], ignore_errors=True)


def train(storage, cfg: RunConfig, run_id: str, inputs: dict, rows: list[Conversation], out_dir: str, tmp: str) -> dict:
    """Tokenize the conversations as episodes, train the run's learner on them from the base, and write into out_dir
    the policy, sft.parquet and metrics.parquet. Returns the summary."""
    from grpo.episodes.chat import with_thinking
    from grpo.learner import launch
    from grpo.learner.rank import new_learner, train_and_save
    from grpo.learner.sft import WARM_START_ITERATION, conversation_batch, conversation_order, sft_run_config
    from grpo.sampling.base import stop_token_ids
    from grpo.sampling.engines import release_accelerator

    s, base_dir = cfg.sft, local_checkpoint(inputs["base"])
    tokenizer, model_config = tokenizer_and_config(inputs["base"])
    tokenizer = with_thinking(tokenizer, cfg.task.enable_thinking)
    turn_ends = [tokenizer.decode([i], skip_special_tokens=False) for i in stop_token_ids(tokenizer, base_dir)]
    tokens, truncated = [], []
    for c in rows:
        prompt, response, mask = c.tokens or episode_tokens(tokenizer, c, turn_ends)
        room = s.max_tokens - len(prompt)
        if room < 1:
            raise StageError(f"{c.where}: its prompt is {len(prompt)} tokens; sft.max_tokens={s.max_tokens}")
        tokens.append((list(prompt), list(response[:room]), list(mask[:room])))
        truncated.append(len(response) > room)
    if not rows:
        raise StageError(f"sft: no conversations to train on (sft.source={s.source})")
    order = conversation_order(
        len(rows), s.steps, s.epochs, s.minibatch_size, iteration_seed(cfg.seed, -1, Salt.PROMPTS)
    )
    if len(order) < s.minibatch_size:
        raise StageError(
            f"sft: {len(rows)} conversations x sft.epochs={s.epochs} fill no minibatch of sft.minibatch_size="
            f"{s.minibatch_size}; lower it, or set sft.steps"
        )
    batch = conversation_batch([tokens[i] for i in order], model_config.pad_token_id or 0)
    scfg = sft_run_config(cfg)
    if not devices.apart(cfg):  # a sampler that shares the learner's device sleeps (or closes) meanwhile
        release_accelerator(cfg.rollout.keep_engine)
    folders = {"policy_dir": base_dir, "ref_dir": base_dir, "state_dir": None, "adapter_dir": None}
    held = f"{tmp}/held"  # AdamW's state of the warm start: not carried into the RL learns (they start their own)
    if cfg.learn.num_processes == 1:
        learner = new_learner(scfg, WARM_START_ITERATION, **folders)
        summary = train_and_save(learner, run_id, WARM_START_ITERATION, batch, out_dir, held)
        del learner
    else:
        args = launch.learner_args(scfg, run_id, WARM_START_ITERATION, batch, folders, out_dir, tmp, state_out=held)
        summary = launch.run_distributed(args, cfg.learn.num_processes)
    if cfg.learn.lora is None:
        carry_checkpoint_files(base_dir, f"{out_dir}/policy")
    disk_rows = read_parquet(_disk(), f"{out_dir}/{table_file('learn_metrics')}", "learn_metrics")
    Path(out_dir, table_file("logprobs")).unlink()  # no pi_old nor reference in this loss: nothing to audit there
    Path(out_dir, table_file("learn_metrics")).unlink()  # the same rows, as the sft_metrics table
    write_parquet(_disk(), f"{out_dir}/{table_file('sft_metrics')}", "sft_metrics", disk_rows)
    draws = [0] * len(rows)
    for i in order:
        draws[i] += 1
    columns = {
        "run_id": [run_id] * len(rows),
        "conversation": list(range(len(rows))),
        "source": [s.source] * len(rows),
        "origin": [json.dumps(c.origin, sort_keys=True) for c in rows],
        "messages": [json.dumps(c.messages, sort_keys=True, default=str) for c in rows],
        "prompt_ids": [t[0] for t in tokens],
        "response_ids": [t[1] for t in tokens],
        "loss_mask": [t[2] for t in tokens],
        "truncated": truncated,
        "draws": draws,
    }
    write_parquet(_disk(), f"{out_dir}/{table_file('sft')}", "sft", columns)
    keep = ("steps", "loss", "entropy", "grad_norm", "precision", "kernels", "learner_path", "update_s", "tokens")
    return {
        "source": s.source,
        "conversations": len(rows),
        "truncated": sum(truncated),
        "trained_tokens": sum(sum(tokens[i][2]) for i in order),
        **{k: summary[k] for k in keep if k in summary},
        "world_size": summary.get("world_size"),
    }


def episode_tokens(tokenizer, c: Conversation, turn_ends: list[str]) -> tuple[list[int], list[int], list[int]]:
    """A written conversation's ids and loss mask, as an episode's (grpo.episodes.transcripts)."""
    from grpo.episodes.transcripts import conversation_episode

    try:
        e = conversation_episode(tokenizer, c.messages, c.tools, turn_ends, c.where)
    except DatasetError as err:
        raise StageError(str(err)) from err
    return e.prompt_ids, e.response_ids, e.loss_mask


def _disk():
    import fsspec

    return fsspec.filesystem("file")


def gate_figures(cfg: RunConfig, inputs: dict, out_dir: str) -> dict:
    """The held-out figures of the policy just trained into out_dir (greedy exact match, and pass@k over sft.gate_k
    samples of each eval prompt): the gate's figure `pass@k`, recorded in the summary."""
    from grpo.scoring.score import scorer_key
    from stages.held_out import held_out_figures
    from stages.prompts import environments, eval_prompts, policy_and_prompts

    base, k = inputs["base"], cfg.sft.gate_k
    with environments(cfg, base) as env:
        p = policy_and_prompts(base, eval_prompts(cfg), cfg, tools=env.tools)  # the base's tokenizer: the policy's
        if cfg.learn.lora is None:
            p = dataclasses.replace(p, model_dir=f"{out_dir}/policy")
        else:
            p = dataclasses.replace(p, adapter_dir=f"{out_dir}/adapter")
        scorer = scorer_key(cfg, reward_files.holder_of(inputs))
        _, figures = held_out_figures(cfg, p, env, k, "sft gate", scorer)
    return {
        "exact_match": figures["exact_match"],
        f"pass@{k}": figures[f"pass@{k}"] if k > 1 else figures["exact_match"],
        "gate_pass_at_k": cfg.sft.gate_pass_at_k,
    }


def gate_problem(cfg: RunConfig, committed: Committed) -> str | None:
    """The one line that stops GRPO where the warm start's held-out pass@k is below sft.gate_pass_at_k; None where
    it reaches it (or there is no gate)."""
    gate, k = cfg.sft.gate_pass_at_k, cfg.sft.gate_k
    if gate is None:
        return None
    figure = committed.manifest.summary.get(f"pass@{k}")
    if figure is None:
        return f"sft {committed.uri}: no held-out pass@{k} recorded; remake it with `grpo sft --run RUN --force`"
    if figure >= gate:
        return None
    return (
        f"warm start {committed.uri}: held-out pass@{k} {figure:.4g} is below sft.gate_pass_at_k={gate}; GRPO not "
        "started (a longer warm start, another source, or a lower gate: a new run)"
    )


def warm_start(storage: Storage, run_id: str) -> Committed | None:
    """Before a run's iterations (`grpo run`, the flow): where its config sets sft, the warm start, run here when none
    is committed (a committed one is kept: its policy is what iteration 0 sampled), and its gate; a StageError when
    the gate stops GRPO. None where the config sets no sft."""
    cfg = load_run(storage, run_id)
    if cfg.sft is None:
        return None
    sdir = stage_dir(storage, run_id, None, STAGE)
    committed = latest_committed(storage, sdir, verify=False) if committed_attempts(storage, sdir) else None
    committed = committed or sft(storage, run_id)
    if problem := gate_problem(cfg, committed):
        raise StageError(problem.replace("RUN", run_id))
    return committed
