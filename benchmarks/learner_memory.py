"""Peak memory of each learner process and the bytes a learn commits per iteration: full fine-tuning
(ddp on 1 and 2 processes, fsdp2 on 2) and LoRA r=16 (1 process, and fsdp2 on 2), side by side in one
run; then the same accounting by arithmetic at 0.5B / 7B / 70B.

    .venv/bin/python benchmarks/learner_memory.py [--iterations 2] [--dtype bfloat16] [--set learn.kl_coef=0.01]

1. A Qwen2 chat model made on the spot (8 layers, hidden 512, 8 query and 2 key/value heads, MLP 1280,
   a byte-level BPE trained on the problems, an 8192-row embedding: 25.2M parameters), saved in --dtype
   (bf16, as Qwen2.5 ships); chat_math.py's GSM8K-style word problems rendered with the chat template;
   a reward of the response's length (random weights need a reward with spread).
2. Each case is its own run. Per iteration the stages up to advantages run in this process (transformers
   sampler: no vLLM process anywhere), then the learn stage alone in a fresh subprocess, whose process
   tree a thread polls every 20 ms: the peak RSS of each learner rank (torchrun's workers; on 1 process
   the subprocess itself, whose own ru_maxrss is printed beside it) and of the launcher (the stage
   process that starts torchrun, holding the batch but no model).
3. The bytes the learn committed, from its manifest: weights (policy/ or adapter/), resume state
   (optimizer.pt or dcp/, master.safetensors, rng.pt), and its Parquet tables apart.

RSS includes the Python/torch runtime: the first line printed is a process that only imports what the
learn stage imports (the floor every learner process pays), and the model's parameter bytes.
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
from chat_math import SYSTEM, problem

from grpo.checkpoint import parameter_count
from grpo.config import load_config
from grpo.layout import stage_dir
from grpo.storage import Committed, latest_committed, open_storage
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
SHAPE = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1280, model_vocab_size=8192)
MiB = 2**20


def make_world(root: Path, dtype: str) -> list[str]:
    """Model, problems and reward file under root; returns the runs' shared config overrides."""
    import random

    rng = random.Random(0)
    rows = list({r["question"]: r for r in (problem(rng, 99) for _ in range(2000))}.values())  # distinct
    pd.DataFrame(rows)[["question", "answer"]].to_parquet(root / "problems.parquet")
    texts = [f"{SYSTEM} {r['question']} {r['answer']}" for r in rows]
    build_chat_model(str(root / "model"), texts, vocab_size=8192, max_position_embeddings=256, dtype=dtype, **SHAPE)
    (root / "reward.py").write_text(
        "def length(response, ground_truth, prompt, **row):\n    return len(response) / 100\n"
    )
    return [
        f"model.base_model={root / 'model'}",
        "task.name=math",
        f"task.dataset={root / 'problems.parquet'}",
        "task.prompt_column=question",
        "task.answer_column=answer",
        "task.prompt_format=chat",
        f"task.system_prompt={SYSTEM}",
        f"reward.functions=[{root / 'reward.py'}:length]",
        "reward.truncated_reward=null",
        "rollout.backend=hf",
        "rollout.prompts_per_iteration=16",
        "rollout.group_size=4",
        "rollout.max_tokens=32",
        "learn.epochs=1",
        "learn.minibatch_size=32",
        "learn.microbatch_size=16",  # 16 samples a forward on every rank, 1 process or 2: the same activations
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
        rank = p.environ().get("RANK")
        return f"rank {rank}" if rank is not None else " ".join(p.cmdline()[1:3])

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                tree = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                tree = []
            for p in tree:
                try:
                    rss = p.memory_info().rss
                    self.role.setdefault(p.pid, self._role(p))
                except psutil.Error:  # exited between the listing and the read
                    continue
                self.peak[p.pid] = max(self.peak.get(p.pid, 0), rss)
            time.sleep(self.every_s)

    def peaks(self) -> dict[str, float]:
        """Role -> peak RSS in MiB."""
        return {self.role[pid]: rss / MiB for pid, rss in self.peak.items() if pid in self.role}


def child(what: list[str]) -> dict:
    """In the subprocess: the learn stage of (storage url, run id, iteration), or only its imports."""
    t0 = time.perf_counter()
    import accelerate  # noqa: F401  (what the learner imports when it starts)
    import peft  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    from stages.learn import learn

    if what:
        url, run_id, k = what
        learn(open_storage(url), run_id, int(k))
    return {
        "seconds": time.perf_counter() - t0,
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
    }


def measured(args: list[str]) -> tuple[dict, dict[str, float]]:
    """Run `child(args)` in a fresh process, its tree polled: (its JSON, role -> peak RSS MiB)."""
    proc = subprocess.Popen([sys.executable, __file__, "--child", *args], stdout=subprocess.PIPE, text=True)
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
        kind = (
            "parquet"
            if f.path.endswith(".parquet")
            else "weights"
            if f.path.split("/")[0] in ("policy", "adapter")
            else "state"
        )
        kinds[kind] += f.size
    return kinds


def run_case(storage, run_id: str, overrides: list[str], iterations: int) -> dict:
    """A run of `iterations`, the learn of each measured; the peaks are the max over iterations, the bytes the
    last iteration's."""
    init_run(storage, run_id, load_config(None, overrides))
    peaks: dict[str, float] = {}
    seconds, maxrss = [], 0.0
    for k in range(iterations):
        for s in ("snapshot", "rollouts", "rewards", "advantages"):
            stage_function(s)(storage, run_id, k)
        out, tree = measured([storage.url, run_id, str(k)])
        seconds.append(out["seconds"])
        maxrss = max(maxrss, out["maxrss_mib"])
        for role, mib in tree.items():
            peaks[role] = max(peaks.get(role, 0.0), mib)
    learn = latest_committed(storage, stage_dir(storage, run_id, iterations - 1, "learn"))
    return {"peaks": peaks, "maxrss": maxrss, "seconds": seconds, "bytes": committed_bytes(learn)}


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor() or platform.machine(),
    )
    import torch

    mem = psutil.virtual_memory().total / 2**30
    return (
        f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores, {mem:.0f} GiB; "
        f"torch {torch.__version__}, python {platform.python_version()}"
    )


def print_measured(results: dict, n_params: int, floor: float, dtype: str) -> None:
    print(
        f"\nmodel: {n_params / 1e6:.1f}M parameters = {4 * n_params / MiB:.0f} MiB in float32, "
        f"{2 * n_params / MiB:.0f} MiB in bf16; weights + grads + AdamW in float32 (16 B/param) = "
        f"{16 * n_params / MiB:.0f} MiB; base saved in {dtype}\n"
        f"runtime floor: a fresh process importing the learn stage (torch, transformers' Qwen2, peft, "
        f"accelerate) peaks at {floor:.0f} MiB RSS\n"
    )
    print(
        f"{'case':<20} {'peak RSS per rank, MiB':>22} {'- floor':>12} {'launcher':>8} {'learn s':>7} "
        f"{'weights MB':>10} {'state MB':>8} {'total MB':>8} {'B/param':>7} {'Parquet MB':>10}"
    )
    for name, r in results.items():
        ranks = sorted((role, mib) for role, mib in r["peaks"].items() if role.startswith("rank"))
        if ranks:  # torchrun's workers; the stage process launched them
            per_rank, launcher = [mib for _, mib in ranks], f"{r['peaks']['stage']:.0f}"
        else:  # one process: the stage process is the learner (its exact ru_maxrss beside the polled peak)
            per_rank, launcher = [max(r["peaks"]["stage"], r["maxrss"])], "-"
        b = r["bytes"]
        total = b["weights"] + b["state"]
        print(
            f"{name:<20} {' / '.join(f'{m:.0f}' for m in per_rank):>22} "
            f"{' / '.join(f'{m - floor:.0f}' for m in per_rank):>12} {launcher:>8} "
            f"{' '.join(f'{s:.0f}' for s in r['seconds']):>7} {b['weights'] / 1e6:>10.1f} {b['state'] / 1e6:>8.1f} "
            f"{total / 1e6:>8.1f} {total / n_params:>7.2f} {b['parquet'] / 1e6:>10.3f}"
        )


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
HERE = dict(hidden=512, intermediate=1280, layers=8, heads=8, kv_heads=2, vocab=8192, tied=True, bias=True)


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


def print_arithmetic(ranks: int = 8) -> None:
    """Bytes per rank for the learner's state (no activations, no KL reference) and bytes per learn, bf16 bases."""
    gb = lambda x: f"{x / 1e9:,.1f}" if x >= 1e8 else f"{x / 1e9:.3f}"  # noqa: E731
    print(
        f"\narithmetic (GB = 1e9 bytes; bf16 base; learner state only: no activations, no KL reference):\n"
        f"{'model':<14} {'params':>7} {'LoRA r=16':>9} | per rank: {'ddp':>7} {f'fsdp2 x{ranks}':>9} "
        f"{'LoRA x1':>7} {f'LoRA fsdp2 x{ranks}':>16} | per learn: {'full':>7} {'LoRA':>6} {'LoRA/full':>9}"
    )
    for name, s in {**PUBLISHED, "this benchmark": HERE}.items():
        n, a = parameters(s), lora_parameters(s)
        full_mem, lora_mem = 16 * n, 2 * n + 16 * a  # f32 weights+grads+AdamW; frozen bf16 base + f32 adapters
        full_io, lora_io = (2 + 4 + 8) * n, (4 + 8) * a  # bf16 policy + f32 master + AdamW; f32 adapter + AdamW
        print(
            f"{name:<14} {n / 1e9:>6.2f}B {a / 1e6:>8.1f}M | {'':>9} {gb(full_mem):>7} {gb(full_mem / ranks):>9} "
            f"{gb(lora_mem):>7} {gb(lora_mem / ranks):>16} | {'':>10} {gb(full_io):>7} {gb(lora_io):>6} "
            f"{lora_io / full_io:>9.4f}"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=2, help="learns measured per case (1+ resumes from state)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the base's saved dtype")
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
    print(f"machine: {machine()}\nfolder: {root}", flush=True)
    overrides = make_world(root, args.dtype)
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
    print_arithmetic()
    print(f"\n{time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
