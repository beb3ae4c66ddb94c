"""Where `grpo sft`'s time goes, beside a plain transformers loop over the same minibatches (issue 51).

    PYTHONPATH=. GRPO_THREADS=1 .venv/bin/python benchmarks/sft_speed.py [--steps 20] [--examples 1280] [--profile]

In one process, on benchmarks/judge.py's tiny judge model (Qwen2, hidden 128, 4 layers, built from scratch) and its
warm-start conversations (64 a step, lr 1e-2):
(a) the stage: `grpo init` then `grpo sft`, wall time (a1); and the learner call it makes, on the same Batch the stage
    builds: new_learner (a2, once) and grpo.learner.loop.train (a3; --profile: cProfile's top functions of it);
(b) a plain loop: AutoModelForCausalLM over each conversation's prompt + response right-padded, cross-entropy of the
    assistant tokens (the loss mask), grad-norm clip, fused AdamW, the same minibatches in the same order.
Prints seconds per step of each and the ratio of the learner's train (a3) and of the stage (a1) to the plain loop (b).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def plain_loop(base: str, minibatches: list[list[tuple[list[int], list[int], list[int]]]], cfg) -> list[float]:
    """Cross-entropy + AdamW with transformers alone; the losses, one per step."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    model.train()
    lcfg = cfg.learn
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.sft.lr, betas=lcfg.betas, weight_decay=lcfg.weight_decay, fused=True
    )
    losses = []
    for rows in minibatches:
        width = max(len(p) + len(r) for p, r, _ in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        attend = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, (p, r, m) in enumerate(rows):
            seq = list(p) + list(r)
            ids[i, : len(seq)], attend[i, : len(seq)] = torch.tensor(seq), 1
            lab = [-100] * len(p) + [t if k else -100 for t, k in zip(r, m)]
            labels[i, : len(seq)] = torch.tensor(lab)
        logits = model(input_ids=ids, attention_mask=attend).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), lcfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="warm-start steps of 64 conversations")
    ap.add_argument("--examples", type=int, default=1280, help="conversations (judge.py's)")
    ap.add_argument("--profile", action="store_true", help="cProfile the learner's train (a3)")
    args = ap.parse_args()

    import torch
    from judge import conversations, examples, grpo

    from grpo.learner.loop import train as learner_train
    from grpo.learner.rank import new_learner
    from grpo.learner.sft import WARM_START_ITERATION, conversation_batch, conversation_order, sft_run_config
    from grpo.record.checkpoint import local_checkpoint, tokenizer_and_config
    from grpo.record.layout import Salt, iteration_seed, stage_dir
    from grpo.record.lineage import committed_input
    from grpo.record.storage import latest_committed, open_storage
    from grpo.tiny_model import build_chat_model
    from stages.common import load_run
    from stages.sft import episode_tokens
    from stages.sft_sources import source

    out = Path(tempfile.mkdtemp(prefix="sft-speed-"))
    storage = open_storage((out / "storage").as_uri())
    data = conversations(examples(args.examples, 2, seed=0))
    import json

    with open(out / "sft.jsonl", "w") as f:
        f.writelines(json.dumps(c) + "\n" for c in data)
    base = build_chat_model(
        str(out / "base"), [m["content"] for c in data[:500] for m in c["messages"]], hidden_size=128, num_layers=4,
        num_heads=4, num_kv_heads=2, intermediate_size=512, max_position_embeddings=256, split_digits=True,
    )  # fmt: skip
    grpo(
        storage.url, "init", "--run", "speed", "--set", f"model.base_model={base}", "--set", "task.name=sort",
        "--set", f"sft.dataset={out / 'sft.jsonl'}", "--set", f"sft.steps={args.steps}", "--set", "sft.lr=1e-2",
        "--set", "sft.minibatch_size=64", "--set", "sft.microbatch_size=64", "--set", "rollout.backend=hf",
    )  # fmt: skip
    print(f"torch threads {torch.get_num_threads()}, {args.steps} steps of 64 conversations")

    t = time.perf_counter()
    grpo(storage.url, "sft", "--run", "speed")
    a1 = time.perf_counter() - t
    committed = latest_committed(storage, stage_dir(storage, "speed", None, "sft"))
    stage_update_s = committed.manifest.summary.get("update_s")

    # the same Batch the stage built, then the learner call alone
    cfg = load_run(storage, "speed")
    base_in = committed_input(storage, "speed", None, "base")
    _, _, load = source(storage, cfg, "speed", base_in)
    rows = load()
    tokenizer, model_config = tokenizer_and_config(base_in)
    from grpo.episodes.chat import with_thinking
    from grpo.sampling.base import stop_token_ids

    base_dir = local_checkpoint(base_in)
    tokenizer = with_thinking(tokenizer, cfg.task.enable_thinking)
    ends = [tokenizer.decode([i], skip_special_tokens=False) for i in stop_token_ids(tokenizer, base_dir)]
    tokens = [c.tokens or episode_tokens(tokenizer, c, ends) for c in rows]
    order = conversation_order(len(rows), cfg.sft.steps, cfg.sft.epochs, 64, iteration_seed(cfg.seed, -1, Salt.PROMPTS))
    batch = conversation_batch([tokens[i] for i in order], model_config.pad_token_id or 0)
    print(f"batch: prompts {tuple(batch.prompt_ids.shape)}, responses {tuple(batch.response_ids.shape)}")
    scfg = sft_run_config(cfg)
    t = time.perf_counter()
    learner = new_learner(scfg, WARM_START_ITERATION, base_dir, base_dir, None, None)
    a2 = time.perf_counter() - t
    prof = cProfile.Profile() if args.profile else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    update = learner_train(learner, "speed", WARM_START_ITERATION, batch, 0)
    if prof:
        prof.disable()
    a3 = time.perf_counter() - t
    del learner

    # (c) the same learner on RL-shaped minibatches as benchmarks/judge.py's judged run learns them: 16 groups of 8
    # samples a step (learn.minibatch_size=128), a sort prompt of 8 tokens shared by the group, responses of 2
    import dataclasses

    rl_rows = [(tokens[i // 8][0][-8:], tokens[i // 8][1][:2], [1, 1]) for i in range(128 * args.steps)]
    rl = conversation_batch(rl_rows, model_config.pad_token_id or 0)
    rl = dataclasses.replace(
        rl, prompt_ids=rl.prompt_ids[::8], prompt_mask=rl.prompt_mask[::8], group_size=8,
        prompt_id=[i // 8 for i in range(len(rl_rows))], sample_index=[i % 8 for i in range(len(rl_rows))],
    )  # fmt: skip
    rcfg = dataclasses.replace(scfg, learn=dataclasses.replace(scfg.learn, minibatch_size=128, microbatch_size=128))
    learner = new_learner(rcfg, WARM_START_ITERATION, base_dir, base_dir, None, None)
    t = time.perf_counter()
    learner_train(learner, "speed", WARM_START_ITERATION, rl, 0)
    c = time.perf_counter() - t
    del learner

    mbs = [[tokens[i] for i in order[s : s + 64]] for s in range(0, len(order), 64)]
    t = time.perf_counter()
    plain = plain_loop(base_dir, mbs, cfg)
    b = time.perf_counter() - t

    n = args.steps
    ours = [r["loss"] for r in update.rows]
    print(f"(a1) grpo sft stage, wall:          {a1:7.2f} s  {a1 / n:.3f} s/step (its update_s {stage_update_s:.2f} s)")
    print(f"(a2) new_learner (once):            {a2:7.2f} s")
    print(f"(a3) learner train:                 {a3:7.2f} s  {a3 / n:.3f} s/step "
          f"(score_s {update.summary['score_s']:.2f}, update_s {update.summary['update_s']:.2f})")  # fmt: skip
    print(f"(b)  plain transformers CE + AdamW: {b:7.2f} s  {b / n:.3f} s/step")
    sft_tok = int(batch.prompt_mask.sum() + batch.response_mask.sum()) / n
    rl_tok = int(rl.prompt_mask.sum() + rl.response_mask.sum()) / n
    print(f"(c)  learner train, RL-shaped steps of 128 (judge.py's): {c:7.2f} s  {c / n:.3f} s/step")
    print(f"per sequence: sft {a3 / n / 64 * 1e3:.2f} ms, RL-shaped {c / n / 128 * 1e3:.2f} ms; tokens a step (prompts "
          f"once a group + responses): sft {sft_tok:.0f}, RL-shaped {rl_tok:.0f}; per 1000 tokens: sft "
          f"{a3 / n / sft_tok * 1e3:.3f} s, RL-shaped {c / n / rl_tok * 1e3:.3f} s")  # fmt: skip
    print(f"ratio learner train / plain: {a3 / b:.2f}; stage / plain: {a1 / b:.2f}")
    print(f"first/last loss: learner {ours[0]:.4f} / {ours[-1]:.4f}, plain {plain[0]:.4f} / {plain[-1]:.4f}")
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
        print(s.getvalue())
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
        print(s.getvalue())


if __name__ == "__main__":
    main()
