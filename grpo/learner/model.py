"""The policy as the learner runs it: `PolicyLM` (each group's prompt computed once for its G responses, the
responses packed into shared rows where that saves compute), the log-probs of a batch's groups and the
no-grad scoring pass over them. Knows nothing of processes or sharding (grpo/learner/sharding.py)."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from grpo.learner import kernels, paths
from grpo.learner.batch import Batch


class PolicyLM(torch.nn.Module):
    """A causal LM giving the per-token log-probs (and entropy) of each group's G responses.

    Shared prompt: the prompt's state (keys and values, conv and recurrent states) is computed once per
    group and shared by its G responses (gradients from every response flow back into it), instead of
    G forwards over the same prompt tokens; padding_free packs the responses into shared rows on top of it.
    With gradient checkpointing the training forward goes over each full sequence instead (checkpointing
    keeps no cache to share); scoring under no_grad still shares the prompt. Which of these a model takes
    is decided once from its layers (`self.path`, grpo/learner/paths.py): every path gives the same
    log-probs and gradients. One module, so DDP sees a single forward per backward.
    """

    def __init__(
        self,
        lm,
        logprob_chunk: int = 4096,
        full_sequences_in_training: bool = False,
        padding_free: bool = False,
        logprob_kernel: str = "auto",
    ):
        super().__init__()
        self.lm, self.logprob_chunk, self.full_sequences_in_training = lm, logprob_chunk, full_sequences_in_training
        self.padding_free, self.logprob_kernel = padding_free, logprob_kernel
        self.path = paths.decide(
            self.causal.config, self.causal, padding_free=padding_free, checkpointing=full_sequences_in_training
        )

    @property
    def causal(self):
        """The transformers causal LM (inside a peft wrapper, its adapters injected in place)."""
        return self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm

    def adapter_disabled(self):
        """Context: the base model alone (LoRA's frozen reference); a no-op context without adapters."""
        return self.lm.disable_adapter() if hasattr(self.lm, "disable_adapter") else contextlib.nullcontext()

    def forward(self, prompt_ids, prompt_mask, response_ids, response_mask, with_entropy: bool = False, topk_ids=None):
        """prompt_ids, prompt_mask (P, Lp) left-padded; response_ids, response_mask (P*G, T)
        right-padded -> log-probs (P*G, T) of response_ids and their entropy (or None). With topk_ids (P*G, T, k)
        (the teacher's top-k, GKD's term) also their log-probs (P*G, T, k), from the same forward and logits. The
        attention and log-prob kernels are the device's (grpo/learner/kernels.py)."""
        labels = response_ids if topk_ids is None else torch.cat([response_ids[..., None], topk_ids], -1)
        with kernels.attention(prompt_ids.device):
            path = self.path.train if self.training and torch.is_grad_enabled() else self.path.score
            if path == "packed" and (packing := self._packing(prompt_ids, response_mask)) is not None:
                out = self._packed(prompt_ids, prompt_mask, response_ids, response_mask.bool(), packing, with_entropy,
                                   labels)  # fmt: skip
            else:
                hidden = (self._full_sequences if path == "full_sequences" else self._shared_prompt)(
                    prompt_ids, prompt_mask, response_ids, response_mask
                )
                out = self._logprobs(hidden, labels, with_entropy)
        if topk_ids is None:
            return out
        return out[0][..., 0], out[1], out[0][..., 1:]

    def _logprobs(self, hidden, labels, with_entropy: bool):
        """Log-probs (B, T) of labels (B, T) from the last hidden states (B, T, H) and the LM head, and their entropy
        (or None), learn.logprob_chunk tokens' logits at a time or by Liger's kernel: never the (B, T, V) logits."""
        kernel = kernels.logprob_kernel(self.logprob_kernel, hidden.device)
        head = output_head(self.causal)
        return kernels.token_logprobs(hidden, head, labels, self.logprob_chunk, with_entropy, kernel)

    def _prompt(self, prompt_ids, prompt_mask):
        """The base model over each group's left-padded prompt (P, Lp), once: its last hidden state and its keys and
        values (the cache the group's responses attend to)."""
        return self.causal.base_model(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=(prompt_mask.cumsum(1) - 1).clamp_min(0),
            use_cache=True,
        )

    def _shared_prompt(self, prompt_ids, prompt_mask, response_ids, response_mask) -> Tensor:
        """Hidden states (P*G, T, H), [:, t] predicting response_ids[:, t]."""
        g = response_ids.shape[0] // prompt_ids.shape[0]
        out = self._prompt(prompt_ids, prompt_mask)
        cache = select_rows(out.past_key_values, torch.arange(len(prompt_ids), device=prompt_ids.device), g)
        first = out.last_hidden_state[:, -1:].repeat_interleave(g, 0)  # (P*G, 1, H): predicts response token 0
        start = prompt_mask.sum(1).repeat_interleave(g)[:, None]  # (P*G, 1)
        mask = torch.cat([prompt_mask.repeat_interleave(g, 0), response_mask.long()], 1)
        out = self.causal.base_model(
            input_ids=response_ids,
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            position_ids=start + torch.arange(response_ids.shape[1], device=start.device),
        )
        return torch.cat([first, out.last_hidden_state[:, :-1]], 1)

    def _packing(self, prompt_ids, response_mask) -> Packing | None:
        """The rows packing would use when it saves at least PACK_MIN_SAVING of the rows; else None (one row
        per response)."""
        lengths = response_mask.sum(1).long().tolist()
        packing = pack_responses(lengths, len(lengths) // len(prompt_ids), response_mask.shape[1])
        return packing if len(packing.row_group) <= (1 - PACK_MIN_SAVING) * len(lengths) else None

    def _packed(self, prompt_ids, prompt_mask, response_ids, mask, packing: Packing, with_entropy: bool, labels):
        """forward() with each group's responses packed into shared rows (pack_responses): each row's cache is its
        group's prompt, each response attends to that prompt and to its own tokens, and the LM head sees only the
        real tokens (M of them). Same log-probs (N, T) of `labels` (response_ids, or (N, T, m) ids: (N, T, m)) and
        entropy as one row per response, to float rounding."""
        n, t = mask.shape
        g, width, rows = n // len(prompt_ids), packing.width, len(packing.row_group)
        out = self._prompt(prompt_ids, prompt_mask)
        kept = _kept_columns(out.past_key_values)  # layer type -> prompt columns its cache holds
        cache = select_rows(out.past_key_values, packing.row_group.to(mask.device))  # (P, ...) -> (R, ...)
        offset = torch.arange(t, device=mask.device).expand(n, t)[mask]  # (M,) each real token's place in its response
        sample = torch.arange(n, device=mask.device)[:, None].expand(n, t)[mask]  # (M,) and its response
        cell = packing.start.to(mask.device)[sample] + offset  # (M,) its flat place row * width + column
        seg = -1 - torch.arange(rows * width, device=mask.device)  # padding cells: a segment each, alone
        seg[cell] = sample
        ids = response_ids.new_zeros(rows * width).index_put((cell,), response_ids[mask])
        prompt_len = prompt_mask.sum(1)  # (P,)
        pos = prompt_len.new_zeros(rows * width).index_put((cell,), prompt_len[sample // g] + offset)
        seg, pos = seg.view(rows, width), pos.view(rows, width)
        causal = torch.ones(width, width, dtype=torch.bool, device=mask.device).tril()
        attend = torch.cat(  # (R, width, Lp + width): the group's prompt, then its own tokens causally
            [
                prompt_mask[packing.row_group].bool()[:, None, :].expand(rows, width, prompt_mask.shape[1]),
                (seg[:, :, None] == seg[:, None, :]) & causal,
            ],
            -1,
        )
        prompt_pos = (prompt_mask.cumsum(1) - 1)[packing.row_group]  # (R, Lp)
        distance = pos[:, :, None] - torch.cat([prompt_pos, pos], 1)[:, None, :]  # (R, width, Lp + width)
        hidden = self.causal.base_model(
            input_ids=ids.view(rows, width),
            attention_mask=self._packed_masks(attend, distance, kept),
            past_key_values=cache,
            use_cache=True,
            position_ids=pos,
        ).last_hidden_state.reshape(rows * width, -1)
        # token 0 is predicted by the prompt's last hidden state, token k > 0 by the cell before it
        prompt_last = out.last_hidden_state[:, -1].to(hidden.dtype)  # (P, H)
        before = torch.where(offset == 0, rows * width + sample // g, cell - 1)  # (M,)
        logp, entropy = self._logprobs(torch.cat([hidden, prompt_last])[before][None], labels[mask][None], with_entropy)
        zeros = torch.zeros(n, t, device=mask.device, dtype=logp.dtype)
        spread = zeros if labels.dim() == 2 else zeros[..., None].expand(labels.shape).contiguous()
        logp = spread.masked_scatter(mask.view(*mask.shape, *[1] * (labels.dim() - 2)).expand_as(spread), logp[0])
        return logp, None if entropy is None else zeros.masked_scatter(mask, entropy[0])

    def _packed_masks(self, attend, distance, kept: dict[str, int]):
        """The packed rows' attention mask (R, 1, width, columns) for each layer type of the model: `attend` (R, width,
        Lp + width) for full attention; for a sliding window also `distance` (position of query - of key) under the
        window, over the last prompt columns the layer's cache kept. One mask where every layer is one type (the
        models that take no dict), else a dict by layer type, as transformers builds them."""
        config = self.causal.config.get_text_config(decoder=True)
        lp, masks = attend.shape[2] - attend.shape[1], {}
        for kind, columns in kept.items():
            allowed = attend if kind == "full_attention" else attend & (distance < config.sliding_window)
            allowed = allowed[:, None, :, lp - columns :]
            if config._attn_implementation == "eager":  # eager adds the mask to the scores
                allowed = torch.zeros(allowed.shape, device=allowed.device).masked_fill(
                    ~allowed, torch.finfo(torch.float32).min
                )
            masks[kind] = allowed
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def _full_sequences(self, prompt_ids, prompt_mask, response_ids, response_mask) -> Tensor:
        """Same hidden states from one forward over each sample's prompt + response, no cache."""
        g, width = response_ids.shape[0] // prompt_ids.shape[0], prompt_ids.shape[1]
        mask = torch.cat([prompt_mask.repeat_interleave(g, 0), response_mask.long()], 1)
        out = self.causal.base_model(
            input_ids=torch.cat([prompt_ids.repeat_interleave(g, 0), response_ids], 1),
            attention_mask=mask,
            position_ids=(mask.cumsum(1) - 1).clamp_min(0),
            use_cache=False,
        )
        return out.last_hidden_state[:, width - 1 : width - 1 + response_ids.shape[1]]  # the last prompt token on


class ScaledHead(torch.nn.Module):
    """An LM head whose logits the model's forward transforms: times `scale`, then soft-capped at `cap` (Gemma)."""

    def __init__(self, head: torch.nn.Module, scale: float, cap: float | None):
        super().__init__()
        self.head, self.scale, self.cap = head, scale, cap

    def forward(self, hidden: Tensor) -> Tensor:
        logits = self.head(hidden) * self.scale
        return logits if self.cap is None else torch.tanh(logits / self.cap) * self.cap


def output_head(causal) -> torch.nn.Module:
    """The LM head of `causal` as its forward applies it: Granite's 1 / logits_scaling, Falcon-H1's
    lm_head_multiplier, Gemma's final_logit_softcapping (each where the config has it); else the head itself."""
    head, config = causal.get_output_embeddings(), causal.config.get_text_config(decoder=True)
    scale = getattr(config, "lm_head_multiplier", None) or 1.0
    scale /= getattr(config, "logits_scaling", None) or 1.0
    cap = getattr(config, "final_logit_softcapping", None)
    return head if scale == 1.0 and cap is None else ScaledHead(head, scale, cap)


def select_rows(cache, index: Tensor, repeats: int = 1):
    """`cache` (a transformers Cache after the prompts' forward, P rows) with its rows index (R,) each repeated
    `repeats` times -> R * repeats rows, in place and differentiably (gradients flow back to the prompts' states):
    every layer's keys and values and its conv and recurrent states. The recurrent states are taken out of place
    from then on: the next forward reads them in its graph, and transformers' in-place update would break backward."""
    index = index.repeat_interleave(repeats)
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            for i, state in states.items():
                if state is not None:
                    states[i] = state[index]
        if hasattr(layer, "recurrent_states"):
            layer.update_recurrent_state = functools.partial(_set_state, layer.recurrent_states)
    return cache


def _set_state(states: dict, recurrent_states: Tensor, state_idx: int = 0, **kwargs) -> Tensor:
    """LinearAttentionLayer.update_recurrent_state, by assignment (transformers copies into the old tensor)."""
    states[state_idx] = recurrent_states
    return recurrent_states


def _kept_columns(cache) -> dict[str, int]:
    """Layer type (full_attention, sliding_attention) -> the columns of keys its layers hold after the prompts."""
    kept = {}
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:
            kept["sliding_attention" if layer.is_sliding else "full_attention"] = layer.keys.shape[-2]
    return kept


PACK_MIN_SAVING = 0.1  # pack a microbatch's responses when that leaves out at least this share of its rows


@dataclass(frozen=True)
class Packing:
    """Where a microbatch's responses sit when each group's share rows (learn.padding_free)."""

    row_group: Tensor  # (R,) long: the group (prompt) whose responses fill row r
    start: Tensor  # (N,) long: row * width + column of each response's first token
    width: int  # tokens a row holds: the microbatch's longest response


def pack_responses(lengths: list[int], group_size: int, width: int) -> Packing:
    """First-fit decreasing of each group's responses into rows of `width` tokens, a row holding one group's.

    lengths (N,), group g's responses at g*G .. g*G+G-1.

    >>> p = pack_responses([5, 2, 3, 1, 4, 4], group_size=3, width=5)
    >>> p.row_group.tolist(), p.start.tolist()
    ([0, 0, 1, 1], [0, 8, 5, 14, 10, 15])
    """
    row_group, start = [], [0] * len(lengths)
    for g in range(len(lengths) // group_size):
        members = range(g * group_size, (g + 1) * group_size)
        free: list[list[int]] = []  # [row, tokens left] of this group's rows
        for i in sorted(members, key=lambda i: -lengths[i]):
            fit = next((f for f in free if f[1] >= lengths[i]), None)
            if fit is None:
                fit = [len(row_group), width]
                row_group.append(g)
                free.append(fit)
            start[i] = fit[0] * width + width - fit[1]
            fit[1] -= lengths[i]
    return Packing(torch.tensor(row_group, dtype=torch.long), torch.tensor(start, dtype=torch.long), width)


def forward_logprobs(model, batch: Batch, groups: Tensor, with_entropy: bool = False, topk: bool = False):
    """Per-token log-probs (P'*G, T) of the responses of `groups` (P',) under `model` (a PolicyLM),
    rows in Batch.rows order, and their entropy (or None); 0 past each response's end. With `topk` a third: the
    log-probs (P'*G, T, k) of the batch's teacher top-k ids (batch.topk_ids) from the same forward (GKD's term).

    No compute on the batch's padding beyond these groups' own: the forward sees only the columns from
    their longest prompt's first token to their longest response's last (the batch is padded to its
    longest of each). Positions come from the masks, so the log-probs are the same."""
    rows = batch.rows(groups)
    prompt_mask, response_mask = batch.prompt_mask[groups], batch.response_mask[rows]
    lp, width = prompt_mask.shape[1], batch.response_ids.shape[1]
    start = lp - max(1, int(prompt_mask.sum(1).max()))  # left padding every prompt of these groups has
    end = max(1, int(response_mask.sum(1).max()))  # right padding every response has
    out = model(
        batch.prompt_ids[groups, start:],
        prompt_mask[:, start:],
        batch.response_ids[rows, :end],
        response_mask[:, :end],
        with_entropy=with_entropy,
        **({"topk_ids": batch.topk_ids[rows, :end]} if topk else {}),
    )
    logp, entropy = out[0], out[1]
    pad, kept = (0, width - end), response_mask[:, :end]  # (P'*G, end) -> (P'*G, T)
    padded = F.pad(logp * kept, pad), None if entropy is None else F.pad(entropy * kept, pad)
    return padded if not topk else (*padded, F.pad(out[2] * kept[..., None], (0, 0, *pad)))


@torch.no_grad()
def score(model, batch: Batch, chunk_groups: int, groups: Tensor | None = None) -> Tensor:
    """Log-probs (N, T) of every response (of `groups`, default all) under `model`, `chunk_groups`
    groups a forward."""
    model.eval()
    groups = torch.arange(len(batch.prompt_ids), device=batch.prompt_ids.device) if groups is None else groups
    return torch.cat([forward_logprobs(model, batch, c)[0] for c in groups.split(chunk_groups)])
