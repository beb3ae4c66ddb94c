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


def load_batch(storage: Storage, rollouts_in: Committed, adv_in: Committed, pad_id: int, group_size: int) -> Batch:
    """Join rollouts with advantages on (prompt_id, sample_index); keep the kept groups, whole."""
    ro = read_parquet(
        storage.fs,
        rollouts_in.read_path(table_file("rollouts")),
        "rollouts",
        columns=KEYS + ["prompt_ids", "response_ids", "sampler_logprobs"],
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
    response_mask = np.arange(responses.shape[1]) < lengths[:, None]
    prompt_mask = np.arange(prompts.shape[1]) >= prompts.shape[1] - prompt_len[::group_size, None]
    adv, reward = (ad.column(c).to_numpy()[kept][order] for c in ("advantage", "reward"))
    return Batch(
        prompt_ids=torch.from_numpy(prompts[::group_size].copy()),
        prompt_mask=torch.from_numpy(prompt_mask).long(),
        response_ids=torch.from_numpy(responses),
        response_mask=torch.from_numpy(response_mask).float(),
        sampler_logprobs=torch.from_numpy(sampler),
        group_size=group_size,
        advantages=torch.from_numpy(adv).float(),
        rewards=torch.from_numpy(reward).float(),
        prompt_id=pid.tolist(),
        sample_index=ro_idx[take].tolist(),
    )
