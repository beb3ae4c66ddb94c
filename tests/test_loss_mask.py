"""Learning on multi-turn episodes: the rollouts table's loss_mask (1 on the tokens the sampler produced, 0 on the
observation, tool-result and template tokens appended between turns) decides which tokens the learner trains on.
Every token is context for the forward; the loss, KL, entropy, token counts, clip and ratio statistics and the
behaviour corrections count the sampled ones only, with padding-free packing, token budgets, LoRA, fsdp2 and
rollout.staleness.

The episodes here are the committed rollouts of a tiny run with tokens marked as observations by hand (the
learner cannot tell how an episode came about: it sees ids, a mask and log-probs)."""

import contextlib
import dataclasses
import hashlib

import pandas as pd
import pytest
import torch
from test_learn import F32, TINY, full_sequence_logprobs
from test_learn import make_run as make_run_with_inputs
from test_sharding import learn_of, relative_gap, weights

from grpo import core
from grpo.config import load_config
from grpo.learner import Batch, PolicyLM, Scores
from grpo.learner.loop import group_tokens, minibatch_step, split_microbatches
from grpo.record.layout import stage_dir
from grpo.record.storage import latest_committed, open_storage
from stages import learn as learn_stage
from stages import stage_function
from stages.init import build_tiny_base, init_run
from stages.learn_data import load_batch

pytestmark = [pytest.mark.equivalence, pytest.mark.precision_pinned]  # every learner here pins float32


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


def observations(batch: Batch, middle: bool = True) -> torch.Tensor:
    """(N, T) bool: the tokens made observations here: in every response of 3+ tokens its last one and, `middle`,
    its second (a tool's result between two turns, which the sampled tokens after it see)."""
    out = torch.zeros_like(batch.response_mask, dtype=torch.bool)
    for i, n in enumerate(batch.response_mask.sum(1).long().tolist()):
        if n >= 3:
            out[i, n - 1] = True
            out[i, 1] = middle
    return out


def as_episodes(batch: Batch, middle: bool = True, garbage: int | None = None) -> Batch:
    """`batch` with observations(): loss_mask 0 there and the sampler's log-prob 0.0 as the rollouts table writes
    it; `garbage` (a seed): those log-probs anything (huge, inf, nan) and the ids of the observations that end a
    response others (tokens no sampled token sees)."""
    seen = observations(batch, middle)
    sampler = batch.sampler_logprobs.masked_fill(seen, 0.0)
    ids = batch.response_ids
    if garbage is not None:
        noise = 1e4 * torch.randn(sampler.shape, generator=torch.Generator().manual_seed(garbage))
        noise.view(-1)[:3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
        sampler = torch.where(seen, noise, sampler)
        ids = torch.where(observations(batch, middle=False), ids.roll(batch.group_size, 0), ids)
        assert (ids != batch.response_ids).sum() > len(ids) // 4
    return dataclasses.replace(batch, loss_mask=batch.loss_mask * ~seen, sampler_logprobs=sampler, response_ids=ids)


def other_context(batch: Batch) -> Batch:
    """`batch` with the ids of the observations inside the responses (their second tokens) changed."""
    middle = observations(batch) & ~observations(batch, middle=False)
    ids = torch.where(middle, batch.response_ids.roll(batch.group_size, 0), batch.response_ids)  # another prompt's
    assert (ids != batch.response_ids).sum() > len(ids) // 4
    return dataclasses.replace(batch, response_ids=ids)


def cut(batch: Batch) -> Batch:
    """`batch` with the trailing observations of as_episodes(middle=False) gone: shorter responses, every token
    sampled."""
    keep = ~observations(batch, middle=False) & batch.response_mask.bool()
    width = max(1, int(keep.sum(1).max()))
    return dataclasses.replace(
        batch,
        response_ids=(batch.response_ids * keep)[:, :width],
        response_mask=keep.float()[:, :width],
        loss_mask=keep.float()[:, :width],
        sampler_logprobs=(batch.sampler_logprobs * keep)[:, :width],
        token_versions=batch.token_versions[:, :width],
    )


# ---------------------------------------------------------------- the gradient of one minibatch, by its definition


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_base(str(tmp_path_factory.mktemp("lm")), load_config(None, TINY))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def committed_batch(tmp_path_factory) -> Batch:
    storage = open_storage((tmp_path_factory.mktemp("batch") / "store").as_uri())
    make_run_with_inputs(storage, "b", extra=[F32])
    ro, ad = (latest_committed(storage, stage_dir(storage, "b", 0, s)) for s in ("rollouts", "advantages"))
    return load_batch(storage, ro, ad, pad_id=0, group_size=4)


def dropped(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Each row's values where keep is 1, moved to its front, right-padded with 0 (differentiable)."""
    rows = [x[i][keep[i].bool()] for i in range(len(x))]
    return torch.stack([torch.nn.functional.pad(r, (0, x.shape[1] - len(r))) for r in rows])


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize(
    "loss_type,agg_mode,correction,level",
    [
        ("grpo_clip", "token_mean", "tis", "token"),
        ("gspo", "seq_mean_token_mean", "mis", "sequence"),
        ("cispo", "seq_mean_token_sum_norm", "icepop", "token"),
    ],
)
def test_an_episode_minibatch_gradient_is_its_definition_with_observations_dropped(
    lm, committed_batch, padding_free, loss_type, agg_mode, correction, level
):
    """The gradient a minibatch of episodes accumulates over 4 microbatches (shared prompts or packed rows) is the
    one of its definition: every whole sequence through the model, log-probs taken at the sampled tokens only, and
    the loss (KL, behaviour weights) over those, as if the observations were absent from the loss, within 1e-5 in
    float32; the observations' sampler, old and reference log-probs (anything) change nothing."""
    batch = as_episodes(committed_batch)
    g, n = batch.group_size, len(batch.response_ids)
    groups = torch.arange(n // g)
    gen = torch.Generator().manual_seed(0)
    prompts = [batch.prompt_ids[i // g][batch.prompt_mask[i // g].bool()].tolist() for i in range(n)]
    responses = [batch.response_ids[i][batch.response_mask[i].bool()].tolist() for i in range(n)]
    with torch.no_grad():
        own = full_sequence_logprobs(lm, prompts, responses)
    keep = batch.loss_mask
    old = own + 0.1 * torch.randn(own.shape, generator=gen) * keep
    sampler = torch.where(keep.bool(), old + 0.3 * torch.randn(own.shape, generator=gen), batch.sampler_logprobs)
    ref = own - 0.2 * keep
    spec = core.LossSpec(
        loss_type, agg_mode, kl_coef=0.1, max_tokens=8, behavior_correction=correction, behavior_level=level,
        tis_cap=1.3, mis_bounds=(0.0, 2.0), icepop_bounds=(0.7, 1.5),
    )  # fmt: skip
    batch = dataclasses.replace(batch, sampler_logprobs=sampler)

    lm.zero_grad()
    logp = full_sequence_logprobs(lm, prompts, responses)
    loss, _ = core.grpo_microbatch_step(
        spec,
        dropped(logp, keep),
        dropped(keep, keep),
        gradient_accumulation_steps=1,
        raw_rewards=batch.rewards[:, None],
        advantages=batch.advantages[:, None],
        old_logprobs=dropped(old, keep),
        ref_logprobs=dropped(ref, keep),
        sampler_logprobs=dropped(sampler, keep),
        token_normalizer=float(keep.sum()),
    )
    definition = torch.cat([p.grad.flatten() for p in lm.parameters()])

    lcfg = dataclasses.replace(load_config(None, TINY).learn, microbatch_size=16)
    plan = split_microbatches(batch, groups, lcfg, 1)[0]
    model = PolicyLM(lm, padding_free=padding_free)

    def learner_grad(b: Batch, scores: Scores) -> torch.Tensor:
        lm.zero_grad()
        metrics = minibatch_step(
            model, b, scores, plan, spec, len(plan), contextlib.nullcontext, keep.sum() / len(plan)
        )
        assert metrics["loss/total"] == pytest.approx(loss.item(), rel=1e-5)
        return torch.cat([p.grad.flatten() for p in lm.parameters()])

    grad = learner_grad(batch, Scores(old, ref))
    assert len(plan) == 4 and definition.norm() > 0
    assert ((grad - definition).norm() / definition.norm()).item() < 1e-5
    anything = as_episodes(committed_batch, garbage=1).sampler_logprobs  # huge, inf, nan where loss_mask is 0
    noisy = dataclasses.replace(batch, sampler_logprobs=torch.where(keep.bool(), sampler, anything))
    on = keep.bool()
    assert torch.equal(
        learner_grad(noisy, Scores(torch.where(on, old, anything), torch.where(on, ref, -anything))), grad
    )


# ---------------------------------------------------------------- whole learns: observations at the end of a response


def learned_update(storage, run_id: str, k: int) -> dict:
    """What learn k trained: the policy's weights minus the base's, or the LoRA adapters' B (0 at the start)."""
    learned = learn_of(storage, run_id, k)
    if any(f.path.startswith("adapter/") for f in learned.manifest.files):
        return {n: v for n, v in weights(learned, "adapter/adapter_model.safetensors").items() if "lora_B" in n}
    base = weights(latest_committed(storage, stage_dir(storage, run_id, None, "base")))
    return {n: v - base[n] for n, v in weights(learned).items()}


def learn_runs(storage, monkeypatch, runs: dict, extra: list, iterations: int = 1) -> None:
    """Run `iterations` iterations of each run of `runs` (run id -> what its learns make of the committed batch)."""
    real = learn_stage.load_batch
    monkeypatch.setattr(
        learn_stage, "load_batch", lambda st, ro, *a: runs[ro.manifest.run_id](real(st, ro, *a))
    )  # fmt: skip
    for run_id in runs:
        init_run(storage, run_id, load_config(None, TINY + extra))
        learn_stage.WARM.take(None)
        for k in range(iterations):
            for s in ["snapshot", "rollouts", "rewards", "advantages", "learn"]:
                stage_function(s)(storage, run_id, k)
    learn_stage.WARM.take(None)


LORA = ["learn.lora={r: 2, alpha: 4}", "learn.kl_coef=0.05", F32]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra,iterations",
    [
        pytest.param([F32, "learn.agg_mode=token_mean", "learn.epochs=2", "budget"], 1, id="packed-token-budget"),
        pytest.param(LORA + ["rollout.staleness=1", "learn.behavior_correction=tis"], 2, id="lora-staleness-1"),
        pytest.param([F32, "learn.num_processes=2", "learn.sharding=fsdp2", "learn.loss_type=gspo"], 1, id="fsdp2"),
    ],
)
def test_observations_that_end_a_response_train_as_if_it_ended_before_them(storage, monkeypatch, extra, iterations):
    """Tokens no later token sees and the loss masks out are as good as absent: a learn on episodes that end in
    observation tokens commits the update of one on the same responses without them, within 1e-4 in float32, and
    counts the same trained tokens (n_tokens), loss, KL, gradient norm and ratio extremes; with padding-free
    packing and a token budget (learn.microbatch_tokens), LoRA at rollout.staleness=1 with TIS (learn 1: sampled by
    the base, updated from learn 0), and fsdp2 on 2 processes."""
    if "budget" in extra:
        make_run_with_inputs(storage, "probe", extra=[F32])
        ro, ad = (latest_committed(storage, stage_dir(storage, "probe", 0, s)) for s in ("rollouts", "advantages"))
        tokens = group_tokens(load_batch(storage, ro, ad, pad_id=0, group_size=4)).tolist()
        extra = [x for x in extra if x != "budget"] + [
            f"learn.microbatch_tokens={max(max(tokens), int(2.7 * sorted(tokens)[len(tokens) // 2]))}"
        ]
    runs = {"episodes": lambda b: as_episodes(b, middle=False), "cut": lambda b: cut(as_episodes(b, middle=False))}
    learn_runs(storage, monkeypatch, runs, extra, iterations)
    k = iterations - 1
    a, b = learned_update(storage, "episodes", k), learned_update(storage, "cut", k)
    # the shorter responses sort and split into other microbatches: float noise that AdamW's m / sqrt(v) blows up on
    # near-zero gradients (1.2e-5 measured with the token budget), as in tests/test_sharding.py
    assert relative_gap(a, b) < 1e-4, relative_gap(a, b)
    ma, mb = (pd.read_parquet(learn_of(storage, r, k).path("metrics.parquet")) for r in ("episodes", "cut"))
    assert ma.n_tokens.tolist() == mb.n_tokens.tolist()
    there = pd.read_parquet(learn_of(storage, "episodes", k).path("logprobs.parquet")).old_logprobs.map(len).sum()
    assert ma.n_tokens.iloc[0] < there  # a minibatch's trained tokens: fewer than the tokens there
    # (entropy and clip_frac are means of each microbatch's, and the microbatches hold other groups when the
    # responses are shorter: longest first, by the token budget)
    for col in ["loss", "kl", "ratio_max", "ratio_min", "grad_norm"]:
        if ma[col].notna().all():
            assert ma[col].tolist() == pytest.approx(mb[col].tolist(), rel=1e-4, abs=1e-6), col
    sa, sb = (learn_of(storage, r, k).manifest.summary for r in ("episodes", "cut"))
    assert sa["tokens"] == sb["tokens"] and sa["logprob_gap"] == pytest.approx(sb["logprob_gap"], abs=1e-6)


def test_observations_change_the_update_only_as_context(storage, monkeypatch):
    """A learn on episodes commits the same policy bytes whatever log-probs the sampler wrote for the observations
    (huge, inf, nan: the table writes 0.0) and whatever ids end a response as observations (no sampled token sees
    them); other ids of observations that later sampled tokens see give another update (they are context)."""
    runs = {
        "zeros": as_episodes,
        "anything": lambda b: as_episodes(b, garbage=1),
        "context": lambda b: as_episodes(other_context(b)),
    }
    extra = [F32, "learn.behavior_correction=tis", "learn.kl_coef=0.05", "learn.epochs=2"]
    learn_runs(storage, monkeypatch, runs, extra)
    learned = {r: learn_of(storage, r, 0) for r in runs}
    sha = {
        r: hashlib.sha256(open(c.path("policy/model.safetensors"), "rb").read()).hexdigest() for r, c in learned.items()
    }
    metrics = {r: pd.read_parquet(c.path("metrics.parquet")).drop(columns="run_id") for r, c in learned.items()}
    assert sha["zeros"] == sha["anything"] and metrics["zeros"].equals(metrics["anything"])
    assert len(metrics["zeros"]) > 1 and (metrics["zeros"].grad_norm != metrics["context"].grad_norm).all()
    summary = {r: c.manifest.summary for r, c in learned.items()}
    assert summary["zeros"]["old_logprobs"]["source"] == "sampler"  # the sampled tokens matched: auto took them
    for key in ("logprob_gap", "behavior_weight_mean", "sampler_kl", "tokens", "kl", "entropy", "clip_frac"):
        assert summary["zeros"][key] == summary["anything"][key], key


def test_one_turn_rollouts_train_every_token_and_a_mask_of_another_length_fails_naming_it(storage):
    """Today's rollouts stage writes loss_mask all ones (every token sampled), so the learner's mask is the
    responses'; a rollouts file whose loss_mask does not have one entry a response token fails in one line."""
    from grpo.record.commit import StageWriter
    from schemas import read_parquet, write_parquet
    from stages import StageError

    make_run_with_inputs(storage, "t", extra=[F32])
    ro, ad = (latest_committed(storage, stage_dir(storage, "t", 0, s)) for s in ("rollouts", "advantages"))
    batch = load_batch(storage, ro, ad, pad_id=0, group_size=4)
    assert torch.equal(batch.loss_mask, batch.response_mask)
    table = read_parquet(storage.fs, ro.path("rollouts.parquet"), "rollouts").to_pandas()
    table.at[5, "loss_mask"] = [1]
    writer = StageWriter(
        storage, stage_dir(storage, "t", 0, "rollouts"), run_id="t", iteration=0, stage="rollouts",
        config={"broken": True}, inputs={},
    )  # fmt: skip
    write_parquet(storage.fs, writer.path("rollouts.parquet"), "rollouts", table.to_dict("list"))
    with pytest.raises(StageError, match=r"rollouts.*prompt_id \d+ sample \d+ has 1 loss_mask entries for \d+"):
        load_batch(storage, writer.commit(), ad, pad_id=0, group_size=4)
