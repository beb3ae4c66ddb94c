"""Where the learn stage's time goes: one warm learn under torch.profiler, split into its phases.

    .venv/bin/python benchmarks/learner_profile.py                  # chat25m: learner_memory.py's 25.2M Qwen2
    .venv/bin/python benchmarks/learner_profile.py --size tiny      # the toy model, seconds (tests run it)
    .venv/bin/python benchmarks/learner_profile.py --set learn.microbatch_tokens=2048 --set learn.kl_coef=0.01

Iteration 0 runs every stage (its learn builds the learner, which stays warm, as in `grpo run`); iteration 1's
learn is profiled. Each phase is a function wrapped here (nothing in the library changes), timed by the wall
clock (the GPU synchronized at each boundary) and named in the profile (torch.profiler.record_function):
pi_old's scoring pass (old log-probs: learn.old_logprobs's pass, or `auto`'s settling one), the reference's
forward (a KL penalty), the policy's forward and backward (the microbatches; the first minibatch's forward also
gives its pi_old), the gradient clip, AdamW's step, the weights check, data movement (the batch to the device,
the warm learner off and back), reading the batch, saving the checkpoint, and the rest of the stage (the commit:
Parquet tables, manifest, hashes). Prints the split (seconds and shares of the stage), the ops that took
the most time, and how many host syncs (aten::item / _local_scalar_dense) the learn made. `profile_learn` is
what benchmarks/gpu_check.py calls on its own run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TINY = [
    "rollout.backend=hf",
    "rollout.prompts_per_iteration=8",
    "rollout.group_size=4",
    "rollout.max_tokens=16",
    "learn.minibatch_size=16",
    "learn.microbatch_size=8",
    "learn.epochs=1",
    "eval.n_prompts=8",
    "model.hidden_size=64",
    "model.num_heads=2",
    "model.intermediate_size=128",
    "reward.workers=1",
]
PHASES = [  # (label, where) in the order the learn stage meets them
    ("read batch", "stages.learn:read_batch"),
    ("data movement", "grpo.learner.batch:Batch.to"),
    ("data movement", "grpo.learner.state:Learner.to"),
    ("old log-probs", "grpo.learner.pi_old:OLD_LOGPROBS"),
    ("old log-probs", "grpo.learner.loop:settle_deferred"),
    ("reference forward", "grpo.learner.state:Learner.reference_scores"),
    ("policy forward/backward", "grpo.learner.loop:minibatch_step"),
    ("grad clip", "grpo.learner.state:Learner.clip_grad_norm"),
    ("AdamW", "torch.optim:AdamW.step"),
    ("weights check", "grpo.learner.loop:_check_weights"),
    ("save checkpoint", "grpo.learner.state:Learner.save"),
]


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(label: str, fn, seconds: dict):
    import torch

    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(f"## {label}"):
            _sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync()
                seconds[label] += time.perf_counter() - t0

    return wrapped


@contextlib.contextmanager
def phases_timed(seconds: dict):
    """Wrap every PHASES function (restored on exit); seconds[label] accumulates each one's wall time."""
    import importlib

    undo = []
    for label, where in PHASES:
        module, name = where.split(":")
        owner = importlib.import_module(module)
        *path, attr = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        if attr == "OLD_LOGPROBS":  # a registry: wrap every entry
            table = getattr(owner, attr)
            old = dict(table)
            table.update({k: _timed(label, f, seconds) for k, f in old.items()})
            undo.append(lambda table=table, old=old: table.update(old))
            continue
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        setattr(owner, attr, _timed(label, original, seconds))
        undo.append(lambda owner=owner, attr=attr, original=original: setattr(owner, attr, original))
    try:
        yield
    finally:
        for restore in reversed(undo):
            restore()


def profile_learn(storage, run_id: str, iteration: int, trace: str | None = None) -> dict:
    """Run the learn stage of `iteration` (its inputs committed) under torch.profiler with its phases timed;
    print the split and the profile's top ops. Returns {phase: seconds, "stage": seconds, "host syncs": n}."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from stages import stage_function

    seconds: dict = defaultdict(float)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with phases_timed(seconds), profile(activities=activities) as prof:
        t0 = time.perf_counter()
        stage_function("learn")(storage, run_id, iteration, force=True)
        _sync()
        stage = time.perf_counter() - t0
    events = prof.key_averages()
    syncs = sum(e.count for e in events if e.key in ("aten::item", "aten::_local_scalar_dense"))
    split = dict(seconds)
    split["rest of the stage (commit: tables, manifest, hashes)"] = stage - sum(seconds.values())
    print(f"\nlearn {iteration}: {stage:.2f} s under the profiler")
    print(f"{'phase':<54} {'s':>8} {'share':>7}")
    for label, s in split.items():
        print(f"{label:<54} {s:>8.2f} {s / stage:>7.1%}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"\ntop ops by self {device} time ({syncs} host syncs: aten::item / _local_scalar_dense)")
    print(events.table(sort_by=f"self_{device}_time_total", row_limit=12, max_name_column_width=40))
    if trace:
        prof.export_chrome_trace(trace)
    return {**split, "stage": stage, "host syncs": syncs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=["chat25m", "tiny"], default="chat25m")
    parser.add_argument("--set", action="append", default=[], help="a config override (repeatable)")
    parser.add_argument("--trace", help="write the profile as a Chrome trace here")
    args = parser.parse_args()
    import torch

    from grpo.config import load_config
    from grpo.record.storage import open_storage
    from stages import stage_function
    from stages.init import init_run

    root = Path(tempfile.mkdtemp(prefix="learner_profile-"))
    if args.size == "chat25m":
        from learner_memory import make_world

        overrides = make_world(root, "float32", microbatch=16) + ["rollout.prompts_per_iteration=8"]
    else:
        overrides = list(TINY)
    overrides += args.set
    storage = open_storage((root / "store").as_uri())
    init_run(storage, "p", load_config(None, overrides))
    print(f"{args.size}: {' '.join(args.set) or 'as the recipe'}; torch threads {torch.get_num_threads()}")
    for k in (0, 1):
        for s in ("snapshot", "rollouts", "rewards", "advantages") + (("learn",) if k == 0 else ()):
            stage_function(s)(storage, "p", k)
    profile_learn(storage, "p", 1, args.trace)


if __name__ == "__main__":
    main()
