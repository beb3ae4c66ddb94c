"""The rows a learn trains on: an iteration's rollouts joined with their advantages, kept groups whole, as the
learner's `Batch` (padded tensors)."""

from __future__ import annotations

import numpy as np
import torch

from grpo.errors import StageError
from grpo.learner import Batch
from grpo.record.storage import Committed, Storage
from schemas import read_parquet, table_file

KEYS = ["prompt_id", "sample_index"]


def _padded(column, rows: np.ndarray, fill, dtype, left: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """List column -> (len(rows), longest) array of the chosen rows, right- (or left-) padded, and lengths."""
    arr = column.combine_chunks()
    offsets = arr.offsets.to_numpy()
    values = arr.flatten().to_numpy(zero_copy_only=False)
    offsets = offsets - offsets[0]
    starts, lengths = offsets[rows], offsets[rows + 1] - offsets[rows]
    width = max(int(lengths.max(initial=0)), 1)
    pos = np.arange(width)
    keep = pos < lengths[:, None]  # (R, W): where a row's values go, right-padded
    out = np.full((len(rows), width), fill, dtype=dtype)
    out[keep] = values[(starts[:, None] + pos)[keep]]
    if left:  # roll each row right by its padding
        out = out[np.arange(len(rows))[:, None], (pos - (width - lengths[:, None])) % width]
    return out, lengths


def load_batch(
    storage: Storage,
    rollouts_in: Committed,
    adv_in: Committed,
    pad_id: int,
    group_size: int,
    inputs: dict[str, Committed] | None = None,
) -> Batch:
    """Join rollouts with advantages on (prompt_id, sample_index); keep the kept groups, whole; with a `teacher` in
    `inputs` (teacher.gkd_coef), its top-k ids, log-probs and tail per loss token too."""
    ro = read_parquet(
        storage.fs,
        rollouts_in.read_path(table_file("rollouts")),
        "rollouts",
        columns=KEYS
        + ["prompt_ids", "response_ids", "sampler_logprobs", "loss_mask", "policy_version", "token_versions"],
    )
    ad = read_parquet(
        storage.fs,
        adv_in.read_path(table_file("advantages")),
        "advantages",
        columns=KEYS + ["advantage", "reward", "kept"],
    )
    kept = ad.column("kept").to_numpy()
    ad_pid, ad_idx = (ad.column(c).to_numpy()[kept] for c in KEYS)
    ro_pid, ro_idx = (ro.column(c).to_numpy() for c in KEYS)
    width = int(max(ro_idx.max(initial=0), ad_idx.max(initial=0))) + 1
    ro_key, ad_key = ro_pid * width + ro_idx, ad_pid * width + ad_idx  # one int per (prompt_id, sample_index)
    if len(np.unique(ro_key)) != len(ro_key):
        raise StageError(f"{rollouts_in.uri}: a (prompt_id, sample_index) appears twice")
    if not np.isin(ad_key, ro_key).all():
        raise StageError(f"{adv_in.uri}: advantages name samples missing from the rollouts of {rollouts_in.uri}")
    order = np.argsort(ad_key)  # kept samples in (prompt_id, sample_index) order
    ad_key = ad_key[order]
    take = np.argsort(ro_key)[np.searchsorted(np.sort(ro_key), ad_key)]  # their rollout rows
    prompts, prompt_len = _padded(ro.column("prompt_ids"), take, pad_id, np.int64, left=True)
    pid = ro_pid[take]
    uniq, counts = np.unique(pid, return_counts=True)  # pid is sorted: a prompt's samples are contiguous
    wrong = uniq[counts != group_size]
    if not len(wrong):  # and they share one prompt
        same = (prompts.reshape(-1, group_size, prompts.shape[1]) == prompts[::group_size, None]).all((1, 2))
        wrong = uniq[~same]
    if len(wrong):
        raise StageError(
            f"{rollouts_in.uri}: prompt_id {wrong[0]} does not have rollout.group_size={group_size} "
            "kept samples of one prompt; the learner scores each prompt once for its whole group"
        )
    responses, lengths = _padded(ro.column("response_ids"), take, pad_id, np.int64)
    sampler, _ = _padded(ro.column("sampler_logprobs"), take, 0.0, np.float32)
    loss_mask, mask_lengths = _padded(ro.column("loss_mask"), take, 0, np.float32)
    if (mask_lengths != lengths).any():
        i = int(np.argmax(mask_lengths != lengths))
        raise StageError(
            f"{rollouts_in.uri}: prompt_id {pid[i]} sample {ro_idx[take][i]} has {mask_lengths[i]} loss_mask entries "
            f"for {lengths[i]} response_ids; the rollouts table needs one a token"
        )
    versions = token_versions(ro, take, lengths, responses.shape[1], rollouts_in.uri)
    response_mask = np.arange(responses.shape[1]) < lengths[:, None]
    prompt_mask = np.arange(prompts.shape[1]) >= prompts.shape[1] - prompt_len[::group_size, None]
    adv, reward = (ad.column(c).to_numpy()[kept][order] for c in ("advantage", "reward"))
    if table_file("token_advantages") in {f.path for f in adv_in.manifest.files}:  # a teacher's: (N, T) per token
        adv = token_advantages(storage, adv_in, ad_key, width, responses.shape[1])
    topk = {} if "teacher" not in (inputs or {}) else teacher_topk(storage, inputs["teacher"], ad_key, width, loss_mask)
    return Batch(
        **topk,
        prompt_ids=torch.from_numpy(prompts[::group_size].copy()),
        prompt_mask=torch.from_numpy(prompt_mask).long(),
        response_ids=torch.from_numpy(responses),
        response_mask=torch.from_numpy(response_mask).float(),
        loss_mask=torch.from_numpy(loss_mask),
        token_versions=torch.from_numpy(versions),
        sampler_logprobs=torch.from_numpy(sampler),
        group_size=group_size,
        advantages=torch.from_numpy(adv).float(),
        rewards=torch.from_numpy(reward).float(),
        prompt_id=pid.tolist(),
        sample_index=ro_idx[take].tolist(),
    )


def token_advantages(storage: Storage, adv_in: Committed, keys: np.ndarray, width: int, tokens: int) -> np.ndarray:
    """(len(keys), tokens) the per-token advantages (a teacher's: stages/teacher.py) of the samples `keys` (prompt_id *
    width + sample_index), right-padded with 0."""
    ta = read_parquet(storage.fs, adv_in.read_path(table_file("token_advantages")), "token_advantages")
    ta_key = ta.column("prompt_id").to_numpy() * width + ta.column("sample_index").to_numpy()
    rows = np.argsort(ta_key)[np.searchsorted(np.sort(ta_key), keys).clip(0, max(len(ta_key) - 1, 0))]
    if not (ta_key[rows] == keys).all():
        raise StageError(f"{adv_in.uri}: token_advantages.parquet lacks a kept sample")
    out, _ = _padded(ta.column("token_advantage"), rows, 0.0, np.float32)
    return np.pad(out, ((0, 0), (0, max(tokens - out.shape[1], 0))))[:, :tokens]


def gkd_setting(cfg) -> dict:
    """{"gkd_coef": teacher.gkd_coef} where GKD's term is on (the learn stage's identity and inputs then cover the
    teacher), else {}: runs without it keep their identity."""
    return {"gkd_coef": cfg.teacher.gkd_coef} if cfg.teacher is not None and cfg.teacher.gkd_coef > 0 else {}


def teacher_topk(storage: Storage, teacher_in: Committed, keys: np.ndarray, width: int, loss_mask: np.ndarray) -> dict:
    """Batch's topk_ids, topk_logprobs (N, T, k) and topk_tail (N, T) of the samples `keys` from teacher.parquet, each
    loss token's at its place (0 elsewhere: no loss there)."""
    te = read_parquet(storage.fs, teacher_in.read_path(table_file("teacher")), "teacher")
    te_key = te.column("prompt_id").to_numpy() * width + te.column("sample_index").to_numpy()
    at = {int(k): i for i, k in enumerate(te_key)}
    ids, lps, tails = (te.column(c).to_pylist() for c in ("topk_ids", "topk_logprobs", "topk_tail"))
    n, t = loss_mask.shape
    k = len(next((x[0] for x in ids if x), [0]))
    out_ids, out_lp, out_tail = np.zeros((n, t, k), np.int64), np.zeros((n, t, k), np.float32), np.zeros((n, t))
    for row, key in enumerate(keys.tolist()):
        if key not in at or ids[at[key]] is None:
            raise StageError(f"{teacher_in.uri}: teacher.parquet has no top-k for a kept sample (teacher.top_k unset?)")
        where = np.flatnonzero(loss_mask[row] > 0)  # the loss tokens, in order: one top-k row each
        out_ids[row, where], out_lp[row, where], out_tail[row, where] = ids[at[key]], lps[at[key]], tails[at[key]]
    return {"topk_ids": torch.from_numpy(out_ids), "topk_logprobs": torch.from_numpy(out_lp),
            "topk_tail": torch.from_numpy(out_tail).float()}  # fmt: skip


def token_versions(ro, take: np.ndarray, lengths: np.ndarray, width: int, uri: str) -> np.ndarray:
    """(len(take), width) the policy version that sampled each response token of the rows `take`: its
    token_versions, or where null the row's policy_version (every token sampled by that policy)."""
    listed, counts = _padded(ro.column("token_versions"), take, 0, np.int64)
    null = ro.column("token_versions").is_null().to_numpy(zero_copy_only=False)[take]
    if (~null & (counts != lengths)).any():
        i = int(np.argmax(~null & (counts != lengths)))
        raise StageError(
            f"{uri}: a row of prompt_id {ro.column('prompt_id').to_numpy()[take][i]} has {counts[i]} token_versions "
            f"for {lengths[i]} response_ids; the rollouts table needs one a token, or null"
        )
    listed = np.pad(listed, ((0, 0), (0, width - listed.shape[1])))[:, :width]
    return np.where(null[:, None], ro.column("policy_version").to_numpy()[take][:, None].astype(np.int64), listed)
