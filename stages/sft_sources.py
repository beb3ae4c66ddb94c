"""Where the warm start's conversations come from (sft.source), each pinned in the sft stage's identity and manifest:

- `dataset`: a file or a hub dataset in TRL's conversational SFT shapes (grpo.data.load_conversations), tokenized as
  episodes (grpo.episodes.transcripts); pinned by its fingerprint (grpo.record.pins);
- `history`: rollouts of a run's committed iterations that a DuckDB query over `grpo query`'s views selects (the
  correct ones, the shortest correct one per prompt, ...), their token ids and loss mask as sampled (token in, token
  out); pinned by the query and, as the stage's inputs, every committed rollouts attempt it read;
- `teacher`: another model's episodes on the run's training prompts, sampled by the rollouts stage's loop (the run's
  prompt rendering, tools and rollout.temperature; its token ids as sampled, so it must share the run's tokenizer);
  pinned by the teacher's files' hash.

Each source gives what identifies what it reads at once (the stage's identity is known before anything runs), and
a loader of the conversations that the stage's body calls (a teacher samples only when the stage runs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from grpo import data
from grpo.config import ConfigError, RunConfig
from grpo.errors import DatasetError
from grpo.record import pins
from grpo.record.layout import run_json, stage_dir
from grpo.record.lineage import committed_input
from grpo.record.storage import Committed, Storage, committed_attempts
from schemas import read_parquet, table_file

Tokens = tuple[list[int], list[int], list[int]]  # (prompt ids, response ids, loss mask)


@dataclass(frozen=True)
class Conversation:
    """One conversation to train on: its chat messages, the tools its template renders, where it came from, and
    (history, teacher) its token ids and loss mask as sampled, trained on as they are."""

    messages: list[dict]
    tools: list[dict] = field(default_factory=list)
    origin: dict = field(default_factory=dict)
    where: str = "a conversation"  # how an error names it
    tokens: Tokens | None = None


Source = tuple[dict, dict[str, Committed], Callable[[], list[Conversation]]]
"""(what identifies what it reads, committed attempts it reads: the stage's further inputs, the loader)."""


def source(storage: Storage, cfg: RunConfig, run_id: str, base: Committed) -> Source:
    s = cfg.sft
    if s.source == "dataset":
        return from_dataset(s.dataset, s.split)
    if s.source == "history":
        return from_history(storage, cfg, run_id, base)
    return from_teacher(storage, cfg, base)


def from_dataset(uri: str, split: str) -> Source:
    hub = data.is_hub_id(uri)
    try:
        fingerprint = f"hub:{uri}@{split}" if hub else pins.fingerprint(uri)
    except DatasetError as e:
        raise ConfigError(f"sft.dataset: {e}") from e

    def load() -> list[Conversation]:
        rows = data.load_conversations(uri, split)
        return [Conversation(m, t, {"row": i}, f"sft.dataset {uri} row {i}") for i, (m, t) in enumerate(rows)]

    return {"dataset": uri, "split": split if hub else None, "fingerprint": fingerprint}, {}, load


HISTORY_KEYS = ("iteration", "prompt_id", "sample_index")


def from_history(storage: Storage, cfg: RunConfig, run_id: str, base: Committed) -> Source:
    """The rollouts of sft.history_run that sft.history_sql selects: its rows' (iteration, prompt_id, sample_index)."""
    from grpo.query import query

    other, sql = cfg.sft.history_run, cfg.sft.history_sql
    if not storage.exists(run_json(storage, other)):
        raise ConfigError(f"sft.history_run {other}: no such run in this storage")
    same_tokens(base, committed_input(storage, other, None, "base"), f"sft.history_run {other}")
    try:
        picked = query(storage, other, sql)
    except Exception as e:  # noqa: BLE001 (DuckDB's errors: the query's, in one line)
        raise ConfigError(f"sft.history_sql: {' '.join(str(e).split())}") from e
    if missing := [c for c in HISTORY_KEYS if c not in picked.columns]:
        raise ConfigError(f"sft.history_sql: its result lacks column(s) {missing}; select {', '.join(HISTORY_KEYS)}")
    keys = sorted({tuple(int(v) for v in row) for row in picked[list(HISTORY_KEYS)].itertuples(index=False)})
    if not keys:
        raise ConfigError(f"sft.history_sql selects no rows of run {other}")
    read = {}
    for k in sorted({k for k, _, _ in keys}):
        if not committed_attempts(storage, stage_dir(storage, other, k, "rollouts")):
            raise ConfigError(f"sft.history_sql selects iteration {k} of run {other}, which has no committed rollouts")
        read[f"history-{k}"] = committed_input(storage, other, k, "rollouts")

    def load() -> list[Conversation]:
        out = []
        for k in sorted(read):
            it = read[k].manifest.iteration
            columns = ["prompt_id", "sample_index", "prompt", "response", "prompt_ids", "response_ids", "loss_mask"]
            rows = read_parquet(storage.fs, read[k].read_path(table_file("rollouts")), "rollouts", columns).to_pylist()
            wanted = {(p, i) for kk, p, i in keys if kk == it}
            for r in sorted(rows, key=lambda r: (r["prompt_id"], r["sample_index"])):
                if (r["prompt_id"], r["sample_index"]) in wanted:
                    origin = {"run": other, "iteration": it, "prompt_id": r["prompt_id"], "sample": r["sample_index"]}
                    said = [{"role": "prompt", "content": r["prompt"]}, {"role": "response", "content": r["response"]}]
                    tokens = (r["prompt_ids"], r["response_ids"], r["loss_mask"])
                    out.append(Conversation(said, [], origin, f"run {other} {origin}", tokens))
        return out

    return {"history_run": other, "sql": sql, "rows": len(keys)}, read, load


def from_teacher(storage: Storage, cfg: RunConfig, base: Committed) -> Source:
    """sft.samples_per_prompt episodes of the teacher on each of sft.prompts training prompts (iteration 0's draw
    order), sampled by the rollouts' loop; the teacher's folder is fetched and hashed at once (its pin)."""
    import atexit
    import os
    import shutil
    import tempfile

    from grpo.record.checkpoint import ModelNotFoundError, fetch_model

    s = cfg.sft
    folder = s.teacher
    if not os.path.isdir(folder):  # a URL or a hub id: fetched once, for this process
        folder = tempfile.mkdtemp(prefix="grpo-teacher-")
        atexit.register(shutil.rmtree, folder, True)
        try:
            fetch_model(s.teacher, folder)
        except ModelNotFoundError as e:
            raise ConfigError(f"sft.teacher: {e}") from e
    teacher_tokens(folder, base)

    def load() -> list[Conversation]:
        return teacher_episodes(cfg, base, folder)

    return {"teacher": s.teacher, "fingerprint": pins.fingerprint(folder)}, {}, load


def teacher_tokens(folder: str, base: Committed) -> None:
    """The teacher's vocabulary and chat template are the run's model's: its token ids train the student as they are."""
    from transformers import AutoTokenizer

    from grpo.record.checkpoint import tokenizer_and_config

    ours, theirs = tokenizer_and_config(base)[0], AutoTokenizer.from_pretrained(folder)
    if ours.get_vocab() != theirs.get_vocab() or ours.chat_template != theirs.chat_template:
        what = "vocabulary" if ours.get_vocab() != theirs.get_vocab() else "chat template"
        raise ConfigError(
            f"sft.teacher: its tokenizer's {what} differs from the run's model's; the warm start trains on the "
            "teacher's token ids as sampled, so it needs a teacher of the same tokenizer"
        )


def teacher_episodes(cfg: RunConfig, base: Committed, folder: str) -> list[Conversation]:
    from grpo.record.layout import Salt, iteration_seed
    from stages.prompts import environments, iteration_prompts, policy_and_prompts, sampler
    from stages.samples import sample_all, sampling_spec

    s = cfg.sft
    drawn = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, prompts_per_iteration=s.prompts))
    seed = iteration_seed(cfg.seed, -1, Salt.SAMPLING)
    with environments(cfg, base) as env:
        p = policy_and_prompts(base, iteration_prompts(drawn, 0), cfg, tools=env.tools)
        p = dataclasses.replace(p, model_dir=folder, adapter_dir=None)
        gen, _ = sampler(p, cfg)
        spec = dataclasses.replace(sampling_spec(cfg.rollout, seed), n=s.samples_per_prompt)
        groups = sample_all(gen, p, spec, env, cfg, iteration_seed(cfg.seed, -1, Salt.ENVIRONMENT))
    out = []
    for i, group in zip(p.index, groups):
        for e in group:
            said = [{"role": "prompt", "content": e.prompt_text}]
            said += e.messages[e.prompt_messages :] or [
                {"role": "response", "content": p.tokenizer.decode(e.response_ids)}
            ]
            origin = {"prompt_id": i, "sample": e.sample_index, "end": e.end}
            tokens = (e.prompt_ids, e.response_ids, e.loss_mask)
            out.append(Conversation(said, p.tools or [], origin, f"sft.teacher's episode {origin}", tokens))
    return out


def same_tokens(ours: Committed, theirs: Committed, where: str) -> None:
    """Both bases hold the same tokenizer files (their hashes): token ids mean the same in both runs."""

    def files(c: Committed) -> dict:
        names = ("policy/tokenizer", "policy/vocab", "policy/merges", "policy/special_tokens", "policy/chat_template")
        return {f.path: f.sha256 for f in c.manifest.files if f.path.startswith(names)}

    if files(ours) != files(theirs):
        raise ConfigError(
            f"{where}: its model's tokenizer files differ from this run's; its token ids mean others here"
        )
