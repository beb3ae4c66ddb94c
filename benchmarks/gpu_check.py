"""The GPU path end to end on one GPU, with no downloads, in a few minutes; exits non-zero on a failure.

    .venv/bin/python benchmarks/gpu_check.py           # a GPU machine: a ~0.5B Qwen2 in bf16
    .venv/bin/python benchmarks/gpu_check.py --tiny    # anywhere (CI runs it on CPU): the same steps, toy size
    .venv/bin/python benchmarks/gpu_check.py --cases full lora   # some of the cases (default: all but full-before)
    python3 benchmarks/gpu_check.py --backend hf --no-flow  # no vLLM, no Prefect: transformers sampling,
                                                            # the iterations run as `grpo run` runs them

1. A Qwen2-architecture model built from a config (Qwen2.5-0.5B's shape: 24 layers, width 896,
   grouped-query attention, a 151,936-row embedding), random weights saved in bf16, with a byte-level
   BPE tokenizer trained here by `tokenizers` and Qwen's chat template; word-problem prompts as JSONL
   and a reward function in a file (the response's length: random weights need a reward with spread).
2. Per case, three warm iterations of the Prefect flow `grpo` (no server: Prefect's ephemeral API; with
   --no-flow, stages.iteration.run_warm as `grpo run` calls it, so Prefect need not be installed):
   vLLM with its GPU settings (CUDA graphs, prefix caching, sleep mode: asleep while the learner runs;
   with --backend hf, transformers' KV-cache sampler, off the GPU while the learner runs), the learner
   under bf16 autocast with a KL penalty. Cases (CASES): `full` fine-tuning on one process
   (the reference model loaded too); `lora`, r=16 adapters on every projection (vLLM serves them with
   its LoRA kernels on a GPU, merged into its weights on a CPU; the reference is the base, adapters
   off); `fsdp2`, full fine-tuning sharded over 2 processes, one GPU each (NCCL): needs 2 GPUs, skipped
   with a note otherwise (`--tiny` on a CPU skips it too: tests/test_sharding.py runs it on gloo); `overlap`,
   asynchronous iterations in one process (rollout.staleness=1, the transformers sampler on cuda:0, the learner
   on cuda:1): the flow runs learn k in a thread while it samples iteration k+1, and the case fails unless the
   manifests show it did (grpo.report.overlaps); needs 2 GPUs and the flow (tests/test_overlap_one_process.py
   forces it on a CPU). Its log-prob gap is a stale sampler's, not numerics': left out of --max-gap.
3. Prints per case, per iteration: rollout tokens/s in the pipeline; learner tokens/s and model FLOPs
   utilization (6N FLOPs a token, 4N for LoRA: the frozen base gets no weight gradients; over every
   learner GPU); each stage's peak GPU memory (this process's), and every GPU's peak in use over the
   case (NVML: torchrun's workers included); the bytes the last learn committed; the mean |sampler -
   learner| log-prob of the sampled tokens. After the `full` case, vLLM's own tokens/s on the same
   prompts outside the pipeline (the ratio is the pipeline's cost; not with --backend hf). Fails when
   a gap exceeds --max-gap (0.05).
4. The learner as issue 34 left it: microbatches by a token budget (learn.microbatch_tokens) and the log-prob
   kernel of the device (learn.logprob_kernel=auto: Liger's fused linear cross-entropy where liger_kernel
   imports, printed per case as `kernels`); the case `full-before` (not run unless named) is the learner before
   it, microbatches of 32 samples and the chunked torch log-probs. After the cases, one more iteration of `full`
   whose learn benchmarks/learner_profile.py profiles (its phases' split, the top kernels; --no-profile skips it),
   and, where `trl` imports, TRL's GRPOTrainer with use_liger_kernel=True learning on the same model, prompts,
   group and lengths (its learner tokens/s: its steps' time less its generation's).

The lent GPU machine has torch and triton but neither liger-kernel nor TRL (nor datasets, which TRL imports):
`benchmarks/gpu_wheels.sh` downloads them here as wheels into .whl, and its header is the one device call
that installs them there and runs this script; without them the learner runs the torch path and the TRL line
says why it is missing. Under 8 minutes on one H100/H200: 2 iterations a case at full size (3 at --tiny), the
profile one more. On a CPU (--tiny) TRL's trainer runs too, in float32 without Liger, so its code cannot rot.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # learner_profile, however this script is started

# dense bf16 peak of the GPUs this is likely to meet, FLOP/s (vendor figures, no sparsity)
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "L4": 121e12}

SHAPES = {  # Qwen2.5-0.5B, and a toy of the same architecture (vLLM on CPU needs head_dim >= 32)
    "full": dict(
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        max_position_embeddings=4096,
        model_vocab_size=151936,
    ),
    "tiny": dict(
        hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_position_embeddings=256
    ),
}
SETTINGS = {
    "full": [
        "rollout.prompts_per_iteration=64",
        "rollout.group_size=8",
        "rollout.max_tokens=256",
        "learn.minibatch_size=256",
        "learn.microbatch_size=32",  # pi_old's and the reference's passes: 4 groups a forward
        "learn.microbatch_tokens=12288",  # a group: <= 64 prompt + 8 x 256 response tokens
        "eval.n_prompts=32",
    ],
    "tiny": [
        "rollout.prompts_per_iteration=8",
        "rollout.group_size=4",
        "rollout.max_tokens=16",
        "learn.minibatch_size=16",
        "learn.microbatch_size=8",
        "learn.microbatch_tokens=256",
        "eval.n_prompts=8",
    ],
}
# name -> (its settings on top of make_world's, GPUs it needs: 0 runs on a CPU too)
CASES = {
    "full": ([], 0),
    "lora": (["learn.lora={r: 16, alpha: 32}", "learn.lr=1e-4"], 0),
    "fsdp2": (["learn.num_processes=2", "learn.sharding=fsdp2"], 2),
    "full-before": (["learn.microbatch_tokens=null", "learn.logprob_kernel=torch"], 0),
    # one process, two GPUs: transformers samples iteration k+1 on cuda:0 while learn k trains on cuda:1
    "overlap": (
        ["rollout.staleness=1", "learn.behavior_correction=tis", "rollout.backend=hf"]
        + ["rollout.device=cuda:0", "learn.device=cuda:1"],
        2,
    ),
}
DEFAULT_CASES = ["full", "lora", "fsdp2", "overlap"]


def make_world(root: Path, size: str, backend: str) -> list[str]:
    """Model, prompts and reward file under root; returns the run's config overrides."""
    from grpo.tiny_model import build_chat_model

    questions = [
        f"Tom has {a} apples and buys {b} more. How many apples does he have?"
        for a in range(1, 11)
        for b in range(1, 11)
    ]
    rows = [{"prompt": q, "ground_truth": str(i)} for i, q in enumerate(questions)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts = questions + ["<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"]
    build_chat_model(str(root / "model"), texts, vocab_size=400, dtype="bfloat16", **SHAPES[size])
    (root / "reward.py").write_text(
        "def length(response, ground_truth, prompt, **row):\n    return len(response) / 100\n"
    )
    return [
        f"model.base_model={root / 'model'}",
        "task.name=math",
        f"task.dataset={root / 'prompts.jsonl'}",
        "task.prompt_format=chat",
        f"rollout.backend={backend}",
        "rollout.max_prompt_tokens=64",
        f"reward.functions=[{root / 'reward.py'}:length]",
        "reward.truncated_reward=null",
        "reward.workers=2",
        "learn.mixed_precision=bf16",
        "learn.kl_coef=0.01",
        "learn.lr=1e-5",
        "eval.split_fraction=0.2",
        *SETTINGS[size],
    ]


def seconds(m) -> float:
    return (datetime.fromisoformat(m.committed_at) - datetime.fromisoformat(m.started_at)).total_seconds()


class DevicePeak(threading.Thread):
    """Polls every GPU's memory in use (all processes: torchrun's workers too) until stopped; GiB peaks."""

    def __init__(self, every_s: float = 0.2):
        super().__init__(daemon=True)
        self.every_s, self.stop, self.peaks = every_s, threading.Event(), None

    def run(self) -> None:
        while not self.stop.is_set():
            used = device_memory_used()
            if used is None:
                return
            self.peaks = [max(a, b) for a, b in zip(self.peaks, used)] if self.peaks else used
            time.sleep(self.every_s)


def device_memory_used() -> list[float] | None:
    """GiB in use on each GPU (NVML through torch, else nvidia-smi); None without a GPU or either."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        return [torch.cuda.device_memory_used(i) / 2**30 for i in range(torch.cuda.device_count())]
    except Exception:  # no pynvml
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        return [float(x) / 1024 for x in out.split()]
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def learn_bytes(committed) -> tuple[int, int]:
    """(bytes, Parquet bytes) a learn committed: weights and resume state, then its tables."""
    sizes = [(f.size, f.path.endswith(".parquet")) for f in committed.manifest.files]
    return sum(n for n, table in sizes if not table), sum(n for n, table in sizes if table)


def report(storage, run_id: str, iterations: int, n_params: int, peak: float | None, lora: bool) -> tuple[list, dict]:
    """Print a case's table, one row an iteration; returns its log-prob gaps and the last iteration's
    sampler settings and rollout tokens/s (generate calls, whole stage)."""
    from grpo.record.layout import stage_dir
    from grpo.record.storage import latest_committed
    from stages import STAGES

    print(
        f"{'iter':>4} {'rollout tok/s':>13} {'stage tok/s':>11} {'learn tok/s':>11} {'MFU':>6} {'gap':>7}  "
        "peak GPU GiB per stage (torch allocator / device in use)"
    )
    gaps = []
    for k in range(iterations):
        m = {s: latest_committed(storage, stage_dir(storage, run_id, k, s), verify=False).manifest for s in STAGES}
        ro, le = m["rollouts"].summary, m["learn"].summary
        rollout_tps = ro["response_tokens"] / ro["generate_s"]
        stage_tps = ro["response_tokens"] / seconds(m["rollouts"])
        learn_tps = le["tokens"] / le["update_s"]
        flops = (4 if lora else 6) * n_params * learn_tps
        mfu = f"{flops / (peak * le['world_size']):.1%}" if peak else "n/a"
        mem = (
            " ".join(
                f"{s} {m[s].summary['gpu_peak_gib']:.1f}/{m[s].summary['gpu_used_gib']:.1f}"
                for s in ("rollouts", "learn", "eval")
                if "gpu_peak_gib" in m[s].summary
            )
            or "(no GPU)"
        )
        gaps.append(le["logprob_gap"])
        print(
            f"{k:>4} {rollout_tps:>13.0f} {stage_tps:>11.0f} {learn_tps:>11.0f} {mfu:>6} {le['logprob_gap']:>7.4f}  "
            f"{mem}"
        )
    print(f"learner kernels: {le.get('kernels')}")
    committed, tables = learn_bytes(latest_committed(storage, stage_dir(storage, run_id, iterations - 1, "learn")))
    print(f"learn {iterations - 1} committed {committed / 1e6:.1f} MB (+ {tables / 1e6:.2f} MB of Parquet)")
    return gaps, {"sampler": ro["sampler"], "rollout_tps": rollout_tps, "stage_tps": stage_tps}


def vllm_alone(storage, run_id: str, iteration: int, cfg) -> float:
    """vLLM's own tokens/s on the iteration's prompts, its G samples each, outside the pipeline (the
    run's live engine, awake with the iteration's snapshot weights: no reads, decoding or Parquet)."""
    import pandas as pd
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from grpo.sampling import engines
    from stages import stage_function

    rollouts = stage_function("rollouts")(storage, run_id, iteration)
    table = pd.read_parquet(storage.uri(rollouts.path("rollouts.parquet")), columns=["prompt_id", "prompt_ids"])
    prompts = table.drop_duplicates("prompt_id").prompt_ids.map(list).tolist()
    gen = engines._CACHE["vllm"]
    gen.wake()
    r = cfg.rollout
    params = SamplingParams(
        n=r.group_size, temperature=r.temperature, max_tokens=r.max_tokens, logprobs=0, detokenize=False, seed=0
    )
    t0 = time.perf_counter()
    outs = gen.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return sum(len(c.token_ids) for o in outs for c in o.outputs) / elapsed


def run_case(storage, run_id: str, iterations: int, overrides: list[str], flow: bool) -> None:
    """A case's warm iterations: the Prefect flow `grpo`, or (flow=False) `grpo init` then `grpo run`'s
    loop (stages.iteration.run_warm), which needs no Prefect."""
    if flow:
        from flows.grpo import grpo

        grpo(run_id=run_id, iterations=iterations, overrides=overrides, storage_url=storage.url)
        return
    from stages.init import init_run, run_config
    from stages.iteration import run_warm

    t0 = time.perf_counter()
    init_run(storage, run_id, run_config(storage, run_id, None, overrides))
    for k, _ in run_warm(storage, run_id, 0, iterations):  # a line each, so a run cut short shows how far it got
        print(f"{run_id}: iteration {k} committed at {time.perf_counter() - t0:.0f} s", flush=True)


def compare_vllm(storage, iteration: int, overrides: list[str], last: dict) -> None:
    """Print vLLM's own tokens/s on the `full` case's last prompts against the pipeline's."""
    from grpo.config import load_config

    alone = vllm_alone(storage, "check-full", iteration, load_config(None, overrides))
    print(
        f"vLLM alone on iteration {iteration}'s prompts: {alone:.0f} tok/s; the pipeline's rollouts "
        f"stage ran at {last['stage_tps'] / alone:.2f}x that (generate calls alone: "
        f"{last['rollout_tps'] / alone:.2f}x)"
    )


def profile_extra(storage, run_id: str, iteration: int) -> None:
    """One more iteration of run_id, its learn profiled (benchmarks/learner_profile.py: phases, top kernels)."""
    from learner_profile import profile_learn

    from stages import stage_function

    for stage in ("snapshot", "rollouts", "rewards", "advantages"):
        stage_function(stage)(storage, run_id, iteration)
    profile_learn(storage, run_id, iteration)


def trl_learner(root: Path, overrides: list[str], n_params: int, peak: float | None) -> None:
    """TRL's GRPOTrainer on the `full` case's model, prompts, group, lengths and minibatch, two generations and
    their optimizer steps: its learner tokens/s (the steps' time less the generations', the completion tokens it
    learned on) and MFU. On a GPU in bf16 with use_liger_kernel=True; on a CPU (--tiny,
    CI) in float32 without Liger (its kernels are Triton's), which only shows that this code runs against the
    TRL installed. A line saying why not where TRL or its datasets do not import (a GPU machine without them
    carried: benchmarks/gpu_wheels.sh)."""
    import torch

    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except Exception as e:  # noqa: BLE001 - not installed, or carried beside a pyarrow it cannot use
        print(f"\nTRL: not measured (it does not import here: {type(e).__name__}: {str(e)[:200]})")
        return
    from importlib.metadata import version

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.config import load_config

    gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if gpu else lambda: None
    cfg = load_config(None, overrides)
    r, lc = cfg.rollout, cfg.learn
    rows = [json.loads(line) for line in (root / "prompts.jsonl").read_text().splitlines()]
    steps = r.prompts_per_iteration * r.group_size // lc.minibatch_size
    args = GRPOConfig(
        output_dir=str(root / "trl"),
        per_device_train_batch_size=lc.minibatch_size,
        steps_per_generation=steps,
        num_generations=r.group_size,
        max_completion_length=r.max_tokens,
        beta=lc.kl_coef,
        learning_rate=lc.lr,
        max_steps=2 * steps,
        bf16=gpu,
        use_cpu=not gpu,
        use_liger_kernel=gpu,
        gradient_checkpointing=False,
        save_strategy="no",
        report_to="none",
        logging_steps=steps,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(root / "model"), dtype=torch.float32),
        reward_funcs=lambda completions, **_: [len(str(c)) / 100 for c in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [row["prompt"] for row in rows]}),
        processing_class=AutoTokenizer.from_pretrained(str(root / "model")),
    )
    spent = {"generate": [], "tokens": []}
    generate = trainer._generate_and_score_completions

    def timed(*a, **k):
        sync()
        t0 = time.perf_counter()
        out = generate(*a, **k)
        sync()
        spent["generate"].append(time.perf_counter() - t0)
        spent["tokens"].append(int(out["completion_mask"].sum()))
        return out

    trainer._generate_and_score_completions = timed
    sync()
    t0 = time.perf_counter()
    trainer.train()
    sync()
    total = time.perf_counter() - t0
    learn_s = total - sum(spent["generate"])
    tokens = sum(spent["tokens"])  # every step's completion tokens (the two generations' together)
    tps = tokens / learn_s
    mfu = f"{6 * n_params * tps / peak:.1%}" if peak else "n/a"
    how = "bf16, use_liger_kernel=True" if gpu else "float32 on the CPU, no Liger"
    memory = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if gpu else ""
    print(
        f"\nTRL {version('trl')} GRPOTrainer, {how} (same model, prompts, G, lengths, minibatch): learner "
        f"{tps:.0f} tok/s, MFU {mfu}, {learn_s:.1f} s learning of {total:.1f} s, {len(spent['generate'])} "
        f"generations{memory}"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy size, runs on a CPU")
    parser.add_argument("--iterations", type=int, help="warm iterations a case (default: 2, at --tiny 3)")
    parser.add_argument("--max-gap", type=float, default=0.05)
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, choices=list(CASES))
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="no profiled learn after `full`")
    parser.add_argument("--backend", default="vllm", choices=["vllm", "hf"], help="rollout.backend (hf: transformers)")
    parser.add_argument("--no-flow", dest="flow", action="store_false", help="run_warm as `grpo run`, not Prefect")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    size = "tiny" if args.tiny else "full"
    args.iterations = args.iterations or (3 if args.tiny else 2)
    root = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    os.environ.setdefault("PREFECT_HOME", str(root / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect's ephemeral API server gets 20 s to start by default: too few on a busy 2-core CI machine
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    import torch
    from transformers.utils.logging import disable_progress_bar

    from grpo.record.checkpoint import parameter_count
    from grpo.record.storage import open_storage
    from grpo.sampling.engines import close_generators

    disable_progress_bar()  # a "Loading weights" and "Writing model shards" bar per checkpoint between the lines
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    print(
        f"device: {gpu or 'cpu'} x {torch.cuda.device_count()}; size: {size}; backend: {args.backend}; "
        f"{'flow' if args.flow else 'no flow'}; folder: {root}",
        flush=True,
    )
    t0 = time.perf_counter()
    common = make_world(root, size, args.backend)
    storage = open_storage((root / "store").as_uri())
    n_params = parameter_count(root / "model")
    peak = next((v for k, v in PEAK_BF16.items() if gpu and k in gpu), None)
    print(f"model: {n_params / 1e6:.1f}M parameters; built in {time.perf_counter() - t0:.0f} s")
    gaps, missed = {}, []
    for name in args.cases:
        settings, gpus = CASES[name]
        if torch.cuda.device_count() < gpus:
            print(f"\n{name}: skipped, needs {gpus} GPUs ({torch.cuda.device_count()} here)")
            continue
        if name == "overlap" and not args.flow:
            print(f"\n{name}: skipped, needs the flow (`grpo run` runs the stages in order)")
            continue
        if name == "overlap":  # the cases before left vLLM's engine holding most of cuda:0, and nothing puts it to
            close_generators()  # sleep here: the learner has cuda:1 to itself
        t = time.perf_counter()
        devices = DevicePeak()
        devices.start()
        run_case(storage, f"check-{name}", args.iterations, common + settings, args.flow)
        devices.stop.set()
        devices.join()
        print(
            f"\n{name}: {args.iterations} warm iterations in {time.perf_counter() - t:.0f} s "
            f"(with an engine start where the sampler settings changed); settings {settings or 'as make_world'}"
        )
        gap, last = report(storage, f"check-{name}", args.iterations, n_params, peak, "lora" in name)
        if name == "overlap":
            missed += [] if overlapped(storage, f"check-{name}", args.iterations) else [name]
        else:
            gaps[name] = gap
        if devices.peaks:
            print("peak GPU memory in use over the case, GiB: " + " ".join(f"{g:.1f}" for g in devices.peaks))
        print(f"sampler settings: {last['sampler']}")
        if name == "full" and args.backend == "vllm":
            compare_vllm(storage, args.iterations - 1, common + settings, last)
        elif name == "full":
            print("vLLM alone: not measured (--backend hf)")
        if name == "full" and args.profile:
            profile_extra(storage, "check-full", args.iterations)
    if "full" in args.cases:
        trl_learner(root, common + CASES["full"][0], n_params, peak)
    close_generators()
    print(f"\n{time.perf_counter() - t0:.0f} s in all")
    return verdict(gaps, args.max_gap, missed)


def overlapped(storage, run_id: str, iterations: int) -> bool:
    """Print and check that every learn but the last ran while the next iteration sampled (the `overlap` case)."""
    from grpo.report import overlaps, stage_times

    found = overlaps(stage_times(storage, run_id))
    print(f"learns that ran while the next iteration sampled: {found} (expected {list(range(iterations - 1))})")
    return found == list(range(iterations - 1))


def verdict(gaps: dict[str, list[float]], max_gap: float, missed: list[str] = ()) -> int:
    """Print OK or FAIL on the cases' sampler-vs-learner log-prob gaps and on the overlap; the exit status."""
    if missed:
        print(f"FAIL: {', '.join(missed)}: no learn ran while the next iteration sampled")
        return 1
    if not gaps:
        print("FAIL: no case ran")
        return 1
    failed = {name: max(g) for name, g in gaps.items() if max(g) > max_gap}
    if failed:
        print(f"FAIL: sampler-vs-learner log-prob gap above {max_gap}: {failed}")
        return 1
    print(f"OK: gap {max(max(g) for g in gaps.values()):.4f} <= {max_gap} ({', '.join(gaps)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
