"""The transformers backend: batched decoding with the model's KV cache, sampler log-probs under the raw model."""

from __future__ import annotations

from pathlib import Path

import torch

from grpo.record.weights import load_model, read_weights
from grpo.sampling.base import Sample, SamplingSpec, pad_token_id, stop_token_ids


class HFGenerator:
    """A transformers model decoded with its own KV cache, for machines without vLLM.

    Each prompt is prefilled once and its n samples decode from copies of its cache (the prompt
    shared, like vLLM's parallel sampling); each step keeps only the sampled token's log-prob, so
    memory grows with sequences x tokens, not x vocabulary. Batched, prompts left-padded.
    """

    logprobs_dtype = "float32"  # a bf16 model's logits upcast before log_softmax, as the learner's are

    def __init__(self, model_dir: str, batch_size: int = 1024, dtype: str = "float32", device: str | None = None):
        """device: where it samples (rollout.device resolved); None: the GPU where CUDA is available, else the CPU."""
        from transformers import AutoTokenizer

        self.model_dir, self.batch_size = model_dir, batch_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos = torch.tensor(stop_token_ids(self.tokenizer, model_dir), device=self.device)
        self.model = load_model(model_dir, getattr(torch, dtype)).eval()  # its own architecture: a multimodal one whole
        self.model.to(self.device)
        self.adapter_dir: str | None = None

    @torch.no_grad()
    def _batch(
        self,
        prompts: list[list[int]],
        spec: SamplingSpec,
        budgets: list[int],
        rng: torch.Generator,
        progress=None,
        seeds: list[int] | None = None,
    ) -> list[list[Sample]]:
        pad = pad_token_id(self.tokenizer)
        width, dev = max(map(len, prompts)), self.device
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=dev)
        attn = (
            torch.arange(width, device=dev) >= torch.tensor([width - len(p) for p in prompts], device=dev)[:, None]
        ).long()
        out = self.model(
            input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp_min(0), use_cache=True
        )
        cache = out.past_key_values
        # every layer's state (KV, sliding window, conv, recurrent) repeated for the n samples: (B, ...) -> (B*n, ...);
        # every transformers cache layer kind has reorder_cache (batch_repeat_interleave: only the KV ones)
        cache.reorder_cache(torch.arange(len(prompts), device=dev).repeat_interleave(spec.n))
        logits = out.logits[:, -1].repeat_interleave(spec.n, 0)  # (B*n, V)
        attn = attn.repeat_interleave(spec.n, 0)
        position = attn.sum(1, keepdim=True)  # (B*n, 1): where the next token sits
        tokens, logps = [], []
        done = torch.zeros(len(logits), dtype=torch.bool, device=dev)
        stopped = done.clone()  # ended by an eos or a stop string
        limit = torch.tensor(budgets, device=dev).repeat_interleave(spec.n)  # (B*n,) each prompt's own budget
        length = limit.clone()  # tokens kept per row
        # seeds: each row's uniforms from its own seed, whatever the batch (B*n, T); else one stream for the call
        uniforms = None if seeds is None else row_uniforms(seeds, spec.n, int(limit.max())).to(dev)
        for t in range(int(limit.max())):
            logp = logits.float().log_softmax(-1)  # the raw distribution, before temperature and top-p
            if spec.temperature == 0:
                tok = logp.argmax(-1)
            elif uniforms is None:
                tok = sample_token(logits.float() / spec.temperature, spec.top_p, rng)
            else:
                tok = sample_token_at(logits.float() / spec.temperature, spec.top_p, uniforms[:, t])
            tok = tok.masked_fill(done, pad)
            tokens.append(tok)
            logps.append(logp.gather(-1, tok[:, None]).squeeze(-1))
            ended = ~done & torch.isin(tok, self.eos)
            if spec.stop:
                ended |= ~done & self._stop_strings_seen(tokens, spec.stop)
            length[ended], done, stopped = t + 1, done | ended, stopped | ended
            done |= limit == t + 1  # out of budget: "length" (length stays at the budget)
            if progress is not None:
                progress(int(done.view(-1, spec.n).all(1).sum()))  # prompts whose n samples all ended
            if done.all():
                break
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=attn,
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
            )
            logits, position = out.logits[:, -1], position + 1
        rows, row_logps = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()
        samples = [
            Sample(r[:k], lp[:k], "stop" if s else "length")
            for r, lp, k, s in zip(rows, row_logps, length.tolist(), stopped.tolist())
        ]
        return [samples[i * spec.n : (i + 1) * spec.n] for i in range(len(prompts))]

    def _stop_strings_seen(self, tokens: list[torch.Tensor], stop: tuple[str, ...]) -> torch.Tensor:
        """(B*n,) whether each row's text so far holds a stop string."""
        rows = torch.stack(tokens, 1).tolist()
        return torch.tensor([any(s in self.tokenizer.decode(r) for s in stop) for r in rows], device=self.device)

    def generate(
        self,
        prompts: list[list[int]],
        spec: SamplingSpec,
        budgets: list[int] | None = None,
        progress=None,
        seeds: list[int] | None = None,
    ) -> list[list[Sample]]:
        rng = torch.Generator(self.device).manual_seed(spec.seed)
        budgets = budgets or [spec.max_tokens] * len(prompts)
        step = max(1, self.batch_size // spec.n)
        out: list[list[Sample]] = []
        for i in range(0, len(prompts), step):
            batch_progress = None if progress is None else lambda k, i=i: progress(i + k)
            rows = None if seeds is None else seeds[i : i + step]
            out += self._batch(prompts[i : i + step], spec, budgets[i : i + step], rng, batch_progress, rows)
        return out

    def reset_prefix_cache(self) -> None:
        pass  # each call prefills its prompts afresh

    def load_weights(self, model_dir: str) -> None:
        """The checkpoint in model_dir's weights into the model in place, through transformers' loading (its key
        conversions: a hub checkpoint's per-expert MoE tensors fused as the model holds them)."""
        if self.adapter_dir is not None or hasattr(self.model, "unload"):  # back to the plain model
            self.model, self.adapter_dir = self.model.unload(), None
        read_weights(self.model, model_dir)
        self.model_dir = model_dir

    def load_adapter(self, adapter_dir: str | None) -> None:
        """peft's LoRA layers in the model, unmerged (x W + s x A B): a new policy's adapters are loaded
        into them in place; None switches them off."""
        from peft import PeftModel, set_peft_model_state_dict
        from safetensors.torch import load_file

        if adapter_dir is None:
            if hasattr(self.model, "disable_adapter_layers"):
                self.model.base_model.disable_adapter_layers()
        elif not hasattr(self.model, "get_base_model"):
            # the adapters made on the meta device, then loaded: no draw from torch's global generator, which a learner
            # in another thread of this process may be drawing from (flows/placement.py overlapping)
            self.model = (
                PeftModel.from_pretrained(self.model, adapter_dir, low_cpu_mem_usage=True).eval().to(self.device)
            )
        else:
            weights = load_file(str(Path(adapter_dir, "adapter_model.safetensors")), device=str(self.device))
            result = set_peft_model_state_dict(self.model, weights)
            if result.unexpected_keys:
                raise ValueError(f"{adapter_dir}: adapters do not fit the loaded ones ({result.unexpected_keys[:3]})")
            self.model.base_model.enable_adapter_layers()
        self.adapter_dir = adapter_dir

    def sleep(self) -> bool:
        self.model.to("cpu")  # on a GPU: off it until the next use
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    def wake(self) -> None:
        self.model.to(self.device)

    def close(self) -> None:
        pass


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """softmax(logits) within the smallest set of mass >= top_p, the rest 0 (not renormalized). (B, V) -> (B, V)."""
    probs = logits.softmax(-1)
    if top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        sorted_p = sorted_p * (sorted_p.cumsum(-1) - sorted_p < top_p)  # the first token always stays
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return probs


def sample_token(logits: torch.Tensor, top_p: float, rng: torch.Generator) -> torch.Tensor:
    """One token per row from softmax(logits), within the smallest set of mass >= top_p (nucleus).

    logits (B, V) -> (B,) long.
    """
    return torch.multinomial(nucleus(logits, top_p), 1, generator=rng).squeeze(-1)


def sample_token_at(logits: torch.Tensor, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """sample_token's distribution drawn by inverse CDF from one uniform per row, u (B,) in [0, 1): a row's token
    depends on its own logits and uniform alone. logits (B, V) -> (B,) long.

    >>> sample_token_at(torch.zeros(2, 2), 1.0, torch.tensor([0.2, 0.7])).tolist()  # two even coins
    [0, 1]
    """
    probs = nucleus(logits, top_p)
    cdf = probs.cumsum(-1)  # (B, V)
    x = (u * cdf[:, -1]).unsqueeze(-1)  # (B, 1)
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def row_uniforms(seeds: list[int], n: int, steps: int) -> torch.Tensor:
    """(len(seeds) * n, steps) uniforms in [0, 1): row i * n + j drawn from its own generator seeded seeds[i] + j, as
    vLLM seeds a request's n samples, on the CPU (the same numbers on any device).

    >>> bool((row_uniforms([5, 9], 2, 3)[1] == row_uniforms([6], 1, 3)[0]).all())
    True
    """
    rows = [(s + j) % 2**63 for s in seeds for j in range(n)]
    return torch.stack([torch.rand(steps, generator=torch.Generator().manual_seed(r)) for r in rows])
