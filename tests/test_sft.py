"""The warm start (`grpo sft`, stages/sft.py): its loss is the cross-entropy of the assistant tokens (a pure test),
a conversation's ids and loss mask are the episodes' (grpo.episodes.transcripts), TRL's dataset shapes are read and a
wrong one refused in one line, an unset `sft` changes nothing, and end to end on a tiny chat model: the snapshot of
iteration 0 refuses without it, `grpo sft` commits it (the `sft` and `sft_metrics` views), iteration 0 samples it and
measures its KL against it, and the gate stops GRPO in one line giving the figure."""

from __future__ import annotations

import hashlib
import json
import random
import types
from pathlib import Path

import pandas as pd
import pytest
import tool_world
import torch
from once import copy_of

from grpo import core, data
from grpo.config import ConfigError, load_config
from grpo.errors import DatasetError, StageError
from grpo.learner.loss import loss_spec
from grpo.learner.sft import conversation_batch, conversation_order, sft_run_config
from grpo.record.layout import Salt, iteration_seed
from tests.test_readme_tools import folder  # noqa: F401 (the docs' user folder: my.yaml on the tiny chat model)


def sft_spec() -> core.LossSpec:
    """The loss the warm start's learner computes, made as the stage makes it (grpo.learner.sft)."""
    return loss_spec(sft_run_config(load_config(None, ["sft.dataset=x.jsonl", "learn.kl_coef=0.1"])))


def test_the_warm_start_loss_is_the_cross_entropy_of_the_assistant_tokens_and_so_is_its_gradient():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, requires_grad=True)  # (B, T, V)
    labels = torch.randint(0, 11, (3, 7))
    mask = (torch.rand(3, 7) < 0.6).float()  # 1: an assistant token; 0: system, user, tool and padding
    mask[0, 0] = 1.0
    logp = core.token_logprobs(logits, labels)  # (B, T)
    loss, _ = core.grpo_microbatch_step(
        sft_spec(),
        logp,
        mask,
        gradient_accumulation_steps=1,
        raw_rewards=torch.ones(3, 1),
        advantages=torch.ones(3, 1),
        old_logprobs=logp.detach() - 5.0,  # pi_old and the sampler: never read by this loss
        sampler_logprobs=torch.zeros(3, 7),
        token_normalizer=float(mask.sum()),
    )
    ours = logits.grad.clone()
    logits.grad = None
    keep = mask.bool()
    ce = torch.nn.functional.cross_entropy(logits[keep], labels[keep])  # mean over the assistant tokens
    ce.backward()
    assert loss.item() == pytest.approx(ce.item(), rel=1e-6)
    torch.testing.assert_close(ours, logits.grad, rtol=1e-5, atol=1e-7)
    spec = sft_spec()
    assert (spec.kl_coef, spec.behavior_correction, spec.agg_mode) == (0.0, "none", "token_mean")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The tool world's tiny chat model without its own warm start, and its transcripts as a messages dataset."""
    root = tmp_path_factory.mktemp("sft-world")
    copy_of("tool-world-64-2-0", lambda into: tool_world.build(into, 64, 2, 0), root)
    rng, schema = random.Random(0), tool_world.multiply_schema()
    pairs = json.loads((root / "world.json").read_text())["pairs"]
    rows = [{"messages": tool_world.transcript(a, b, rng), "tools": [schema]} for a, b in pairs[:48]]
    pd.DataFrame(rows).to_json(root / "conversations.jsonl", orient="records", lines=True)
    return root


def test_the_warm_start_learner_makes_no_scoring_pass_and_its_first_step_loss_is_plain_cross_entropy(
    world, monkeypatch
):
    """benchmarks/sft_speed.py: the warm start costs what a plain cross-entropy loop does because its learner scores
    nothing before its steps (no pi_old pass, no reference), whatever the run's learn section asks."""
    from transformers import AutoModelForCausalLM

    from grpo.learner import loop, pi_old, state
    from grpo.learner.rank import new_learner

    def no_pass(*args, **kwargs):
        raise AssertionError("the warm start ran a no-grad scoring pass")

    monkeypatch.setattr(pi_old, "score", no_pass)
    monkeypatch.setattr(state, "score", no_pass)
    sets = ["sft.dataset=x.jsonl", "sft.minibatch_size=4", "sft.microbatch_size=2", "learn.device=cpu"]
    cfg = sft_run_config(load_config(None, [*sets, "learn.kl_coef=0.1", "learn.old_logprobs=recompute"]))
    model = str(world / "model")
    vocab = AutoModelForCausalLM.from_pretrained(model).config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = []
    for n_prompt, n_response in [(3, 5), (6, 2), (2, 7), (4, 4), (5, 3), (3, 6), (2, 2), (4, 5)]:
        ids = torch.randint(1, vocab, (n_prompt + n_response,), generator=g).tolist()
        mask = (torch.rand(n_response, generator=g) < 0.7).long().tolist()
        mask[0] = 1
        rows.append((ids[:n_prompt], ids[n_prompt:], mask))
    learner = new_learner(cfg, -1, model, model, None, None)
    assert learner.ref is None
    update = loop.train(learner, "r", -1, conversation_batch(rows, 0), 0)
    assert update.summary["steps"] == 2 and update.summary["old_logprobs"] == {"source": "sampler"}
    plain = AutoModelForCausalLM.from_pretrained(model)  # the base, as the first step saw it
    total, tokens = 0.0, 0
    with torch.no_grad():
        for p, r, m in rows[:4]:
            logits = plain(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1]
            ce = torch.nn.functional.cross_entropy(logits, torch.tensor(r), reduction="none")
            total, tokens = total + float((ce * torch.tensor(m)).sum()), tokens + sum(m)
    assert update.rows[0]["loss"] == pytest.approx(total / tokens, rel=1e-5)


def test_a_conversation_is_tokenized_as_an_episode_with_the_assistant_turns_trained(world):
    from transformers import AutoTokenizer

    from grpo.episodes.transcripts import conversation_episode

    tok = AutoTokenizer.from_pretrained(world / "model")
    schema = tool_world.multiply_schema()
    messages = tool_world.transcript(7, 8, random.Random(3))
    e = conversation_episode(tok, messages, [schema], ["<|im_end|>"])
    whole = tok.apply_chat_template(messages, tools=[schema], tokenize=False)
    assert tok.decode(e.prompt_ids + e.response_ids) == whole.rstrip("\n")  # every token, in order
    trained = [i for i, m in zip(e.response_ids, e.loss_mask) if m]
    said = [m for m in messages if m["role"] == "assistant"]
    turns = [tok.apply_chat_template([m], tools=None, tokenize=False) for m in said]  # how the template writes each
    assert tok.decode(trained).count("<|im_end|>") == len(said)
    assert "tool_response" not in tok.decode(trained) and "The answer is 56." in tok.decode(trained)
    assert all(t.split("assistant\n", 1)[1].split("<|im_end|>")[0] in tok.decode(trained) for t in turns)
    assert e.loss_mask[0] == 1 and e.loss_mask[-1] == 1 and 0 in e.loss_mask  # the tool's answer is context only
    with pytest.raises(DatasetError, match="row 3: no assistant message"):
        conversation_episode(tok, messages[:1], [schema], ["<|im_end|>"], "row 3")
    batch = conversation_batch([(e.prompt_ids, e.response_ids, e.loss_mask)] * 2, 0)
    assert batch.loss_mask.sum() == 2 * sum(e.loss_mask) and batch.group_size == 1


def test_trl_dataset_shapes_are_read_and_a_wrong_one_is_refused_naming_the_column(tmp_path):
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    pd.DataFrame({"messages": [chat]}).to_parquet(tmp_path / "m.parquet")
    pd.DataFrame({"prompt": [chat[:1]], "completion": [chat[1:]]}).to_json(tmp_path / "pc.jsonl", orient="records",
                                                                           lines=True)  # fmt: skip
    assert data.load_conversations(str(tmp_path / "m.parquet"))[0][0] == chat
    assert data.load_conversations(str(tmp_path / "pc.jsonl"))[0] == (chat, [])
    pd.DataFrame({"prompt": ["2+2?"], "completion": ["4"]}).to_json(tmp_path / "t.jsonl", orient="records", lines=True)
    with pytest.raises(DatasetError, match=r"row 0's column prompt holds text \(TRL's standard shape\)"):
        data.load_conversations(str(tmp_path / "t.jsonl"))
    pd.DataFrame({"text": ["x"]}).to_json(tmp_path / "x.jsonl", orient="records", lines=True)
    with pytest.raises(DatasetError, match=r"no `messages` column.*its columns: \['text'\]"):
        data.load_conversations(str(tmp_path / "x.jsonl"))
    pd.DataFrame({"messages": [[{"role": "robot", "content": "x"}]]}).to_json(tmp_path / "r.jsonl", orient="records",
                                                                              lines=True)  # fmt: skip
    with pytest.raises(DatasetError, match="row 0's column messages: a message's role must be one of"):
        data.load_conversations(str(tmp_path / "r.jsonl"))


def test_an_unset_warm_start_leaves_the_config_as_it_was_and_a_bad_one_names_its_field():
    assert "sft" not in load_config().to_dict()  # run.json, and every identity, as before
    with pytest.raises(ConfigError, match=r"sft\.dataset: sft\.source=dataset reads it"):
        load_config(None, ["sft.lr=1e-4"])
    with pytest.raises(ConfigError, match=r"sft\.minibatch_size \(6\) must be divisible by sft\.microbatch_size"):
        load_config(None, ["sft.dataset=x.jsonl", "sft.minibatch_size=6", "sft.microbatch_size=4"])
    with pytest.raises(ConfigError, match=r"sft\.gate_pass_at_k must be in \[0, 1\]"):
        load_config(None, ["sft.dataset=x.jsonl", "sft.gate_pass_at_k=2"])


def test_the_gate_lets_grpo_start_only_at_or_above_its_figure():
    from stages.sft import gate_problem

    cfg = load_config(None, ["sft.dataset=x.jsonl", "sft.gate_pass_at_k=0.5", "sft.gate_k=4"])
    made = lambda figure: types.SimpleNamespace(uri="sft/attempt-1", manifest=types.SimpleNamespace(  # noqa: E731
        summary={"pass@4": figure}))  # fmt: skip
    assert gate_problem(cfg, made(0.5)) is None and gate_problem(cfg, made(0.75)) is None
    assert "held-out pass@4 0.25 is below sft.gate_pass_at_k=0.5; GRPO not started" in gate_problem(cfg, made(0.25))
    assert gate_problem(load_config(None, ["sft.dataset=x.jsonl"]), made(0.0)) is None  # no gate


def test_grpo_sft_warm_starts_iteration_0_from_a_messages_dataset(world, tmp_path, capsys):
    from flows.cli import main
    from grpo.query import query
    from grpo.record.layout import stage_dir
    from grpo.record.storage import latest_committed, open_storage
    from stages.iteration import run_warm
    from stages.snapshot import snapshot

    storage_url = str(tmp_path / "storage")
    sets = [f"--set={s}" for s in tool_world.config(world, "rollout.max_tokens=40", "rollout.max_turns=2")]
    sets += [f"--set=sft.dataset={world / 'conversations.jsonl'}", "--set=sft.lr=3e-3", "--set=sft.steps=12"]
    assert main(["--storage", storage_url, "init", "--run", "w", *sets]) == 0
    storage = open_storage(storage_url)
    with pytest.raises(StageError, match=r"none is committed; run `grpo sft --run w` first"):
        snapshot(storage, "w", 0)  # which policy samples is fixed by the config: never the base here
    capsys.readouterr()
    assert main(["--storage", storage_url, "status", "--run", "w"]) == 0
    assert "warm start (sft): missing; iteration 0 samples it: `grpo sft --run w`" in capsys.readouterr().out
    assert main(["--storage", storage_url, "sft", "--run", "w"]) == 0
    assert "sft: committed" in capsys.readouterr().out
    rows = query(storage, "w", "SELECT count(*) AS n, sum(draws) AS d, min(len(loss_mask)) AS t FROM sft").iloc[0]
    assert (rows.n, rows.d) == (48, 12 * 8) and rows.t > 0
    steps = query(storage, "w", "SELECT loss, n_tokens FROM sft_metrics ORDER BY step")
    assert len(steps) == 12 and steps.loss.iloc[-1] < steps.loss.iloc[0]
    assert main(["--storage", storage_url, "status", "--run", "w"]) == 0
    said = f"warm start (sft): ok x1, 12 steps on 48 conversations (dataset), last loss {steps.loss.iloc[-1]:.4g}"
    assert said in capsys.readouterr().out
    made = latest_committed(storage, stage_dir(storage, "w", None, "sft"))
    weights = [f for f in made.manifest.files if f.path.startswith("policy/") and f.path.endswith(".safetensors")]

    def exported_warm_start(*how: str) -> bool:  # the warm start's own weights, not the base's, and its card
        into = tmp_path / f"warm{len(how)}"
        assert main(["--storage", storage_url, "export", "--run", "w", *how, str(into)]) == 0
        assert "the warm start (grpo sft) of run w" in capsys.readouterr().out
        digests = [hashlib.sha256((into / f.path.removeprefix("policy/")).read_bytes()).hexdigest() for f in weights]
        return digests == [f.sha256 for f in weights] and "# w, warm start" in (into / "README.md").read_text()

    assert weights and exported_warm_start()  # before any learn: the newest policy is the warm start
    # each step trains the minibatch conversation_order drew (epoch by epoch, none twice in a pass), not a reshuffle
    cfg = load_config(None, [s.removeprefix("--set=") for s in sets])
    order = conversation_order(48, 12, 1, 8, iteration_seed(cfg.seed, -1, Salt.PROMPTS))
    masks = query(storage, "w", "SELECT loss_mask FROM sft ORDER BY conversation")["loss_mask"].map(sum).tolist()
    assert steps.n_tokens.tolist() == [sum(masks[i] for i in order[k : k + 8]) for k in range(0, 96, 8)]
    [(k, out)] = list(run_warm(storage, "w", 0, 1))
    snap, learn = out["snapshot"].manifest, out["learn"].manifest
    assert "/w/sft/attempt-" in snap.inputs["policy"].uri and snap.summary["policy_version"] == -1
    assert "/w/sft/attempt-" in learn.inputs["reference"].uri  # the SFT model is the KL reference (full fine-tuning)
    assert exported_warm_start("--sft")  # asked for, after a learn
    assert main(["--storage", storage_url, "sft", "--run", "w"]) == 0  # committed: nothing to do
    assert "already committed" in capsys.readouterr().out
    # the history source: the rows a query selects from run w's iteration 0, their ids and mask as sampled
    picked = "SELECT iteration, prompt_id, sample_index FROM rollouts WHERE sample_index < 2"
    history = [*sets[:-3], "--set=sft.source=history", "--set=sft.history_run=w", f"--set=sft.history_sql={picked}"]
    assert main(["--storage", storage_url, "init", "--run", "h", *history, "--set=sft.steps=1"]) == 0
    assert main(["--storage", storage_url, "sft", "--run", "h"]) == 0
    sampled = query(storage, "w", "SELECT prompt_ids, response_ids, loss_mask FROM rollouts WHERE sample_index < 2 "
                    "ORDER BY prompt_id, sample_index")  # fmt: skip
    trained = query(storage, "h", "SELECT prompt_ids, response_ids, loss_mask FROM sft ORDER BY conversation")
    assert [list(map(list, r)) for r in sampled.itertuples(index=False)] == [
        list(map(list, r)) for r in trained.itertuples(index=False)
    ]
    made = latest_committed(storage, stage_dir(storage, "h", None, "sft")).manifest
    assert "history-0" in made.inputs and made.config["read"]["sql"] == picked  # what it read, pinned
    # the teacher source: the model's own episodes on the run's prompts (a teacher of the same tokenizer)
    teacher = ["--set=sft.source=teacher", f"--set=sft.teacher={world / 'model'}", "--set=sft.prompts=2"]
    assert main(["--storage", storage_url, "init", "--run", "t", *sets[:-3], *teacher, "--set=sft.steps=1"]) == 0
    assert main(["--storage", storage_url, "sft", "--run", "t"]) == 0
    rows = query(storage, "t", "SELECT source, origin, loss_mask FROM sft")
    assert len(rows) == 2 and set(rows.source) == {"teacher"} and all(1 in m for m in rows.loss_mask)


def test_the_gate_stops_grpo_in_one_line_giving_the_figure(world, tmp_path, capsys):
    """One turn an episode (rollout.max_turns=1): no tool answer ever comes, so `tool_turns`, the component that
    counts as correct here, is 0 for every sample: pass@2 is 0, whatever the model samples."""
    from flows.cli import main

    storage = str(tmp_path / "storage")
    rewards = world / "rewards.py"
    extra = ["rollout.max_tokens=30", "rollout.max_turns=1"]
    extra += [f"reward.functions=[{rewards}:tool_turns,{rewards}:answered]"]
    sets = [f"--set={s}" for s in tool_world.config(world, *extra, "eval.correct=tool_turns")]
    sets += [f"--set=sft.dataset={world / 'conversations.jsonl'}", "--set=sft.steps=2", "--set=sft.gate_k=2"]
    assert main(["--storage", storage, "init", "--run", "g", *sets, "--set=sft.gate_pass_at_k=0.5"]) == 0
    assert main(["--storage", storage, "run", "--run", "g", "--iterations", "1"]) != 0
    err = capsys.readouterr().err
    assert "held-out pass@2 0 is below sft.gate_pass_at_k=0.5; GRPO not started" in err and "iteration" not in err
    assert main(["--storage", storage, "status", "--run", "g"]) == 0
    assert "held-out pass@2 0 < gate 0.5 (GRPO does not start)" in capsys.readouterr().out
    assert not (tmp_path / "storage/runs/g/iter-0000").exists()  # nothing of GRPO ran
    from flows.tasks import warm_start  # the flow's task: the same line, its Failed state's, before iteration 0

    state = warm_start.fn(storage, "g")
    assert state.is_failed() and "held-out pass@2 0 is below sft.gate_pass_at_k=0.5" in state.message


@pytest.mark.slow
def test_the_docs_warm_start_commands_run_as_written(folder):  # noqa: F811 (test_readme_tools.py's fixture)
    """teachers-and-judges.md's `grpo sft` commands, walked as test_readme_tools.py walks tools.md's: my.yaml on the
    tiny chat model, conversations.jsonl as the page describes it (a `messages` column), one iteration for twenty."""
    import re

    from tests.doc_pages import page
    from tests.test_readme import commands
    from tests.test_readme_tools import walk

    here, root = folder
    pd.read_parquet(root / "questions.parquet").to_parquet(here / "train.parquet")  # question, answer
    pairs = json.loads((root / "world.json").read_text())["pairs"]
    said = [[{"role": "user", "content": tool_world.question(a, b)}, {"role": "assistant", "content": f"{a * b}"}]
            for a, b in pairs]  # fmt: skip
    pd.DataFrame({"messages": said}).to_json(here / "conversations.jsonl", orient="records", lines=True)
    lines = [line for line in commands(page("teachers-and-judges.md")) if re.search(r"--run warm2?\b", line)]
    assert len(lines) == 6, lines
    walk(lines, here)
    from grpo.query import query
    from grpo.record.storage import open_storage

    storage = open_storage(str(here / "storage"))
    assert query(storage, "warm", "SELECT count(*) AS n FROM sft").n[0] == len(pairs)
    picked = query(storage, "warm2", "SELECT count(*) AS n, min(source) AS s FROM sft")
    assert picked.n[0] == 4 and picked.s[0] == "history"  # the best of each of iteration 0's 4 prompts


@pytest.mark.equivalence
@pytest.mark.precision_pinned
def test_two_learner_processes_commit_the_warm_start_of_one(world, tmp_path):
    """`grpo sft` with learn.num_processes=2 (torchrun, gloo, CPU) trains each step on the minibatch one process
    does, its conversations split over the ranks: the same per-step loss to rel 1e-4 and the same update to a
    relative error of 1e-3 (Adam's m / sqrt(v) blows float noise up on near-zero gradients, as in
    tests/test_stages.py's two-process test)."""
    from safetensors.torch import load_file

    from flows.cli import main
    from grpo.query import query
    from grpo.record.layout import stage_dir
    from grpo.record.storage import latest_committed, open_storage

    url = str(tmp_path / "storage")
    sets = [f"--set={s}" for s in tool_world.config(world, "learn.mixed_precision=no")]
    sets += [f"--set=sft.dataset={world / 'conversations.jsonl'}", "--set=sft.lr=3e-3", "--set=sft.steps=3"]
    for run, n in (("one", 1), ("two", 2)):
        assert main(["--storage", url, "init", "--run", run, *sets, f"--set=learn.num_processes={n}"]) == 0
        assert main(["--storage", url, "sft", "--run", run]) == 0
    storage = open_storage(url)
    made = {r: latest_committed(storage, stage_dir(storage, r, None, "sft")) for r in ("one", "two")}
    assert made["two"].manifest.summary["world_size"] == 2 and made["one"].manifest.summary["world_size"] == 1
    steps = {r: query(storage, r, "SELECT loss, n_tokens FROM sft_metrics ORDER BY step") for r in made}
    assert len(steps["one"]) == 3 and steps["one"].n_tokens.tolist() == steps["two"].n_tokens.tolist()
    assert steps["one"].loss.tolist() == pytest.approx(steps["two"].loss.tolist(), rel=1e-4, abs=1e-6)
    made["base"] = latest_committed(storage, stage_dir(storage, "one", None, "base"))
    w = {r: load_file(c.path("policy/model.safetensors")) for r, c in made.items()}
    base = w.pop("base")
    d1, d2 = (torch.cat([(w[r][k] - base[k]).flatten() for k in sorted(base)]) for r in ("one", "two"))
    assert d1.norm() > 1e-3 and ((d1 - d2).norm() / d1.norm()).item() < 1e-3
