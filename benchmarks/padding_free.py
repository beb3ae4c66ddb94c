"""learn.padding_free: the learner's update with each group's responses packed into shared rows against one
row per response, side by side in one run, on responses of unequal length (as on GSM8K) and of equal length.

    .venv/bin/python benchmarks/padding_free.py [--repeats 3] [--prompts 4] [--group 8] [--max-tokens 128]

The model is vs_trl.py's chat model (a Qwen2 of 26.4M parameters: 8 layers, hidden 512, grouped-query
attention, 8192-row embedding), float32. The batch is made here: `--prompts` prompts of 40-56 token ids
with `--group` responses each; response lengths (a) drawn from a log-normal around a third of --max-tokens
(sigma 0.6, clipped to [8, --max-tokens]: short and long answers in one group, as a trained model's GSM8K
answers), (b) all --max-tokens (nothing to pack: what packing costs where it cannot help). Per case, the
learner's `train` (old log-probs recomputed, one epoch of minibatches of 2 groups, microbatches of 1 group)
from the same weights, padded and packed alternately, --repeats times each; printed: the median seconds of
scoring and of the update, the ratio, the rows the packed forward used, and how far the two updates' weights
end apart.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from chat_math import SYSTEM, problem  # noqa: E402
from timing import machine  # noqa: E402


def make_batch(prompts: int, group: int, lengths: list[int], vocab: int, seed: int):
    import torch

    from grpo.learner import Batch

    gen = torch.Generator().manual_seed(seed)
    lp, t, n = 56, max(lengths), prompts * group
    prompt_ids, prompt_mask = torch.zeros(prompts, lp, dtype=torch.long), torch.zeros(prompts, lp, dtype=torch.long)
    for i in range(prompts):
        k = int(torch.randint(40, lp + 1, (1,), generator=gen))
        prompt_ids[i, lp - k :], prompt_mask[i, lp - k :] = torch.randint(10, vocab, (k,), generator=gen), 1
    response_ids, response_mask = torch.zeros(n, t, dtype=torch.long), torch.zeros(n, t)
    for i, k in enumerate(lengths):
        response_ids[i, :k], response_mask[i, :k] = torch.randint(10, vocab, (k,), generator=gen), 1
    rewards = torch.rand(n, generator=gen)
    grouped = rewards.view(prompts, group)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).flatten()
    sampler = -torch.rand(n, t, generator=gen) * response_mask
    ids = list(range(n))
    trained = response_mask  # one turn: every token sampled
    return Batch(
        prompt_ids,
        prompt_mask,
        response_ids,
        response_mask,
        trained,
        sampler,
        torch.zeros_like(response_ids),
        advantages,
        rewards,
        group,
        ids,
        ids,
    )


def run_case(model: str, batch, padding_free: bool, seed: int) -> tuple:
    """One train() from the model's weights: (score s, update s, rows of the training forwards, weights)."""
    import torch

    from grpo.config import load_config
    from grpo.learner import Learner, train

    g = batch.group_size
    cfg = load_config(
        None,
        [
            f"rollout.group_size={g}",
            f"rollout.max_tokens={batch.response_ids.shape[1]}",
            f"learn.minibatch_size={2 * g}",
            f"learn.microbatch_size={g}",
            "learn.epochs=1",
            "learn.lr=1e-5",
            "learn.mixed_precision=no",
            f"learn.padding_free={str(padding_free).lower()}",
        ],
    )
    learner = Learner(cfg, model, model, None, shuffle_seed=seed)
    rows = []
    hook = learner.model.causal.model.register_forward_pre_hook(
        lambda _, a, kw: rows.append(kw["input_ids"].shape[0]) if kw.get("past_key_values") is not None else None,
        with_kwargs=True,
    )
    update = train(learner, "bench", 0, batch, seed)
    hook.remove()
    weights = torch.cat([p.detach().flatten() for p in learner.model.parameters()])
    return update.summary["score_s"], update.summary["update_s"], sum(rows), weights


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from grpo.tiny_model import build_chat_model

    root = Path(tempfile.mkdtemp(prefix="padding-free-"))
    rng = random.Random(args.seed)
    texts = [(lambda r: f"{SYSTEM} {r['question']} {r['answer']}")(problem(rng, 99)) for _ in range(2000)]
    shape = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1376)
    model = build_chat_model(
        str(root / "model"), texts, vocab_size=2000, model_vocab_size=8192, max_position_embeddings=512, **shape
    )
    before = torch.cat([p.detach().flatten() for p in AutoModelForCausalLM.from_pretrained(model).parameters()])
    n, cap = args.prompts * args.group, args.max_tokens
    varied = [min(cap, max(8, round(rng.lognormvariate(0, 0.6) * cap / 3))) for _ in range(n)]
    print(f"machine: {machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    print(
        f"{args.prompts} prompts x {args.group} responses, up to {cap} tokens; {args.repeats} repeats each, alternating"
    )
    for name, lengths in (("unequal lengths", varied), ("all the longest", [cap] * n)):
        batch = make_batch(args.prompts, args.group, lengths, 2000, args.seed)
        times = {False: [], True: []}
        for _ in range(args.repeats):
            for padding_free in (False, True):
                score_s, update_s, rows, weights = run_case(model, batch, padding_free, args.seed)
                times[padding_free].append((score_s, update_s, rows, weights))
        (s0, u0), (s1, u1) = (
            (statistics.median(x[0] for x in times[k]), statistics.median(x[1] for x in times[k]))
            for k in (False, True)
        )
        w0, w1 = times[False][0][3], times[True][0][3]
        real = sum(lengths)
        print(
            f"== {name}: {real} response tokens, {real / (n * max(lengths)):.0%} of the padded grid "
            f"(lengths {min(lengths)}-{max(lengths)}, median {statistics.median(lengths):.0f})"
        )
        for label, k, s, u in (("padded", False, s0, u0), ("packed", True, s1, u1)):
            print(f"  {label}: score {s:.2f} s, update {u:.2f} s; response rows in all forwards: {times[k][0][2]}")
        print(
            f"  packed / padded: score {s1 / s0:.2f}x, update {u1 / u0:.2f}x, both {(s1 + u1) / (s0 + u0):.2f}x; "
            f"weights after the two updates: max |packed - padded| {(w1 - w0).abs().max():.1e}, "
            f"max |padded - before| {(w0 - before).abs().max():.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
