"""Stage 3b (only with a `teacher` section): the teacher's log-probs of every committed response token.

On-policy distillation: the student samples (rollouts), a fixed teacher scores the very token ids it sampled (a
prefill of prompt + response, never decoded and re-tokenized; an episode's whole token stream, its observation
tokens as context, scored where loss_mask is 1), and the advantages become, or gain, the per-token reverse KL
-(log p_sampler - log p_teacher) (grpo.core.teacher_advantages). With rollout.staleness S >= 1 the rows were sampled
by an older policy and the teacher scores those tokens as sampled: nothing here depends on which policy sampled them.
The teacher runs on transformers or on the rollouts' vLLM engine (teacher.backend; grpo/scoring/teacher.py).

teacher.parquet holds the teacher's log-prob of each response token (and with teacher.top_k its top-k ids,
log-probs and tail mass per loss token); the manifest's summary pins each teacher (its hub commit or its folder's
file hashes, which the stage's identity covers too: another revision makes a new attempt) and its vocabulary
fingerprint, and records `reverse_kl`, the mean over loss tokens of log p_sampler - log p_teacher: the student's KL
to its teacher on its own samples (k1), which distillation drives down. Several teachers: teacher.routes picks a
row's teacher by a dataset column (the rollouts' `row`).
"""

from __future__ import annotations

import json
import logging

from grpo import devices
from grpo.config import RunConfig
from grpo.progress import progress
from grpo.record.identity import section
from grpo.record.lineage import check_chain, committed_input
from grpo.record.storage import Committed, Storage
from grpo.scoring import teacher as engine
from schemas import read_parquet, table_file, write_parquet
from stages.common import StageError, load_run, measured, run_stage

log = logging.getLogger("grpo.stages")
SCORING = ("model", "revision", "top_k", "routes", "route_column", "backend")  # what the stage's output depends on
COLUMNS = ["run_id", "iteration", "prompt_id", "sample_index", "prompt_ids", "response_ids", "loss_mask", "row"]


@measured
def teacher(storage: Storage, run_id: str, iteration: int, force: bool = False) -> Committed:
    """Score iteration `iteration`'s committed rollouts with the run's teacher(s)."""
    cfg = load_run(storage, run_id)
    if cfg.teacher is None:
        raise StageError(f"teacher iteration {iteration}: run {run_id} has no teacher section (set teacher.model)")
    tcfg = cfg.teacher
    rollouts = committed_input(storage, run_id, iteration, "rollouts")
    check_chain(storage, run_id, iteration, "teacher", {"rollouts": rollouts})
    teachers = {spec: engine.resolve(spec, tcfg.revision) for spec in tcfg.models()}

    def body(writer) -> dict:
        from grpo.sampling.engines import choose_backend, release_accelerator

        table = read_parquet(storage.fs, rollouts.read_path(table_file("rollouts")), "rollouts")
        if table.num_rows == 0:
            raise StageError(f"{rollouts.uri}: rollouts.parquet has no rows")
        cols = {c: table.column(c).to_pylist() for c in COLUMNS + ["sampler_logprobs"]}
        picked = [route(cfg, row) for row in cols["row"]]
        out: list[dict | None] = [None] * table.num_rows
        device = devices.teacher_device(tcfg)
        pins, done = {}, 0
        for spec, found in teachers.items():
            rows = [i for i, p in enumerate(picked) if p == spec]
            if not rows:
                continue
            backend, why = choose_backend(tcfg.backend, found.folder, device, "teacher")
            if backend == "hf" and device.type == "cuda":  # the sampler sleeps (or closes) while the teacher has the
                release_accelerator(cfg.rollout.keep_engine)  # GPU, as for learn; a vLLM teacher is the engine itself
            score = engine.scorer(backend, found.folder, device, tcfg.top_k, cfg.rollout, found.revision)
            pins[spec] = {"revision": found.revision, "vocabulary": engine.vocabulary_of(found.folder)}
            if (backend, tcfg.backend) != ("hf", "auto"):  # not how teachers always ran: recorded
                pins[spec]["backend"] = f"{backend} ({why})"
            step = len(rows) if backend == "vllm" else tcfg.batch_size  # vLLM batches the whole lot itself
            for at in range(0, len(rows), step):
                chunk = rows[at : at + step]
                scored = score(*([cols[c][i] for i in chunk] for c in ("prompt_ids", "response_ids", "loss_mask")))
                for i, s in zip(chunk, scored):
                    out[i] = {**s, "teacher": spec}
                done += len(chunk)
                progress(f"teacher {iteration}", done, table.num_rows)
            del score  # one transformers teacher in memory at a time
            if device.type == "cuda":
                import torch

                torch.cuda.empty_cache()
        rows_out = {k: cols[k] for k in ["run_id", "iteration", "prompt_id", "sample_index"]}
        for k in ["teacher", "teacher_logprobs", "topk_ids", "topk_logprobs", "topk_tail"]:
            rows_out[k] = [o[k] for o in out]
        write_parquet(storage.fs, writer.path(table_file("teacher")), "teacher", rows_out)
        gap = [
            (s - t, m)
            for sl, tl, ml in zip(cols["sampler_logprobs"], rows_out["teacher_logprobs"], cols["loss_mask"])
            for s, t, m in zip(sl, tl, ml)
        ]
        tokens = sum(m for _, m in gap)
        return {
            "samples": table.num_rows,
            "tokens": tokens,
            "reverse_kl": sum(d for d, m in gap if m) / max(tokens, 1),  # mean of log p_sampler - log p_teacher
            "teacher_logprob_mean": sum(t for tl in rows_out["teacher_logprobs"] for t in tl) / max(tokens, 1),
            "teachers": pins,
        }

    return run_stage(
        storage, run_id, iteration, "teacher", config=stage_config(cfg, teachers), inputs={"rollouts": rollouts},
        body=body, force=force,
    )  # fmt: skip


def stage_config(cfg: RunConfig, teachers: dict | None = None) -> dict:
    """What the stage's identity covers: the teacher settings of what it scores (SCORING: not how advantages and the
    learner use it, nor where and in what batches it runs) and, once
    resolved, each teacher's pinned revision, so changed teacher files make a new attempt ({}: no teacher)."""
    if cfg.teacher is None:
        return {}
    config = {"teacher": {k: v for k, v in section(cfg, "teacher").items() if k in SCORING}}
    if teachers is not None:
        config["revisions"] = {spec: t.revision for spec, t in sorted(teachers.items())}
    return config


def check_fork_teacher(storage: Storage, parent: str, before: RunConfig, after: RunConfig) -> None:
    """A fork or rescore of `parent` that names another teacher (`after`'s): its tokenizer must be the student's, the
    parent's base model's (grpo.scoring.teacher.check_teachers, one line naming teacher.model), before anything is
    written."""
    if after.teacher is None or stage_config(before) == stage_config(after):
        return
    from grpo.record.checkpoint import local_checkpoint

    engine.check_teachers(after.teacher, local_checkpoint(committed_input(storage, parent, None, "base")))


def route(cfg: RunConfig, row: str) -> str:
    """The teacher of a rollouts row (its `row`: the dataset's other columns, JSON): teacher.routes' model for its
    teacher.route_column value, else teacher.model.

    >>> from grpo.config import load_config
    >>> cfg = load_config({"teacher": {"model": "t", "routes": {"math": "m"}, "route_column": "kind"}})
    >>> route(cfg, '{"kind": "math"}'), route(cfg, '{"kind": "code"}'), route(cfg, '{}')
    ('m', 't', 't')
    """
    t = cfg.teacher
    if not t.route_column:
        return t.model
    value = json.loads(row or "{}").get(t.route_column)
    return {str(k): v for k, v in t.routes.items()}.get(str(value), t.model)
