"""The teacher stage's scoring on transformers and on vLLM side by side, on this machine's CPU (issue 51).

    PYTHONPATH=. GRPO_THREADS=1 .venv/bin/python benchmarks/teacher_backends.py [--responses 128] [--prompt 64]
        [--response 128] [--top-k 20]

For each of two Qwen2 teachers built from scratch (benchmarks' `build_chat_model`, a 512-token BPE vocabulary): the
same committed ids (random ids of the vocabulary: --responses responses of --response tokens after a --prompt-token
prompt, every token a loss token) scored by grpo.scoring.teacher.scorer on `hf` (a float32 forward of
teacher.batch_size = 8 left-padded responses at a time, the stage's default) and on `vllm` (the rollouts' engine, one
request a response, its prompt log-probs), each backend in a process of its own with one torch thread. Prints the
seconds to load (the model, or the engine's start), to score, the scored tokens a second, the ratio, and the largest
gap between the two backends' log-probs. The GPU side is not measured here (no GPU on this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SIZES = {  # name: build_chat_model's shape
    "small (hidden 128, 2 layers)": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                         intermediate_size=256),
    "medium (hidden 512, 8 layers)": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
                                          intermediate_size=1536),
}  # fmt: skip


def one(backend: str, folder: str, ids_file: str, top_k: int, out_file: str) -> dict:
    """Score the committed ids of `ids_file` on `backend` twice: {load_s, first_s, score_s (the second time: a warm
    engine, as a run's later iterations), tokens, params}; the log-probs to out_file."""
    import torch

    from grpo.config import load_config
    from grpo.record.checkpoint import parameter_count
    from grpo.scoring import teacher as engine

    data = json.loads(Path(ids_file).read_text())
    rollout = load_config(None, ["rollout.max_prompt_tokens=512", "rollout.max_tokens=256"]).rollout
    t0 = time.perf_counter()
    score = engine.scorer(backend, folder, torch.device("cpu"), top_k or None, rollout)
    t1 = time.perf_counter()
    times = [t1]
    for _ in range(2):
        rows, step = [], len(data["prompts"]) if backend == "vllm" else 8  # the stage's chunks (teacher.batch_size 8)
        for at in range(0, len(data["prompts"]), step):
            rows += score(*(data[k][at : at + step] for k in ("prompts", "responses", "masks")))
        times.append(time.perf_counter())
    Path(out_file).write_text(json.dumps([r["teacher_logprobs"] for r in rows]))
    tokens = sum(map(len, data["responses"]))
    first, second = times[1] - times[0], times[2] - times[1]
    return {"load_s": t1 - t0, "first_s": first, "score_s": second, "tokens": tokens, "params": parameter_count(folder)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--responses", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--one", nargs=4, metavar=("BACKEND", "FOLDER", "IDS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one[:3], args.top_k, args.one[3])))
        return
    import random

    from grpo.tiny_model import build_chat_model

    tmp = Path(tempfile.mkdtemp(prefix="teacher-backends-"))
    rng = random.Random(0)
    texts = [" ".join(str(rng.randrange(1000)) for _ in range(40)) for _ in range(400)]
    print("| teacher | params | backend | load s | first score s | score s | tokens/s | hf / this (score) | max gap |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, shape in SIZES.items():
        folder = build_chat_model(str(tmp / name.split()[0]), texts, max_position_embeddings=1024, **shape)
        vocab = json.loads(Path(folder, "config.json").read_text())["vocab_size"]
        data = {
            "prompts": [[rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(args.responses)],
            "responses": [[rng.randrange(3, vocab) for _ in range(args.response)] for _ in range(args.responses)],
        }
        data["masks"] = [[1] * len(r) for r in data["responses"]]
        ids_file = tmp / f"{name.split()[0]}-ids.json"
        ids_file.write_text(json.dumps(data))
        result, logps = {}, {}
        for backend in ("hf", "vllm"):
            out = tmp / f"{name.split()[0]}-{backend}.json"
            env = {**os.environ, "GRPO_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
            cmd = [
                sys.executable,
                __file__,
                "--top-k",
                str(args.top_k),
                "--one",
                backend,
                folder,
                str(ids_file),
                str(out),
            ]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            result[backend] = json.loads(proc.stdout.strip().splitlines()[-1])
            logps[backend] = [x for row in json.loads(out.read_text()) for x in row]
        gap = max(abs(a - b) for a, b in zip(logps["hf"], logps["vllm"]))
        for backend, r in result.items():
            ratio = result["hf"]["score_s"] / r["score_s"]
            print(
                f"| {name} | {r['params'] / 1e6:.1f}M | {backend} | {r['load_s']:.1f} | {r['first_s']:.2f} | "
                f"{r['score_s']:.2f} | {r['tokens'] / r['score_s']:.0f} | {ratio:.2f}x | {gap:.1e} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
