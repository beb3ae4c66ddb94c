"""A generative judge (reward.judge) over a rewards stage's rows, as one batch: an OpenAI-compatible endpoint (a
thread per request up to reward.judge.concurrency, retries with backoff on timeouts, connection errors, 429 and 5xx)
or a local model (transformers, greedy or sampled, `concurrency` prompts per generate call; or vLLM offline, all
prompts in one batch: reward.judge.backend).

Each call is keyed by (the judge's revision, its prompt hash: grpo.scoring.judge_format.prompt_hash) in a cache in the
run's storage, `judge-cache/<revision key>/`, shared by every run there: a killed rewards stage rerun, and `grpo
rescore` with the same judge and prompt, make no call twice. Entries are written as calls end, a file per few calls,
so a stage killed mid-way keeps what it paid for. A call that failed every try is not cached (a rerun tries again);
an answer that does not parse is (the same answer would come back).

What each row gets is `judged` (its score, the row of the judge table); the rewards stage joins the score to the
reward and commits the rows (schemas.tables.JUDGE).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable

from grpo.config import JudgeConfig, RolloutConfig
from grpo.errors import StageError
from grpo.record.digests import file_digest
from grpo.record.storage import Storage
from grpo.runtime.secrets import redact, secret_values
from grpo.scoring import judge_format
from grpo.scoring.judge_cache import revision_folder
from grpo.scoring.judge_format import ranking_prompt, rubric_prompt

log = logging.getLogger("grpo.scoring")

_FLUSH_EVERY = 16  # calls per cache file: a killed stage loses at most this many calls' answers

_BACKOFF_S = 0.5  # an endpoint's first retry waits this long, each next one twice as long (at most 30 s)

RETRIED = frozenset({408, 409, 429, 500, 502, 503, 504})
"""The endpoint's HTTP statuses tried again (timeouts, rate limits, the server's own errors)."""


class JudgeCache:
    """{prompt hash: {"raw", "attempts"}} of one judge revision, read from storage at start, added to as calls end."""

    def __init__(self, storage: Storage, revision: str):
        self.storage = storage
        self.folder = revision_folder(storage, revision)
        self.entries: dict[str, dict] = {}
        self.pending: list[str] = []
        self.lock = threading.Lock()
        try:
            names = sorted(storage.fs.ls(self.folder, detail=False))
        except FileNotFoundError:
            names = []
        for name in names:
            try:
                text = storage.read_bytes(name).decode()
            except FileNotFoundError:  # `grpo gc` rewrote it meanwhile: its kept answers are in a newer file
                continue
            for line in text.splitlines():
                entry = json.loads(line)
                self.entries[entry["prompt_hash"]] = entry

    def add(self, key: str, raw: str, attempts: int) -> None:
        with self.lock:
            self.entries[key] = {"prompt_hash": key, "raw": raw, "attempts": attempts}
            self.pending.append(key)
            if len(self.pending) >= _FLUSH_EVERY:
                self._flush()

    def flush(self) -> None:
        with self.lock:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        lines = "".join(json.dumps(self.entries[k], sort_keys=True) + "\n" for k in self.pending)
        name = f"{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(6)}.jsonl"
        self.storage.fs.makedirs(self.folder, exist_ok=True)
        self.storage.write_bytes_atomic(f"{self.folder}/{name}", lines.encode())
        self.pending = []


class EndpointJudge:
    """An OpenAI-compatible /chat/completions endpoint, called from up to `concurrency` threads."""

    def __init__(self, cfg: JudgeConfig):
        self.cfg = cfg
        self.revision = f"{cfg.model_name}@{cfg.url}"
        self.headers = {"Content-Type": "application/json"}
        if cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise StageError(
                    f"reward.judge.api_key_env: the variable {cfg.api_key_env} is not set in the rewards stage's "
                    "environment; export it where the stage runs"
                )
            self.headers["Authorization"] = f"Bearer {key}"

    def answer(self, messages: list[str], done: Callable[[int, str | None, int, str | None], None]) -> None:
        """Ask each message; done(i, raw, attempts, error) as each call ends (raw None: every try failed)."""
        with concurrent.futures.ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix="judge") as pool:
            for f in concurrent.futures.as_completed(
                [pool.submit(self.one, i, m, done) for i, m in enumerate(messages)]
            ):
                f.result()

    def one(self, i: int, message: str, done) -> None:
        import httpx

        body = {
            "model": self.cfg.model_name,
            "messages": [{"role": "user", "content": message}],
            "max_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
        }
        url = f"{self.cfg.url.rstrip('/')}/chat/completions"
        error = None
        for attempt in range(1, self.cfg.retries + 2):
            try:
                r = httpx.post(url, json=body, headers=self.headers, timeout=self.cfg.timeout_s)
                if r.status_code == 200:
                    return done(i, r.json()["choices"][0]["message"]["content"] or "", attempt, None)
                error = f"HTTP {r.status_code}: {r.text[:200]}"
                if r.status_code not in RETRIED:
                    return done(i, None, attempt, error)
            except (httpx.TimeoutException, httpx.TransportError) as e:
                error = f"{type(e).__name__}: {e}"
            except (KeyError, IndexError, TypeError, ValueError) as e:  # a 200 whose body is no chat completion
                return done(i, None, attempt, f"the endpoint's answer is no chat completion: {type(e).__name__}: {e}")
            if attempt <= self.cfg.retries:
                time.sleep(min(30.0, _BACKOFF_S * 2 ** (attempt - 1)))
        done(i, None, self.cfg.retries + 1, error)


class LocalJudge:
    """A causal LM run in this process, the chat template where the tokenizer has one: by transformers, or by the
    vLLM engine the rollouts use, every prompt in one offline batch (reward.judge.backend, decided as rollout.backend
    is; `rollout`: grpo.config.RolloutConfig, whose vllm settings build the engine)."""

    def __init__(self, cfg: JudgeConfig, rollout=None):
        from grpo.sampling.engines import choose_backend

        self.cfg, self.rollout = cfg, rollout
        self.folder, self.revision = local_revision(cfg.model, cfg.revision)
        self.backend, self.why = choose_backend(cfg.backend, self.folder, None, "reward.judge")
        self.model = self.tokenizer = None

    def load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.backend == "hf":
            self.model = AutoModelForCausalLM.from_pretrained(self.folder).eval()

    def prompt_ids(self, message: str) -> list[int]:
        """The token ids of one judge message as the transformers judge feeds it (its chat template applied)."""
        if self.tokenizer is None:
            self.load()
        return self.tokenizer(self.text(message), add_special_tokens=False)["input_ids"]

    def generated(self, prompts: list[list[int]]) -> list[list[int]]:
        """Each prompt's answer ids (every eos id of the checkpoint stops) from the vLLM engine: greedy at
        reward.judge.temperature 0, else sampled (seeded, per prompt). The engine is built with rollout.vllm's
        settings in the judge's own dtype, planned for rollout.vllm.max_model_len tokens (None: the judge's context),
        and kept as the process's engine (grpo.sampling.engines.get_generator)."""
        from grpo.record.checkpoint import checkpoint_dtype_name
        from grpo.sampling.base import SamplingSpec
        from grpo.sampling.engines import get_generator, scoring_settings

        rollout = self.rollout or RolloutConfig()
        settings = scoring_settings(
            rollout, self.folder, checkpoint_dtype_name(self.folder), rollout.vllm.max_model_len
        )
        generator = get_generator("vllm", self.folder, **settings)
        spec = SamplingSpec(n=1, temperature=self.cfg.temperature, max_tokens=self.cfg.max_tokens)
        return [group[0].response_ids for group in generator.generate(prompts, spec)]

    def text(self, message: str) -> str:
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
            )
        return message

    def answer(self, messages: list[str], done) -> None:
        import torch

        if messages and self.tokenizer is None:
            self.load()
        if self.backend == "vllm" and messages:  # one batch: vLLM schedules the whole lot itself
            answers = self.generated([self.prompt_ids(m) for m in messages])
            for j, ids in enumerate(answers):
                done(j, self.tokenizer.decode(ids, skip_special_tokens=True), 1, None)
            return
        sampled = self.cfg.temperature > 0
        for at in range(0, len(messages), self.cfg.concurrency):
            batch = messages[at : at + self.cfg.concurrency]
            enc = self.tokenizer(
                [self.text(m) for m in batch], return_tensors="pt", padding=True, add_special_tokens=False
            )
            with torch.no_grad():
                out = self.model.generate(
                    **enc,
                    max_new_tokens=self.cfg.max_tokens,
                    do_sample=sampled,
                    temperature=self.cfg.temperature if sampled else None,
                    top_p=None,
                    top_k=None,
                    pad_token_id=self.tokenizer.pad_token_id,
                )
            new = out[:, enc["input_ids"].shape[1] :]  # (B, new tokens)
            for j, ids in enumerate(new):
                done(at + j, self.tokenizer.decode(ids, skip_special_tokens=True), 1, None)


def local_revision(model: str, revision: str | None) -> tuple[str, str]:
    """(the folder to load, the revision recorded): a folder's `folder:<hash of its files>`, a hub id's
    `<id>@<commit>` (the snapshot downloaded for `revision`)."""
    if os.path.isdir(model):  # each file hashed once on this machine while unchanged (grpo.record.digests)
        from fsspec.implementations.local import LocalFileSystem

        h, fs = hashlib.sha256(), LocalFileSystem()
        for root, _, files in sorted(os.walk(model)):
            for name in sorted(files):
                path = os.path.join(root, name)
                h.update(f"{os.path.relpath(path, model)}\0{file_digest(fs, path)[1]}\n".encode())
        return model, f"folder:{h.hexdigest()[:16]}"
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(model, revision=revision)
    except Exception as e:  # noqa: BLE001 (any hub failure is the config's to fix, said in one line)
        raise StageError(f"reward.judge.model: {model!r} is no folder and no hub model to download: {e}") from e
    return folder, f"{model}@{os.path.basename(os.path.normpath(folder))}"


def make_judge(cfg: JudgeConfig, rollout=None):
    """The judge a config names: EndpointJudge or LocalJudge (`rollout`, the run's rollout settings: a vLLM judge's
    engine settings)."""
    return EndpointJudge(cfg) if cfg.url else LocalJudge(cfg, rollout)


def judged(storage: Storage, cfg: JudgeConfig, rows: list[dict], judge=None) -> tuple[list[dict], dict]:
    """Judge `rows` ({prompt_id, sample_index, prompt, response, ground_truth}, a group's rows together for
    ranking): (per row {judge_revision, prompt_hash, raw, verdicts, score, error, attempts, cached, failed}, the
    counts of distinct prompts: calls (made), cached (answered from the cache), errors (answers that do not parse),
    failed (calls that failed every try)). Rows whose prompts are the same (a response sampled twice) share one call."""
    judge = judge or make_judge(cfg)
    calls = _calls(cfg, rows)  # (message, prompt hash, the rows it scores)
    cache = JudgeCache(storage, judge.revision)
    answers: dict[int, tuple[str | None, int, str | None, bool]] = {}
    first = {}  # prompt hash -> the first call of it (a response twice in a group: one call)
    for i, (_, key, _) in enumerate(calls):
        first.setdefault(key, i)
    todo = [i for key, i in first.items() if key not in cache.entries]
    hidden = secret_values(os.environ, [cfg.api_key_env] if cfg.api_key_env else [])

    def done(j: int, raw: str | None, attempts: int, error: str | None) -> None:
        i = todo[j]
        raw, error = redact(raw, hidden), redact(error, hidden)
        answers[i] = (raw, attempts, error, False)
        if raw is not None:
            cache.add(calls[i][1], raw, attempts)

    try:
        judge.answer([calls[i][0] for i in todo], done)
    finally:
        cache.flush()
    for key, i in first.items():
        if i not in answers:
            answers[i] = (cache.entries[key]["raw"], 0, None, True)
    out: list[dict | None] = [None] * len(rows)
    counts = {"calls": len(todo), "cached": len(first) - len(todo), "errors": 0, "failed": 0}
    for i, (_, key, members) in enumerate(calls):
        raw, attempts, error, hit = answers[first[key]]
        if i != first[key]:  # the same call again: its answer, no call of its own
            attempts = 0
        parsed = _parse(cfg, raw, len(members)) if raw is not None else error
        if i == first[key]:
            counts["failed" if raw is None else "errors"] += isinstance(parsed, str)
        for m, r in enumerate(members):
            base = {
                "judge_revision": judge.revision,
                "prompt_hash": key,
                "raw": raw,
                "attempts": attempts,
                "cached": hit,
            }
            if isinstance(parsed, str):
                out[r] = base | {
                    "verdicts": None,
                    "score": cfg.parse_error_reward,
                    "error": parsed,
                    "failed": raw is None,
                }
            else:
                score, verdicts = (parsed[0][m], [parsed[1][m]]) if cfg.mode == "ranking" else parsed
                out[r] = base | {"verdicts": verdicts, "score": float(score), "error": None, "failed": False}
    return out, counts


def _calls(cfg: JudgeConfig, rows: list[dict]) -> list[tuple[str, str, list[int]]]:
    """(message, prompt hash, the positions in `rows` it scores) of each judge call: a row each (rubric), a group
    each (ranking: rows of one prompt_id, in sample_index order)."""
    if cfg.mode == "rubric":
        c = cfg
        messages = [
            (rubric_prompt(c.template, c.criteria, c.verdicts, r["prompt"], r["response"], r["ground_truth"]), [i])
            for i, r in enumerate(rows)
        ]
    else:
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(r["prompt_id"], []).append(i)
        messages = []
        for members in groups.values():
            members.sort(key=lambda i: rows[i]["sample_index"])
            texts = [rows[i]["response"] for i in members]
            first = rows[members[0]]  # a group is one prompt: one prompt text, one ground truth
            messages.append((ranking_prompt(cfg.template, first["prompt"], texts, first["ground_truth"]), members))
    return [(m, judge_format.prompt_hash(m, cfg.max_tokens, cfg.temperature), members) for m, members in messages]


def _parse(cfg: JudgeConfig, raw: str, n: int):
    if cfg.mode == "ranking":
        return judge_format.parse_ranking(raw, n)
    return judge_format.parse_rubric(raw, cfg.criteria, cfg.verdicts, cfg.verdict_scores)
