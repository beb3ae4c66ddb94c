"""Peak memory of each learner process and the bytes a learn commits per iteration: full fine-tuning
(ddp on 1 and 2 processes, fsdp2 on 2) and LoRA r=16 (1 process, and fsdp2 on 2), side by side in one
run; then the same accounting by arithmetic at 0.5B / 7B / 70B.

    .venv/bin/python benchmarks/learner_memory.py [--iterations 1] [--microbatch 4] [--dtype float32]
        [--cases ...] [--set learn.kl_coef=0.01]

1. A Qwen2 chat model made on the spot (8 layers, hidden 512, 8 query and 2 key/value heads, MLP 1280,
   a byte-level BPE trained on the problems, an 8192-row embedding: 25.2M parameters) saved in --dtype
   (float32: this CPU has no bf16 matmuls, 50x slower); chat_math.py's GSM8K-style word problems with
   the chat template; a reward of the response's length (random weights need a reward with spread).
   16 prompts x 4 samples, 32 tokens, 1 epoch of minibatches of 32 (2 AdamW steps), --microbatch
   samples a forward on every rank, 1 process or 2 (the same activations); no KL (the default).
2. Each case is its own run. Per iteration the stages up to advantages run in this process (transformers
   sampler: no vLLM process anywhere), then the learn stage alone in a fresh subprocess, twice (glibc's
   malloc as it is, then with a fixed mmap threshold: MALLOC), whose process tree a thread polls every
   20 ms: the peak RSS of each learner rank (torchrun's workers; on 1 process the subprocess itself,
   with its own ru_maxrss) and of the launcher (the stage process that starts torchrun: the batch, no
   model).
3. The bytes the learn committed, from its manifest: weights (policy/ or adapter/), resume state
   (optimizer.pt or dcp/, master.safetensors, rng.pt), and its Parquet tables apart.

RSS includes the Python/torch runtime: printed first, the peak of a process that only imports what the
learn stage imports, and the model's parameter bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pandas as pd
import psutil
from chat_math import SYSTEM, math_task, problem
from timing import machine

from grpo.config import load_config
from grpo.record.checkpoint import parameter_count
from grpo.record.layout import stage_dir
from grpo.record.storage import Committed, latest_committed, open_storage
from grpo.tiny_model import build_chat_model
from stages import stage_function
from stages.init import init_run

LORA = "learn.lora={r: 16, alpha: 32}"
CASES = {  # name -> the learn settings of its run
    "ddp x1 (full)": [],
    "ddp x2 (full)": ["learn.num_processes=2"],
    "fsdp2 x2 (full)": ["learn.num_processes=2", "learn.sharding=fsdp2"],
    "LoRA r=16 x1": [LORA],
    "LoRA r=16 fsdp2 x2": [LORA, "learn.num_processes=2", "learn.sharding=fsdp2"],
}
# the model measured, in the arithmetic's terms: 8 layers, hidden 512, MLP 1280, GQA 8 / 2 heads,
# an 8192-row tied embedding, Qwen2's q/k/v biases
HERE = dict(hidden=512, intermediate=1280, layers=8, heads=8, kv_heads=2, vocab=8192, tied=True, bias=True)
MiB = 2**20
# each learn runs under both: glibc's default, whose mmap threshold rises to the largest block freed so far
# (FSDP2's gathered layers and reduce-scattered gradients then stay in the heap once freed), and a fixed
# threshold, freed blocks going back to the OS at once: closer to the live tensors
MALLOC = {"glibc default": {}, "MALLOC_MMAP_THRESHOLD_=128 KiB": {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}}


def make_world(root: Path, dtype: str, microbatch: int) -> list[str]:
    """Model, problems and reward file under root; returns the runs' shared config overrides."""
    import random

    rng = random.Random(0)
    rows = list({r["question"]: r for r in (problem(rng, 99) for _ in range(2000))}.values())  # distinct
    pd.DataFrame(rows)[["question", "answer"]].to_parquet(root / "problems.parquet")
    texts = [f"{SYSTEM} {r['question']} {r['answer']}" for r in rows]
    build_chat_model(
        str(root / "model"),
        texts,
        vocab_size=HERE["vocab"],  # the BPE stops short of it on these texts: the embedding is padded, as Qwen's
        model_vocab_size=HERE["vocab"],
        hidden_size=HERE["hidden"],
        num_layers=HERE["layers"],
        num_heads=HERE["heads"],
        num_kv_heads=HERE["kv_heads"],
        intermediate_size=HERE["intermediate"],
        max_position_embeddings=256,
        dtype=dtype,
    )
    (root / "reward.py").write_text(
        "def length(response, ground_truth, prompt, **row):\n    return len(response) / 100\n"
    )
    return [
        *math_task(root / "model", root / "problems.parquet"),
        f"reward.functions=[{root / 'reward.py'}:length]",
        "reward.truncated_reward=null",
        "rollout.backend=hf",
        "rollout.prompts_per_iteration=16",
        "rollout.group_size=4",
        "rollout.max_tokens=32",
        "learn.epochs=1",
        "learn.minibatch_size=32",
        # the same samples a forward on every rank, 1 process or 2: the same activations
        f"learn.microbatch_size={microbatch}",
    ]


class TreeRSS(threading.Thread):
    """Polls a process and its descendants until stopped: each one's peak RSS and its role (`rank r` from
    its RANK variable, `stage` for the root, else its program)."""

    def __init__(self, pid: int, every_s: float = 0.02):
        super().__init__(daemon=True)
        self.root, self.every_s, self.stop = psutil.Process(pid), every_s, threading.Event()
        self.peak: dict[int, int] = {}
        self.role: dict[int, str] = {}

    def _role(self, p: psutil.Process) -> str:
        if p.pid == self.root.pid:
            return "stage"
        rank = p.environ().get("RANK")  # read again until set: a worker forks from torchrun, then execs
        return f"rank {rank}" if rank is not None else f"{' '.join(p.cmdline()[1:3])} (pid {p.pid})"

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                tree = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                tree = []
            for p in tree:
                try:
                    rss = p.memory_info().rss
                    if not self.role.get(p.pid, "").startswith(("rank", "stage")):
                        self.role[p.pid] = self._role(p)
                except psutil.Error:  # exited between the listing and the read
                    continue
                self.peak[p.pid] = max(self.peak.get(p.pid, 0), rss)
            time.sleep(self.every_s)

    def peaks(self) -> dict[str, float]:
        """Role -> peak RSS in MiB."""
        return {self.role[pid]: rss / MiB for pid, rss in self.peak.items() if pid in self.role}


def child(what: list[str]) -> dict:
    """In the subprocess: the learn stage of (storage url, run id, iteration[, "force"]), or only its imports."""
    t0 = time.perf_counter()
    import accelerate  # noqa: F401  (what the learner imports when it starts)
    import peft  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    from stages.learn import learn

    if what:
        url, run_id, k, *force = what
        learn(open_storage(url), run_id, int(k), force=bool(force))
    return {
        "seconds": time.perf_counter() - t0,
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
    }


def measured(args: list[str], env: dict[str, str] | None = None) -> tuple[dict, dict[str, float]]:
    """Run `child(args)` in a fresh process (environment + env), its tree polled: (its JSON, role -> peak
    RSS MiB)."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", *args],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    poll = TreeRSS(proc.pid)
    poll.start()
    out, _ = proc.communicate()
    poll.stop.set()
    poll.join()
    if proc.returncode:
        sys.exit(f"learner_memory child {args} failed (exit {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1]), poll.peaks()


def committed_bytes(out: Committed) -> dict[str, int]:
    """A learn's files by kind: weights (policy/ or adapter/), resume state, Parquet tables."""
    kinds = {"weights": 0, "state": 0, "parquet": 0}
    for f in out.manifest.files:
        top = f.path.split("/")[0]
        kinds["parquet" if f.path.endswith(".parquet") else "weights" if top in ("policy", "adapter") else "state"] += (
            f.size
        )
    return kinds


def learner_peaks(out: dict, tree: dict[str, float]) -> list[float]:
    """Each learner rank's peak RSS (MiB): torchrun's workers, or on 1 process the stage process itself
    (the larger of the polled peak and its own ru_maxrss)."""
    ranks = sorted((role, mib) for role, mib in tree.items() if role.startswith("rank"))
    return [mib for _, mib in ranks] or [max(tree["stage"], out["maxrss_mib"])]


def run_case(storage, run_id: str, overrides: list[str], iterations: int) -> dict:
    """A run of `iterations`; each learn measured once per allocator setting (the second a forced new
    attempt on the same inputs). Peaks: the max over iterations; bytes: the last learn's."""
    init_run(storage, run_id, load_config(None, overrides))
    peaks = {label: [] for label in MALLOC}
    launcher, seconds = 0.0, []
    for k in range(iterations):
        for s in ("snapshot", "rollouts", "rewards", "advantages"):
            stage_function(s)(storage, run_id, k)
        for i, (label, env) in enumerate(MALLOC.items()):
            out, tree = measured([storage.url, run_id, str(k)] + ["force"] * (i > 0), env)
            ranks = learner_peaks(out, tree)
            peaks[label] = [max(a, b) for a, b in zip(peaks[label], ranks)] or ranks
            launcher = max(launcher, tree["stage"] if len(ranks) > 1 else 0.0)
            seconds.append(out["seconds"])
    learn = latest_committed(storage, stage_dir(storage, run_id, iterations - 1, "learn"))
    return {"peaks": peaks, "launcher": launcher, "seconds": seconds, "bytes": committed_bytes(learn)}


def machine_line() -> str:
    """timing.machine() with the memory and the torch and python versions."""
    import torch

    mem = psutil.virtual_memory().total / 2**30
    return f"{machine()}, {mem:.0f} GiB; torch {torch.__version__}, python {platform.python_version()}"


def print_measured(results: dict, n_params: int, floor: float, dtype: str) -> None:
    print(
        f"\nmodel: {n_params / 1e6:.1f}M parameters = {4 * n_params / MiB:.0f} MiB in float32, "
        f"{2 * n_params / MiB:.0f} MiB in bf16; weights + grads + AdamW in float32 (16 B/param) = "
        f"{16 * n_params / MiB:.0f} MiB; base saved in {dtype}\n"
        f"runtime floor: a fresh process importing the learn stage (torch, transformers' Qwen2, peft, "
        f"accelerate) peaks at {floor:.0f} MiB RSS\n"
    )
    heads = [f"peak RSS per rank, MiB: {label}" for label in MALLOC] + [
        "launcher, MiB",
        "learn s",
        "weights MB",
        "resume state MB",
        "committed MB (no Parquet)",
        "B/param",
        "Parquet MB",
    ]
    print(f"| case | {' | '.join(heads)} |\n|" + " --- |" * (1 + len(heads)))
    for name, r in results.items():
        b = r["bytes"]
        total = b["weights"] + b["state"]
        cells = [" / ".join(f"{m:.0f}" for m in ranks) for ranks in r["peaks"].values()] + [
            f"{r['launcher']:.0f}" if r["launcher"] else "-",
            " ".join(f"{s:.0f}" for s in r["seconds"]),
            f"{b['weights'] / 1e6:.1f}",
            f"{b['state'] / 1e6:.1f}",
            f"{total / 1e6:.1f}",
            f"{total / n_params:.2f}",
            f"{b['parquet'] / 1e6:.3f}",
        ]
        print(f"| {name} | {' | '.join(cells)} |")


# ---------------------------------------------------------------- the arithmetic at real sizes

PUBLISHED = {  # from each model's config.json: the shape that sets its parameter count
    "Qwen2.5-0.5B": dict(
        hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, vocab=151936, tied=True, bias=True
    ),
    "Qwen2.5-7B": dict(
        hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, vocab=152064, tied=False, bias=True
    ),
    "Llama-3-70B": dict(
        hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=128256, tied=False, bias=False
    ),
}


def projections(s: dict) -> list[tuple[int, int]]:
    """(in, out) of the 7 linear layers of one decoder layer: q, k, v, o, gate, up, down."""
    h, i, kv = s["hidden"], s["intermediate"], s["kv_heads"] * s["hidden"] // s["heads"]
    return [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]


def parameters(s: dict) -> int:
    """Embedding (and an untied lm_head), the layers' linears, q/k/v biases, RMSNorm weights."""
    h, kv = s["hidden"], s["kv_heads"] * s["hidden"] // s["heads"]
    layer = sum(a * b for a, b in projections(s)) + (h + 2 * kv if s["bias"] else 0) + 2 * h
    return s["vocab"] * h * (1 if s["tied"] else 2) + s["layers"] * layer + h


def lora_parameters(s: dict, r: int = 16) -> int:
    """r * (in + out) per adapted linear (A: r x in, B: out x r), the 7 of every layer."""
    return s["layers"] * r * sum(a + b for a, b in projections(s))


def per_rank_bytes(n: int, a: int, base: int, ranks: int) -> dict[str, float]:
    """Learner state per rank (no activations, no KL reference): full fine-tuning holds float32 weights,
    grads and AdamW's two moments (16 B/param), on every rank under ddp, 1/ranks of it under fsdp2; LoRA
    holds the frozen base in its dtype (`base` B/param) and 16 B per adapter parameter."""
    return {
        "full ddp": 16 * n,
        f"full fsdp2 x{ranks}": 16 * n / ranks,
        "LoRA x1": base * n + 16 * a,
        f"LoRA fsdp2 x{ranks}": (base * n + 16 * a) / ranks,
    }


def learn_bytes(n: int, a: int, base: int) -> dict[str, float]:
    """Bytes a learn commits (no tables): full ddp the policy in the base's dtype, float32 master weights
    when that is narrower, AdamW (8 B/param); fsdp2 the policy and dcp/ (float32 weights + AdamW: 12 B);
    LoRA the float32 adapters and AdamW (12 B / adapter param), under fsdp2 the adapters and dcp/ (16 B)."""
    return {
        "full ddp": (base + (4 if base < 4 else 0) + 8) * n,
        "full fsdp2": (base + 12) * n,
        "LoRA": 12 * a,
        "LoRA fsdp2": 16 * a,
    }


def print_arithmetic(here_base: int, ranks: int = 8) -> None:
    """A Markdown table: the published shapes with bf16 bases, and this benchmark's model with its own base."""
    n, a = parameters(HERE), lora_parameters(HERE)
    heads = [*per_rank_bytes(n, a, 2, ranks), *(f"{k} / learn" for k in learn_bytes(n, a, 2))]
    print("\nper rank: learner state (no activations, no KL reference); / learn: bytes committed. GB = 1e9 bytes")
    print(f"| model | parameters | LoRA r=16 | {' | '.join(heads)} |\n|{' --- |' * (3 + len(heads))}")
    rows = [(name, s, 2) for name, s in PUBLISHED.items()] + [(f"this benchmark ({here_base} B base)", HERE, here_base)]
    for name, s, base in rows:
        n, a = parameters(s), lora_parameters(s)
        cells = [*per_rank_bytes(n, a, base, ranks).values(), *learn_bytes(n, a, base).values()]
        print(
            f"| {name} | {n / 1e9:.3g}B | {a / 1e6:.3g}M | "
            + " | ".join(f"{v / 1e9:,.1f}" if v >= 1e9 else f"{v / 1e9:.3g}" for v in cells)
            + " |"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=1, help="learns measured per case (the 2nd resumes from state)")
    p.add_argument(
        "--microbatch",
        type=int,
        default=4,
        help="samples a forward (one group): activations then stay below the 25M model's state",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the base's saved dtype (bfloat16 only where the CPU has bf16 matmuls: 50x slower on this one)",
    )
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), metavar="CASE")
    p.add_argument("--set", action="append", default=[], help="more config overrides for every case")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    p.add_argument("--child", nargs="*", default=None, help=argparse.SUPPRESS)  # [STORAGE_URL RUN_ID ITERATION]
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return
    t0 = time.perf_counter()
    root = Path(args.dir or tempfile.mkdtemp(prefix="grpo-learner-memory-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine_line()}\nfolder: {root}", flush=True)
    overrides = make_world(root, args.dtype, args.microbatch)
    n_params = parameter_count(root / "model")
    if parameters(HERE) != n_params:  # the arithmetic below counts this model as the file does
        sys.exit(f"arithmetic counts {parameters(HERE)} parameters, the saved model has {n_params}")
    imports, tree = measured([])
    floor = max(tree["stage"], imports["maxrss_mib"])
    storage = open_storage((root / "store").as_uri())
    results = {}
    for i, name in enumerate(args.cases):
        results[name] = run_case(storage, f"case-{i}", overrides + CASES[name] + args.set, args.iterations)
        print(f"  {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    print_measured(results, n_params, floor, args.dtype)
    print_arithmetic(4 if args.dtype == "float32" else 2)
    print(f"\n{time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
