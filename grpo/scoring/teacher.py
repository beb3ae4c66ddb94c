"""A teacher model for on-policy distillation: where its files are, what pins them, whether its token space is the
student's, and its log-probs of committed token ids (a prefill: the ids as sampled, never decoded and encoded again).

The teacher stage (stages/teacher.py) calls `scorer`; `grpo init` calls `check_teachers` before anything is
written. Two backends (teacher.backend, decided as rollout.backend is): the transformers model on any device
(`scored_rows`, a float32 forward of left-padded batches) or the vLLM engine the rollouts use (`vllm_scored_rows`, a
float32 prefill per response whose prompt log-probs are the teacher's), the same rows either way.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from grpo.config import ConfigError, TeacherConfig
from grpo.errors import one_line


@dataclass(frozen=True)
class Teacher:
    """One teacher resolved on this machine: its local folder and what pins it."""

    spec: str  # as the config names it (teacher.model or a route's)
    folder: str  # a local folder transformers loads
    revision: str  # "hub:<id>@<commit>" or "files:<sha256 of the folder's files' names and sha256s>"


def resolve(spec: str, revision: str | None = None) -> Teacher:
    """The teacher `spec` names: a local folder (pinned by its files' sha256), or a hub id fetched through
    huggingface_hub at `revision` (pinned by the commit it resolved to; HF_HUB_OFFLINE=1 reads the cache only).
    A ConfigError naming teacher.model where neither can be had."""
    if os.path.isdir(spec):
        if not Path(spec, "config.json").exists():
            raise ConfigError(f"teacher.model {spec}: no config.json, not an HF checkpoint folder")
        return Teacher(spec, spec, "files:" + folder_hash(spec))
    from huggingface_hub import snapshot_download

    from grpo.record.checkpoint import _HUB_ID, HUB_FILES

    if not _HUB_ID.match(spec):
        raise ConfigError(f"teacher.model {spec}: no such folder, and not a hub id")
    try:
        folder = snapshot_download(spec, revision=revision, allow_patterns=HUB_FILES)
    except Exception as e:  # noqa: BLE001 (offline, unknown repo or revision: one line either way)
        raise ConfigError(f"teacher.model {spec} (revision {revision}): the hub model could not be had: {one_line(e)}")
    return Teacher(spec, folder, f"hub:{spec}@{Path(folder).name}")  # the snapshot folder is named by its commit


def folder_hash(folder: str) -> str:
    """sha256 over a folder's files (relative name and sha256 of each, sorted): what pins a local teacher."""
    from fsspec.implementations.local import LocalFileSystem

    from grpo.record.digests import file_digest

    fs, root = LocalFileSystem(), Path(folder)
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    listing = [(n, file_digest(fs, str(root / n))[1]) for n in names]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def vocabulary(tokenizer) -> str:
    """Fingerprint of a tokenizer's token space: sha256 of its token -> id map (added tokens included) and its
    special tokens with their ids. Two tokenizers with one fingerprint give every token the same id."""
    special = {str(t): tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens}
    key = {"vocab": sorted(tokenizer.get_vocab().items()), "special": sorted(special.items())}
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()


def vocabulary_of(folder: str) -> str:
    """`vocabulary` of the tokenizer in `folder`."""
    from transformers import AutoTokenizer

    return vocabulary(AutoTokenizer.from_pretrained(folder))


def check_teachers(teacher: TeacherConfig | None, student_folder: str) -> None:
    """Refuse, in one line naming the field, a teacher that cannot be had, whose token space differs from the
    student's in `student_folder`, or that teacher.backend=vllm cannot run here (grpo init, before run.json is
    written)."""
    if teacher is None:
        return
    from grpo.sampling.engines import vllm_problem

    student = vocabulary_of(student_folder)
    for spec in teacher.models():
        found = resolve(spec, teacher.revision)
        try:
            theirs = vocabulary_of(found.folder)
        except Exception as e:  # noqa: BLE001 (transformers raises many kinds for a broken folder)
            raise ConfigError(f"teacher.model {spec}: the tokenizer does not load: {one_line(e)}") from e
        if theirs != student:
            raise ConfigError(
                f"teacher.model {spec}: its tokenizer's vocabulary (fingerprint {theirs[:12]}) differs from the "
                f"student's ({student[:12]}); a teacher must share the student's token ids and special tokens"
            )
        if teacher.backend == "vllm" and (problem := vllm_problem(found.folder)):  # its architecture, here
            raise ConfigError(
                f"teacher.backend=vllm: teacher.model {spec}: {problem}; set teacher.backend=hf (or auto)"
            )


def load_model(folder: str, device):
    """The teacher's causal LM from `folder` on `device`, float32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()


_WARM: dict = {}  # (folder, revision, device) -> the transformers teacher the process's last teacher stage loaded


def warm_model(folder: str, revision: str, device):
    """load_model, kept between teacher stages of this process where `device` is the CPU (keyed by folder, pinned
    revision and device, as the vLLM engine is kept): one model, the last one asked for. On an accelerator it is
    loaded again each stage, as before: the learner and the sampler want that memory between stages."""
    if device.type != "cpu":
        return load_model(folder, device)
    key = (folder, revision, str(device))
    if key not in _WARM:
        _WARM.clear()
        _WARM[key] = load_model(folder, device)
    return _WARM[key]


def scored_rows(model, prompts: list[list[int]], responses: list[list[int]], masks: list[list[int]], top_k, device):
    """The teacher's float32 log-prob of every response token after its prompt and the tokens before it, one forward
    of the left-padded sequences keeping the logits of the responses' positions only; 0.0 where the mask is 0. With
    top_k also, per masked token, the k most likely ids, their log-probs and the probability mass outside them (the
    tail). Returns a list of dicts, one a row: {teacher_logprobs, topk_ids, topk_logprobs, topk_tail} (the topk ones
    None without top_k)."""
    import torch

    seqs = [p + r for p, r in zip(prompts, responses)]
    width, keep_last = max(map(len, seqs)), max(map(len, responses)) + 1
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(seqs):  # left-padded: every response ends at the last column
        ids[i, width - len(s) :] = torch.tensor(s)
        attn[i, width - len(s) :] = 1
    position_ids = (attn.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():  # (B, K, V): the last K positions only, K = the longest response + 1
        logits = model(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            position_ids=position_ids.to(device),
            logits_to_keep=keep_last,
        ).logits
    out = []
    for i, (r, m) in enumerate(zip(responses, masks)):
        # position t's logits predict token t + 1: the response's tokens from the prompt's last position on
        logp = torch.log_softmax(logits[i, keep_last - len(r) - 1 : keep_last - 1].float(), dim=-1)  # (R, V)
        keep = torch.tensor(m, dtype=torch.bool, device=logp.device)
        picked = logp.gather(-1, torch.tensor(r, device=logp.device)[:, None])[:, 0].masked_fill(~keep, 0.0)
        row = {"teacher_logprobs": picked.cpu().tolist(), "topk_ids": None, "topk_logprobs": None, "topk_tail": None}
        if top_k:
            top = logp[keep].topk(min(top_k, logp.shape[-1]), dim=-1)
            tail = (1.0 - top.values.exp().sum(-1)).clamp_min(0.0)
            row.update(topk_ids=top.indices.cpu().tolist(), topk_logprobs=top.values.cpu().tolist())
            row["topk_tail"] = tail.cpu().tolist()
        out.append(row)
    return out


def scorer(backend: str, folder: str, device, top_k: int | None, rollout, revision: str | None = None):
    """A function (prompts, responses, masks) -> `scored_rows`' rows for the teacher in `folder` on `backend` (hf:
    the transformers model loaded on `device`, kept warm on the CPU where its pinned `revision` is given:
    warm_model; vllm: the process's vLLM engine built with rollout.vllm's settings in float32,
    grpo.sampling.engines.scoring_settings, kept warm between stages as the rollouts' engine is)."""
    if backend == "hf":
        model = load_model(folder, device) if revision is None else warm_model(folder, revision, device)
        return lambda prompts, responses, masks: scored_rows(model, prompts, responses, masks, top_k, device)
    from grpo.sampling.engines import get_generator, scoring_settings

    settings = scoring_settings(rollout, folder, "float32", longest(rollout, folder))
    if top_k and top_k > 20:  # vLLM's default max_logprobs
        settings["max_logprobs"] = top_k
    generator = get_generator("vllm", folder, **settings)
    return lambda prompts, responses, masks: vllm_scored_rows(generator, prompts, responses, masks, top_k)


def longest(rollout, folder: str) -> int | None:
    """The vLLM teacher's max_model_len: one more than the rollouts' longest prompt + response (vLLM generates one
    token after a prompt, here the whole scored sequence), within the model's context; None: the model's context."""
    from grpo.sampling.engines import _context_length

    most = rollout.vllm.max_model_len
    if most is None and rollout.max_prompt_tokens is not None:
        most = rollout.max_prompt_tokens + rollout.max_tokens
    return None if most is None else min(most + 1, _context_length(folder))


def vllm_scored_rows(generator, prompts: list[list[int]], responses: list[list[int]], masks: list[list[int]], top_k):
    """`scored_rows` on the vLLM engine (grpo.sampling.vllm_engine.VLLMGenerator.prompt_logprobs): the prompt
    log-probs of prompt + response at the response's positions, the same rows."""
    import torch

    scored = generator.prompt_logprobs(
        [p + r for p, r in zip(prompts, responses)], [len(p) for p in prompts], top_k or 0
    )
    out = []
    for (picked, tops), m in zip(scored, masks):
        row = {"teacher_logprobs": [lp if k else 0.0 for lp, k in zip(picked, m)], "topk_ids": None}
        row |= {"topk_logprobs": None, "topk_tail": None}
        if top_k:
            kept = [t for t, k in zip(tops, m) if k]
            values = torch.tensor([[lp for _, lp in t] for t in kept], dtype=torch.float32).reshape(len(kept), -1)
            row["topk_ids"] = [[tok for tok, _ in t] for t in kept]
            row["topk_logprobs"] = values.tolist()
            row["topk_tail"] = (1.0 - values.exp().sum(-1)).clamp_min(0.0).tolist()
        out.append(row)
    return out
