"""The learner's shared-prompt forward, its grouped batches and the reference it skips."""

import contextlib
import dataclasses

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from grpo import core
from grpo.config import load_config
from grpo.learner import Batch, PolicyLM, Scores, forward_logprobs
from grpo.learner.loop import group_tokens, minibatch_step, split_microbatches
from grpo.learner.loss import loss_spec
from grpo.record.commit import StageWriter
from grpo.record.layout import stage_dir
from grpo.record.storage import latest_committed, open_storage
from schemas import read_parquet, write_parquet
from stages import StageError, stage_function
from stages.init import build_tiny_base, init_run
from stages.learn_data import _padded, load_batch

pytestmark = pytest.mark.equivalence  # run again in CI's bf16 lane (.ci/run)

TINY = [
    "rollout.backend=hf",
    "rollout.prompts_per_iteration=16",
    "rollout.group_size=4",
    "learn.minibatch_size=32",
    "learn.microbatch_size=16",
    "eval.n_prompts=16",
    "model.hidden_size=64",
    "model.num_heads=2",
    "model.intermediate_size=128",
    "reward.workers=1",
]
# equivalences to 1e-5 (microbatches, packing, where pi_old comes from, processes) hold in float32: bf16 autocast
# rounds every forward to 3 digits. `auto` is float32 on a CPU, bf16 where GRPO_AUTO_PRECISION=bf16 (CI's bf16 lane)
F32 = "learn.mixed_precision=no"


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_base(str(tmp_path_factory.mktemp("lm")), load_config(None, TINY))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def full_sequence_logprobs(lm, prompts, responses):
    """Reference: one right-padded forward per whole sequence; (N, T) log-probs of the responses."""
    width, t = max(len(p) + len(r) for p, r in zip(prompts, responses)), max(map(len, responses))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, : len(p) + len(r)], mask[i, : len(p) + len(r)] = torch.tensor(p + r), 1
    logp = core.token_logprobs(lm(input_ids=ids, attention_mask=mask).logits[:, :-1], ids[:, 1:])
    out = torch.zeros(len(prompts), t)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        out[i, : len(r)] = logp[i, len(p) - 1 : len(p) - 1 + len(r)]
    return out


@pytest.mark.precision_pinned
def test_shared_prompt_forward_equals_full_sequences(lm):
    """Prompts of different lengths (left-padded), responses of different lengths (right-padded):
    log-probs and gradients match a forward over every full sequence."""
    g, gen = 3, torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 16, (n,), generator=gen).tolist() for n in (5, 8, 3)]
    responses = [torch.randint(4, 16, (n,), generator=gen).tolist() for n in (4, 1, 4, 2, 4, 3, 1, 4, 2)]
    lp, t = max(map(len, prompts)), max(map(len, responses))
    prompt_ids, prompt_mask = torch.zeros(3, lp, dtype=torch.long), torch.zeros(3, lp, dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_ids[i, lp - len(p) :], prompt_mask[i, lp - len(p) :] = torch.tensor(p), 1
    response_ids, response_mask = torch.zeros(9, t, dtype=torch.long), torch.zeros(9, t)
    for i, r in enumerate(responses):
        response_ids[i, : len(r)], response_mask[i, : len(r)] = torch.tensor(r), 1

    full = full_sequence_logprobs(lm, [p for p in prompts for _ in range(g)], responses) * response_mask
    # shared prompt; then chunked logits (4 tokens at a time); then the full-sequence training forward
    # of gradient checkpointing, with checkpointing on
    models = [PolicyLM(lm), PolicyLM(lm, logprob_chunk=4), PolicyLM(lm, full_sequences_in_training=True).train()]
    models.append(PolicyLM(lm, padding_free=True))  # 8 rows for 9 responses (test_packed_rows_...)
    for model in models:
        logp = model(prompt_ids, prompt_mask, response_ids, response_mask)[0] * response_mask
        assert (logp - full).abs().max() < 1e-5
    grads = []
    for i, model in enumerate(models + [None]):
        lm.zero_grad()
        if i == 2:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        logp = full if model is None else model(prompt_ids, prompt_mask, response_ids, response_mask)[0]
        if model is None:
            logp = full_sequence_logprobs(lm, [p for p in prompts for _ in range(g)], responses)
        (logp * response_mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in lm.parameters()]))
        lm.gradient_checkpointing_disable()
    for grad in grads[:-1]:
        assert (grad - grads[-1]).norm() / grads[-1].norm() < 1e-5


@pytest.mark.precision_pinned
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_rows_give_the_same_log_probs_entropy_and_gradients(lm, attention):
    """learn.padding_free: each group's responses share rows (a short one after another, each seeing only the
    group's prompt and itself): the same log-probs, entropy and gradients as one row per response, on fewer
    rows; a microbatch where packing saves too few rows keeps one row per response."""
    gen = torch.Generator().manual_seed(2)  # 3 groups of 4
    lengths = [[9, 2, 3, 4], [1, 1, 9, 8], [5, 4, 0, 6]]  # an empty response too
    lp, t = 7, 9
    prompt_ids = torch.randint(4, 16, (3, lp), generator=gen)
    prompt_mask = torch.ones(3, lp, dtype=torch.long)
    prompt_mask[1, :4] = prompt_mask[2, :1] = 0  # left padding
    response_ids, response_mask = torch.randint(4, 16, (12, t), generator=gen), torch.zeros(12, t)
    for i, n in enumerate(sum(lengths, [])):
        response_mask[i, :n] = 1
    response_ids = response_ids * response_mask.long()
    rows = []
    lm.config._attn_implementation = attention
    try:
        results = []
        for padding_free in (False, True):
            model = PolicyLM(lm, padding_free=padding_free)
            hook = lm.model.register_forward_pre_hook(
                lambda _, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
            )
            lm.zero_grad()
            logp, entropy = model(prompt_ids, prompt_mask, response_ids, response_mask, with_entropy=True)
            (logp * response_mask * torch.linspace(0.5, 2, 12)[:, None]).sum().backward()
            hook.remove()
            grad = torch.cat([p.grad.flatten() for p in lm.parameters()])
            results.append((logp * response_mask, entropy * response_mask, grad))
    finally:
        lm.config._attn_implementation = "sdpa"
    assert rows == [3, 12, 3, 7]  # prompts, then a row per response; prompts, then 7 packed rows
    (padded, padded_entropy, padded_grad), (packed, packed_entropy, packed_grad) = results
    assert (packed - padded).abs().max() < 1e-5 and (packed_entropy - padded_entropy).abs().max() < 1e-5
    assert (packed_grad - padded_grad).norm() / padded_grad.norm() < 1e-5
    assert padded.abs().min() == 0 and (packed * (1 - response_mask)).abs().max() == 0
    rows.clear()
    hook = lm.model.register_forward_pre_hook(lambda _, a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    even = torch.ones(12, t)  # every response as long as the longest: nothing to save
    PolicyLM(lm, padding_free=True)(prompt_ids, prompt_mask, response_ids, even)
    hook.remove()
    assert rows == [3, 12]


@pytest.mark.precision_pinned
def test_a_groups_forward_skips_the_batchs_padding_and_gives_the_same_log_probs(lm):
    """forward_logprobs cuts the columns every prompt and response of its groups leaves padded (the batch is
    padded to its longest of each): the same log-probs as the padded forward, 0 past each response's end,
    and the model sees only the groups' own widths."""
    g, gen = 2, torch.Generator().manual_seed(1)
    prompt_len, response_len = (9, 3), (7, 0, 2, 3)  # group 1: a short prompt and short (one empty) responses
    lp, t = max(prompt_len), max(response_len)
    prompt_ids, prompt_mask = torch.zeros(2, lp, dtype=torch.long), torch.zeros(2, lp, dtype=torch.long)
    for i, n in enumerate(prompt_len):
        prompt_ids[i, lp - n :], prompt_mask[i, lp - n :] = torch.randint(4, 16, (n,), generator=gen), 1
    response_ids, response_mask = torch.zeros(4, t, dtype=torch.long), torch.zeros(4, t)
    for i, n in enumerate(response_len):
        response_ids[i, :n], response_mask[i, :n] = torch.randint(4, 16, (n,), generator=gen), 1
    batch = Batch(
        prompt_ids,
        prompt_mask,
        response_ids,
        response_mask,
        response_mask,
        torch.zeros(4, t),
        torch.zeros(4, t, dtype=torch.long),
        *torch.zeros(2, 4),
        g,
        [0] * 4,
        [0] * 4,
    )
    seen = []
    model = PolicyLM(lm)
    model.register_forward_pre_hook(lambda _, args: seen.append((args[0].shape[1], args[2].shape[1])))
    padded = model(prompt_ids, prompt_mask, response_ids, response_mask)[0] * response_mask
    for group, widths in ((0, (9, 7)), (1, (3, 3))):
        rows = batch.rows(torch.tensor([group]))
        logp, entropy = forward_logprobs(model, batch, torch.tensor([group]), with_entropy=True)
        assert seen[-1] == widths and logp.shape == entropy.shape == (g, t)
        assert (logp - padded[rows]).abs().max() < 1e-5 and (logp * (1 - response_mask[rows])).abs().max() == 0


@pytest.mark.precision_pinned
def test_padded_rows_right_and_left():
    import numpy as np
    import pyarrow as pa

    column = pa.chunked_array([[[1, 2, 3], [4]], [[], [5, 6]]])  # two chunks, an empty row
    rows = np.array([3, 0, 2, 1])
    right, lengths = _padded(column, rows, 0, np.int64)
    assert right.tolist() == [[5, 6, 0], [1, 2, 3], [0, 0, 0], [4, 0, 0]] and lengths.tolist() == [2, 3, 0, 1]
    left, _ = _padded(column, rows, -1, np.int64, left=True)
    assert left.tolist() == [[-1, 5, 6], [1, 2, 3], [-1, -1, -1], [-1, -1, 4]]


def update(storage, run_id, learn) -> torch.Tensor:
    """What a committed learn did to the base policy of run_id: its weights minus the base's, flat."""
    base = load_file(
        latest_committed(storage, stage_dir(storage, run_id, None, "base")).path("policy/model.safetensors")
    )
    after = load_file(learn.path("policy/model.safetensors"))
    return torch.cat([(after[k] - base[k]).flatten() for k in sorted(base)])


def make_run(storage, run_id, extra=()):
    init_run(storage, run_id, load_config(None, TINY + list(extra)))
    for s in ["snapshot", "rollouts", "rewards", "advantages"]:
        stage_function(s)(storage, run_id, 0)


@pytest.mark.precision_pinned
def test_batch_holds_whole_groups_and_rejects_a_broken_one(storage):
    make_run(storage, "t")
    ro = latest_committed(storage, stage_dir(storage, "t", 0, "rollouts"))
    ad = latest_committed(storage, stage_dir(storage, "t", 0, "advantages"))
    batch = load_batch(storage, ro, ad, pad_id=0, group_size=4)
    assert batch.prompt_ids.shape[0] * 4 == batch.response_ids.shape[0] == 64
    assert batch.prompt_id == sorted(batch.prompt_id) and batch.prompt_id[:5] == [0, 0, 0, 0, 1]
    rows = pd.read_parquet(storage.uri(ro.path("rollouts.parquet"))).sort_values(["prompt_id", "sample_index"])
    assert batch.prompt_ids[1][batch.prompt_mask[1].bool()].tolist() == rows.prompt_ids.iloc[4].tolist()
    assert batch.response_mask.sum(1).tolist() == rows.response_ids.map(len).tolist()

    # one sample of group 0 left out: the learner could not score that group's prompt once for G
    table = read_parquet(storage.fs, ad.path("advantages.parquet"), "advantages").to_pandas()
    table.loc[(table.prompt_id == 0) & (table.sample_index == 1), "kept"] = False
    writer = StageWriter(
        storage,
        stage_dir(storage, "t", 0, "advantages"),
        run_id="t",
        iteration=0,
        stage="advantages",
        config={"broken": True},
        inputs={},
    )
    write_parquet(storage.fs, writer.path("advantages.parquet"), "advantages", table.to_dict("list"))
    with pytest.raises(StageError, match="prompt_id 0 does not have rollout.group_size=4"):
        load_batch(storage, ro, writer.commit(), pad_id=0, group_size=4)


@pytest.mark.precision_pinned
def test_microbatches_of_the_longest_responses_together_give_the_one_microbatch_update(storage):
    """A minibatch in microbatches (grouped by response length, each padded to its own longest) accumulates
    the gradient of the whole minibatch in one forward."""
    out = {}
    for n in (8, 32):  # two groups a microbatch, or the whole minibatch of 8 groups
        make_run(storage, f"mb{n}", extra=[f"learn.microbatch_size={n}", "learn.epochs=2", F32])
        out[n] = stage_function("learn")(storage, f"mb{n}", 0)
    lengths = read_parquet(storage.fs, out[8].path("logprobs.parquet"), "logprobs").column("old_logprobs")
    assert len({len(x) for x in lengths.to_pylist()}) > 1  # responses of several lengths to group
    d8, d32 = (update(storage, f"mb{n}", out[n]) for n in (8, 32))
    assert d32.norm() > 1e-3 and (d8 - d32).norm() / d32.norm() < 1e-5, ((d8 - d32).norm() / d32.norm()).item()


@pytest.mark.precision_pinned
def test_token_mean_microbatches_of_unequal_tokens_give_the_one_microbatch_update(storage):
    """DAPO's token mean under gradient accumulation: every token of the minibatch weighs 1 / its tokens, not
    1 / (steps x tokens of its microbatch), which gave the microbatches of long responses less weight a token
    (0.18 of the update apart before). After AdamW the float32 floor is that of the per-sequence modes (1e-5);
    the gradient itself agrees to 1e-6 (the next test)."""
    out = {}
    for n in (8, 32):
        make_run(storage, f"tm{n}", extra=[f"learn.microbatch_size={n}", "learn.agg_mode=token_mean", F32])
        out[n] = stage_function("learn")(storage, f"tm{n}", 0)
    d8, d32 = (update(storage, f"tm{n}", out[n]) for n in (8, 32))
    assert d32.norm() > 1e-3 and (d8 - d32).norm() / d32.norm() < 1e-5, ((d8 - d32).norm() / d32.norm()).item()


@pytest.mark.precision_pinned
@pytest.mark.parametrize("agg_mode", ["token_mean", "seq_mean_token_mean"])
def test_gradient_of_unequal_microbatches_and_ranks_is_the_minibatch_mean(storage, lm, agg_mode):
    """The gradient a minibatch accumulates (before AdamW) in microbatches of unequal tokens, in microbatches of
    unequal sizes (learn.microbatch_tokens, each rank as many), or in two ranks' halves averaged as DDP does, is
    its one-microbatch gradient within 1e-6 in float32: token_mean's over the minibatch's tokens, the
    per-sequence mean's over its sequences."""
    make_run(storage, "g", extra=[f"learn.agg_mode={agg_mode}", "learn.kl_coef=0.1"])
    ro, ad = (latest_committed(storage, stage_dir(storage, "g", 0, s)) for s in ("rollouts", "advantages"))
    batch = load_batch(storage, ro, ad, pad_id=0, group_size=4)
    model, groups = PolicyLM(lm), torch.arange(8)  # one minibatch of 32 samples
    scores = Scores(batch.sampler_logprobs, batch.sampler_logprobs - 0.1)
    n_tok = float(batch.response_mask[batch.rows(groups)].sum())
    tokens = sorted(group_tokens(batch)[groups].tolist())
    sizes = []

    def grad(microbatch_size: int, world: int, budget: int | None = None) -> torch.Tensor:
        cfg = load_config(None, TINY + [f"learn.agg_mode={agg_mode}", "learn.kl_coef=0.1"])
        lcfg = dataclasses.replace(cfg.learn, microbatch_size=microbatch_size, microbatch_tokens=budget)
        spec = dataclasses.replace(loss_spec(cfg), max_tokens=128)
        plan = split_microbatches(batch, groups, lcfg, world)
        accum = len(plan[0])
        assert all(len(mbs) == accum for mbs in plan) and sorted(torch.cat(sum(plan, [])).tolist()) == list(range(8))
        sizes.append([len(mb) for mbs in plan for mb in mbs])
        sequences = None if budget is None else 32 / world / accum
        total = None
        for rank in range(world):  # DDP: the mean of the ranks' gradients
            lm.zero_grad()
            args = (spec, accum, contextlib.nullcontext, n_tok / (accum * world), sequences)
            minibatch_step(model, batch, scores, plan[rank], *args)
            g = torch.cat([p.grad.flatten() for p in lm.parameters()]) / world
            total = g if total is None else total + g
        return total

    longest = batch.response_mask[batch.rows(groups)].sum(1).view(8, -1).amax(1)
    in_order = groups[longest.argsort(descending=True, stable=True)]  # as minibatch_step groups them
    assert len({int(batch.response_mask[batch.rows(mb)].sum()) for mb in in_order.split(2)}) > 1
    one = grad(32, 1)
    budgets = [sum(tokens[-3:]), tokens[-1] + tokens[0]]  # 2 or 3 groups a microbatch; 1 or 2
    for microbatch_size, world, budget in [(8, 1, None), (8, 2, None), (16, 2, None)] + [
        (32, w, b) for w in (1, 2) for b in budgets
    ]:
        other = grad(microbatch_size, world, budget)
        rel = ((other - one).norm() / one.norm()).item()
        assert rel < 1e-6, (microbatch_size, world, budget, rel)
    assert any(len(set(s)) > 1 for s in sizes[4:])  # some token budgets made microbatches of unequal sizes


@pytest.mark.precision_pinned
@pytest.mark.parametrize("agg_mode", ["seq_mean_token_mean", "token_mean"])
def test_microbatches_by_token_budget_give_the_update_of_fixed_size_microbatches(storage, monkeypatch, agg_mode):
    """learn.microbatch_tokens: whole groups, longest first, as many a microbatch as fit the budget (1 to 3 groups
    here, microbatches of unequal sizes) commit the update of microbatches of 2 groups within 1e-5 in float32:
    token_mean over the minibatch's tokens, the per-sequence mean over its sequences. A budget smaller than a
    group fails before any step, in one line naming the field and the size to set."""
    import grpo.learner.loop as loop

    common = ["learn.epochs=2", f"learn.agg_mode={agg_mode}", F32]
    make_run(storage, "fixed", extra=["learn.microbatch_size=8", *common])
    ro, ad = (latest_committed(storage, stage_dir(storage, "fixed", 0, s)) for s in ("rollouts", "advantages"))
    tokens = loop.group_tokens(load_batch(storage, ro, ad, pad_id=0, group_size=4)).tolist()
    budget = max(max(tokens), int(2.7 * sorted(tokens)[len(tokens) // 2]))  # long groups in twos, short in threes
    seen, real = [], loop.split_microbatches
    monkeypatch.setattr(loop, "split_microbatches", lambda *a: seen.append(out := real(*a)) or out)
    fixed = stage_function("learn")(storage, "fixed", 0)
    assert {len(mb) for mbs in seen for mb in mbs[0]} == {2}
    seen.clear()
    make_run(storage, "budget", extra=[f"learn.microbatch_tokens={budget}", *common])
    packed = stage_function("learn")(storage, "budget", 0)
    sizes = [len(mb) for mbs in seen for mb in mbs[0]]
    assert len(set(sizes)) > 1 and max(sizes) > 2, sizes  # unequal microbatches, larger than the fixed ones
    assert all(sum(tokens[g] for g in mb.tolist()) <= budget for mbs in seen for mb in mbs[0] if len(mb) > 1)
    d_fixed, d_packed = update(storage, "fixed", fixed), update(storage, "budget", packed)
    rel = ((d_packed - d_fixed).norm() / d_fixed.norm()).item()
    assert d_fixed.norm() > 1e-3 and rel < 1e-5, rel

    make_run(storage, "small", extra=[f"learn.microbatch_tokens={max(tokens) - 1}", *common])
    with pytest.raises(StageError, match=rf"^learn iteration 0: learn.microbatch_tokens={max(tokens) - 1} is smaller"):
        stage_function("learn")(storage, "small", 0)


@pytest.mark.precision_pinned
def test_packed_responses_give_the_update_of_one_row_per_response(storage, monkeypatch):
    """learn.padding_free (the default) against false: the same committed update and old log-probs, to float
    rounding, with some microbatches packed."""
    packed, real = [], PolicyLM._packed
    monkeypatch.setattr(PolicyLM, "_packed", lambda self, *a: packed.append(1) or real(self, *a))
    out = {}
    for padding_free in (True, False):
        run = f"pf-{padding_free}"
        make_run(
            storage, run, extra=["learn.microbatch_size=8", f"learn.padding_free={str(padding_free).lower()}"] + [F32]
        )
        out[padding_free] = stage_function("learn")(storage, run, 0)
        if padding_free:
            assert len(packed) > 0
            calls = len(packed)
    assert len(packed) == calls  # false: never packed
    paths = {k: out[k].manifest.summary["learner_path"] for k in (True, False)}  # recorded with why
    assert (paths[True]["train"], paths[False]["train"]) == ("packed", "shared_prompt") and paths[False]["why"]
    on, off = (update(storage, f"pf-{k}", out[k]) for k in (True, False))
    assert off.norm() > 1e-3 and (on - off).norm() / off.norm() < 1e-5, ((on - off).norm() / off.norm()).item()
    old = [
        torch.tensor(
            sum(read_parquet(storage.fs, out[k].path("logprobs.parquet"), "logprobs")["old_logprobs"].to_pylist(), [])
        )
        for k in (True, False)
    ]
    assert (old[0] - old[1]).abs().max() < 1e-5


def test_reference_is_scored_only_with_a_kl_penalty(storage):
    make_run(storage, "nokl")
    make_run(storage, "kl", extra=["learn.kl_coef=0.1"])
    tables = {}
    for run_id in ("nokl", "kl"):
        out = stage_function("learn")(storage, run_id, 0)
        tables[run_id] = (
            pd.read_parquet(storage.uri(out.path("logprobs.parquet"))),
            pd.read_parquet(storage.uri(out.path("metrics.parquet"))),
        )
    lp, metrics = tables["nokl"]
    assert lp.ref_logprobs.isna().all() and metrics.kl.isna().all()
    lp, metrics = tables["kl"]
    assert metrics.kl.notna().all() and metrics.kl.iloc[-1] > 0  # the policy moved off the reference
    # iteration 0 samples from the base model, so reference and old log-probs are the same forward
    for old, ref in zip(lp.old_logprobs, lp.ref_logprobs):
        assert old.tolist() == pytest.approx(ref.tolist(), abs=1e-6)


@pytest.mark.parametrize(
    "extra",
    [
        ["learn.loss_type=gspo", "learn.clip_eps=3e-4", "learn.clip_eps_high=4e-4"],  # the paper's ranges
        ["learn.loss_type=cispo", "learn.agg_mode=token_mean"],
        ["learn.dual_clip_c=3.0"],
    ],
    ids=["gspo", "cispo", "dual_clip"],
)
def test_each_loss_variant_trains(storage, extra):
    """A learn stage with the variant commits a policy that moved, every step's loss finite."""
    from safetensors.torch import load_file

    make_run(storage, "v", extra=extra)
    out = stage_function("learn")(storage, "v", 0)
    metrics = pd.read_parquet(storage.uri(out.path("metrics.parquet")))
    assert len(metrics) == 4 and torch.isfinite(torch.tensor(metrics[["loss", "pg_loss", "grad_norm"]].values)).all()
    base = latest_committed(storage, stage_dir(storage, "v", None, "base"))
    before, after = (load_file(c.path("policy/model.safetensors")) for c in (base, out))
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-4
    if "learn.loss_type=gspo" in extra:  # ranges of 3e-4 / 4e-4 clip whole sequences once the policy moved
        assert metrics.clip_frac.iloc[1:].max() > 0 and metrics.clip_frac.iloc[0] == 0


@pytest.mark.precision_pinned
def test_the_loss_spec_carries_every_loss_setting_of_the_config():
    """loss_spec: each LossSpec field from its learn.* setting (rollout.max_tokens for Dr.GRPO's divisor,
    teacher.gkd_coef for GKD's term); a field
    added to LossSpec and not mapped here fails."""
    settings = {
        "loss_type": "gspo", "agg_mode": "token_mean", "clip_eps": 0.1, "clip_eps_high": 0.3, "dual_clip_c": 3.0,
        "kl_coef": 0.05, "kl_estimator": "k2", "behavior_correction": "mis", "behavior_level": "sequence",
        "tis_cap": 3.0, "mis_bounds": (0.1, 1.5), "icepop_bounds": (0.2, 4.0),
    }  # fmt: skip
    overrides = [f"learn.{k}={list(v) if isinstance(v, tuple) else v}".replace(" ", "") for k, v in settings.items()]
    spec = loss_spec(load_config(None, overrides + ["rollout.max_tokens=7"]))
    assert dataclasses.asdict(spec) == {**settings, "max_tokens": 7, "gkd_coef": 0.0}
    gkd = ["teacher.model=t", "teacher.top_k=2", "teacher.gkd_coef=0.5"]  # teacher.gkd_coef: GKD's term
    assert loss_spec(load_config(None, gkd)).gkd_coef == 0.5


@pytest.mark.precision_pinned
def test_learn_doctests():
    """The reference's iteration (grpo.record.lineage) and the learner's precision, by their doctests."""
    import doctest

    import grpo.learner.precision
    import grpo.record.lineage

    results = [doctest.testmod(m) for m in (grpo.record.lineage, grpo.learner.precision)]
    assert sum(r.attempted for r in results) >= 2 and not any(r.failed for r in results)


@pytest.mark.precision_pinned
def test_settings_added_later_leave_existing_stage_identities_alone():
    """At their defaults the settings added after runs were made (grpo.record.identity.ADDED_SETTINGS) are not part of
    any stage's identity: a run made before them keeps its committed stages (hash of the defaults before them)."""
    from grpo.record.identity import config_hash
    from stages import advantages, learn, rewards, rollouts

    cfg = load_config(None)
    assert config_hash(rollouts.stage_config(cfg)) == "1c942db783b64e86017e7f7ad4df2eba2f91b2c161fc0d35bfde691f92c05127"
    assert (
        config_hash(advantages.stage_config(cfg)) == "587a9ea457c5ca65d93d8669b08125e4d4c575c286c99bc25c641926f158c6dd"
    )
    dynamic = load_config(None, ["rollout.min_signal_groups=32"])
    assert rollouts.stage_config(dynamic)["rollout"]["max_sampling_rounds"] == 3  # set: both in the identity
    assert advantages.stage_config(dynamic)["dynamic_sampling"] == {"at_most": 256, "multiple_of": 32}
    # learn.mixed_precision's default became `auto` after runs were made with "no", which they store, and
    # learn.old_logprobs's `auto` after runs stored "recompute" (or, made before it, read as that: stored_config)
    before_auto = load_config(None, ["learn.mixed_precision=no", "learn.old_logprobs=recompute"])
    assert (
        config_hash(learn.stage_config(before_auto))
        == "f387f6c1d765cafad97d7a71ef14608b08bcd0bcc539a0b6f5c9b56bf8095f80"
    )
    before_auto_old = load_config(None, ["learn.old_logprobs=recompute"])
    assert (
        config_hash(learn.stage_config(before_auto_old))
        == "5614fed86210b82cafd8b4e0bfcc190b74291f0cf146e64ae9adc5ca9bb73726"
    )
    assert config_hash(learn.stage_config(cfg)) == "f86143ba0231ab0b20bc3ea3b64f90e4c78e8244a770942706547ea4e60b5e42"
    assert learn.stage_config(load_config(None, ["learn.padding_free=false"]))["learn"]["padding_free"] is False
    assert config_hash(rewards.stage_config(cfg)) == "19054604eb9f926235bbaf5c460cfbcbe9c5206c90c0c8d71b4546a20525cc23"
    assert learn.stage_config(load_config(None, ["learn.dual_clip_c=3"]))["learn"]["dual_clip_c"] == 3.0
    refresh = learn.stage_config(load_config(None, ["learn.kl_coef=0.1", "learn.ref_update_every=2"]))["learn"]
    assert refresh["ref_update_every"] == 2
    shaped = rewards.stage_config(load_config(None, ["reward.overlong_buffer=2"]))["reward"]
    assert shaped["overlong_buffer"] == 2 and shaped["overlong_penalty"] == 1.0  # set: both in the identity


def test_reference_refresh_a_cold_resume_equals_the_warm_run_and_gc_keeps_the_reference(storage, monkeypatch):
    """learn.ref_update_every=2: iterations 0, 1 measure the KL to the base, iteration 2 to its own snapshot (the
    warm learner reloads its reference); learn 2 built cold from the committed files (a resume) commits the same
    bytes; gc's retention keeps the policy iteration 3's reference reads."""
    import numpy as np

    from grpo import gc
    from grpo.config import RetentionConfig
    from stages import learn as learn_stage
    from stages.iteration import run_iteration

    init_run(storage, "ref", load_config(None, TINY + ["learn.kl_coef=0.05", "learn.ref_update_every=2"]))
    learn_stage.WARM.take(None)
    outs = [run_iteration(storage, "ref", k)["learn"] for k in range(3)]
    assert [o.manifest.summary["warm_learner"] for o in outs] == [False, True, True]
    assert [o.manifest.inputs["reference"].uri.rsplit("/", 3)[-3] for o in outs] == ["ref", "ref", "iter-0002"]
    lp = [pd.read_parquet(storage.uri(o.path("logprobs.parquet"))) for o in outs]
    same = [all(map(np.allclose, t.old_logprobs, t.ref_logprobs)) for t in lp]
    assert same == [True, False, True]  # 0: the base sampled; 1: moved off it; 2: refreshed

    monkeypatch.setattr(gc, "best_iteration", lambda *a: 0)  # the best eval: not the policy the rule keeps
    found = gc.plan(storage, "ref", min_age_s=0, retention=RetentionConfig(keep_last=1))
    assert not [g for g in found.garbage if g.why == "policy"]
    assert "iteration 1: policy (the KL reference of iteration 3)" in found.kept

    learn_stage.WARM.take(None)  # what a new process has
    cold = stage_function("learn")(storage, "ref", 2, force=True)
    assert cold.attempt_dir != outs[2].attempt_dir and not cold.manifest.summary["warm_learner"]
    files = lambda c: sorted((f.path, f.sha256) for f in c.manifest.files)  # noqa: E731
    assert files(cold) == files(outs[2])


@pytest.mark.precision_pinned
def test_a_minibatch_reads_its_metrics_to_the_host_once_not_per_microbatch(storage, monkeypatch):
    """The microbatch loop leaves every metric on the device (no float() or .item() of a tensor, each a host sync
    on a GPU) and reads them all at once after it; the update and metrics are the ones of before."""
    import grpo.learner.loop as loop

    real, calls, reads = loop.minibatch_step, [], []

    def counted(*args, **kwargs):
        before = len(reads)
        out = real(*args, **kwargs)
        calls.append(len(reads) - before)
        return out

    for name in ("__float__", "item"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, o=original: reads.append(1) or o(self, *a))
    monkeypatch.setattr(loop, "minibatch_step", counted)
    make_run(storage, "sync", extra=["learn.microbatch_size=8", F32])  # 4 microbatches a minibatch
    out = stage_function("learn")(storage, "sync", 0)
    assert calls and all(c == 0 for c in calls), calls
    metrics = pd.read_parquet(out.path("metrics.parquet"))
    assert len(metrics) == len(calls) and metrics.loss.notna().all() and (metrics.ratio_max >= metrics.ratio_min).all()
