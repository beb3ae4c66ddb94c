"""Sampling throughput of the two rollout backends, vLLM and transformers, on the tiny sort model.

    .venv/bin/python benchmarks/rollout_throughput.py [--prompts 256] [--group-size 8] [--max-tokens 16]
        [--backends vllm hf] [--hf-batch-size 1024] [--vllm-multiprocessing] [--engine-arg max_num_seqs=2048]
        [--set model.hidden_size=512 ...]

Builds the default config's model (what `grpo demo` trains; `--set` changes it) in a temporary folder and times one
`generate` of the same sort prompts per backend (temperature 1, sampler log-probs on, as the rollouts
stage asks), after a warm-up call on a few prompts. Each backend runs in a fresh subprocess: vLLM on
CPU pins torch's threads in the process that hosts it, which would skew a backend timed after it.
Tokens are response tokens, the eos that ended a response included.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial

from grpo.config import RunConfig, load_config
from grpo.sampling.base import SamplingSpec
from grpo.sampling.engines import get_generator
from grpo.tasks import get_task
from stages.init import build_tiny_base

WARMUP_PROMPTS = 32


def time_backend(
    backend: str, model_dir: str, n_prompts: int, spec: SamplingSpec, hf_batch_size: int, engine_args: dict
) -> dict:
    """Seconds and response tokens of one `generate` of `n_prompts` sort prompts, after a warm-up."""
    from transformers import AutoTokenizer

    if engine_args:  # try LLM(...) kwargs VLLMGenerator does not take yet, without editing it
        import vllm

        vllm.LLM = partial(vllm.LLM, **engine_args)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cfg = RunConfig()
    prompts = [
        tokenizer(e.prompt)["input_ids"] for e in get_task(cfg.task.name, **cfg.task.params).generate(n_prompts, 0)
    ]
    t = time.perf_counter()
    gen = get_generator(backend, model_dir, **({"batch_size": hf_batch_size} if backend == "hf" else {}))
    start_s = time.perf_counter() - t
    gen.generate(prompts[:WARMUP_PROMPTS], spec)
    t = time.perf_counter()
    groups = gen.generate(prompts, spec)
    seconds = time.perf_counter() - t
    samples = [s for g in groups for s in g]
    assert len(samples) == n_prompts * spec.n
    assert all(len(s.logprobs) == len(s.response_ids) for s in samples), "a sample lacks log-probs"
    gen.close()
    return {
        "backend": backend,
        "seconds": seconds,
        "tokens": sum(len(s.response_ids) for s in samples),
        "start_s": start_s,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--backends", nargs="+", default=["vllm", "hf"], choices=["vllm", "hf"])
    p.add_argument("--hf-batch-size", type=int, default=1024, help="HFGenerator batch_size: sequences per batch")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="model config overrides")
    p.add_argument(
        "--vllm-multiprocessing",
        action="store_true",
        help="run vLLM's engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1)",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="extra vllm.LLM keyword, e.g. max_num_seqs=2048 (integer values)",
    )
    p.add_argument("--model-dir", default=None, help="default: build the tiny model in a temporary folder")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # time this backend, print one JSON line
    args = p.parse_args()
    spec = SamplingSpec(n=args.group_size, temperature=1.0, max_tokens=args.max_tokens)
    engine_args = {k: int(v) for k, v in (a.split("=", 1) for a in args.engine_arg)}
    if args.child:
        print(json.dumps(time_backend(args.child, args.model_dir, args.prompts, spec, args.hf_batch_size, engine_args)))
        return
    cfg = load_config(None, [f"model.max_position_embeddings={max(64, 16 + args.max_tokens)}"] + args.set)
    model_dir = args.model_dir or build_tiny_base(tempfile.mkdtemp(prefix="grpo-bench-model-"), cfg)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if args.vllm_multiprocessing else "0")
    print(
        f"model {model_dir} ({' '.join(args.set) or 'default'}): {args.prompts} prompts x {args.group_size} samples, "
        f"max_tokens {args.max_tokens}, temperature 1"
    )
    print(f"{'backend':>7} {'start_s':>8} {'seconds':>8} {'tokens':>7} {'tokens/s':>9}", flush=True)
    rate = {}
    for backend in args.backends:
        child = [sys.executable, __file__, "--child", backend, "--model-dir", model_dir]
        forwarded = [
            "--prompts",
            args.prompts,
            "--group-size",
            args.group_size,
            "--max-tokens",
            args.max_tokens,
            "--hf-batch-size",
            args.hf_batch_size,
        ] + [x for a in args.engine_arg for x in ("--engine-arg", a)]
        done = subprocess.run(child + list(map(str, forwarded)), env=env, stdout=subprocess.PIPE, check=True, text=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        rate[backend] = r["tokens"] / r["seconds"]
        print(
            f"{backend:>7} {r['start_s']:>8.1f} {r['seconds']:>8.2f} {r['tokens']:>7} {rate[backend]:>9.0f}", flush=True
        )
    if {"vllm", "hf"} <= rate.keys():
        print(f"vllm/hf tokens/s: {rate['vllm'] / rate['hf']:.1f}x (target >= 5x)")


if __name__ == "__main__":
    main()
