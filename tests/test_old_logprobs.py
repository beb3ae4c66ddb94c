"""Where pi_old comes from. learn.old_logprobs=sampler: from the sampler, no scoring pass; where the sampler runs
the learner's numerics (the transformers backend in float32) the update is the one a recomputed pi_old gives.
recompute: a scoring pass over every group but the first minibatch's, whose own forward (before any step)
gives theirs: the update of scoring them all."""

import dataclasses

import pandas as pd
import pytest
import torch
from test_learn import F32, make_run, update

import grpo.learner.loop
import grpo.learner.pi_old
import grpo.learner.state
from grpo.config import ConfigError, load_config
from grpo.record.storage import open_storage
from stages import stage_function

pytestmark = [pytest.mark.equivalence, pytest.mark.precision_pinned]  # the bf16 lane leaves it out (conftest.py)


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


def scored_groups(monkeypatch) -> list[int]:
    """Groups each scoring pass of the learner covers (pi_old's and the reference's; not the weights' probe)."""
    calls, score = [], grpo.learner.pi_old.score

    def counted(model, batch, chunk_groups, groups=None):
        if not (chunk_groups == 1 and groups is not None and len(groups) == 1):  # _check_weights' probe
            calls.append(len(batch.prompt_ids) if groups is None else len(groups))
        return score(model, batch, chunk_groups, groups=groups)

    for module in (grpo.learner.pi_old, grpo.learner.state, grpo.learner.loop):  # every caller of model.score
        monkeypatch.setattr(module, "score", counted)
    return calls


def test_sampler_log_probs_give_the_recomputed_update_without_the_scoring_pass(storage, monkeypatch):
    passes = scored_groups(monkeypatch)
    out = {}
    for mode in ("recompute", "sampler"):
        make_run(storage, mode, extra=[f"learn.old_logprobs={mode}", F32])
        before = sum(passes)
        out[mode] = stage_function("learn")(storage, mode, 0)
        out[mode + " passes"] = sum(passes) - before
    # 16 groups, minibatches of 8: recompute scores the 8 the first minibatch does not train on; no KL, no reference
    assert out["recompute passes"] == 8 and out["sampler passes"] == 0

    d1, d2 = (update(storage, m, out[m]) for m in ("recompute", "sampler"))
    assert d1.norm() > 1e-3
    assert (d1 - d2).norm() / d1.norm() < 1e-3, ((d1 - d2).norm() / d1.norm()).item()
    m1, m2 = (pd.read_parquet(out[m].path("metrics.parquet")) for m in ("recompute", "sampler"))
    assert m1.loss.tolist() == pytest.approx(m2.loss.tolist(), rel=1e-4, abs=1e-6)
    assert out["sampler"].manifest.summary["logprob_gap"] == 0.0  # pi_old is the sampler's, by construction


@pytest.mark.parametrize("sampler_off_by", [0.0, 0.01])
def test_auto_takes_the_samplers_log_probs_only_where_the_first_minibatch_shows_them_equal(
    storage, monkeypatch, sampler_off_by
):
    """learn.old_logprobs=auto (the default): with the transformers sampler in float32 the first minibatch's
    forward matches the sampler's log-probs, so the rest are the sampler's (no scoring pass) and the update is
    recompute's; a sampler off by 0.01 a token fails that check and the rest are scored before the first step,
    giving recompute's update and pi_old exactly."""
    import stages.learn

    real = stages.learn.load_batch

    def shifted(*args, **kwargs):
        batch = real(*args, **kwargs)
        return dataclasses.replace(
            batch, sampler_logprobs=batch.sampler_logprobs - sampler_off_by * batch.response_mask
        )

    monkeypatch.setattr(stages.learn, "load_batch", shifted)
    passes = scored_groups(monkeypatch)
    out = {}
    for mode in ("recompute", "auto"):
        make_run(storage, mode, extra=[F32] + [f"learn.old_logprobs={mode}"] * (mode == "recompute"))
        before = sum(passes)
        out[mode] = stage_function("learn")(storage, mode, 0)
        out[mode + " passes"] = sum(passes) - before
    summary = out["auto"].manifest.summary
    d1, d2 = (update(storage, m, out[m]) for m in ("recompute", "auto"))
    old1, old2 = (
        torch.tensor([x for row in pd.read_parquet(out[m].path("logprobs.parquet")).old_logprobs for x in row])
        for m in ("recompute", "auto")
    )
    assert d1.norm() > 1e-3 and out["recompute passes"] == 8
    if sampler_off_by:
        assert summary["old_logprobs"]["source"] == "recomputed" and out["auto passes"] == 8
        assert summary["old_logprobs"]["max_diff"] == pytest.approx(sampler_off_by, abs=1e-3)
        assert (d1 - d2).norm() / d1.norm() < 1e-5 and (old1 - old2).abs().max() < 1e-5
    else:
        assert summary["old_logprobs"]["source"] == "sampler" and out["auto passes"] == 0
        assert summary["old_logprobs"]["max_diff"] < 1e-4
        assert (d1 - d2).norm() / d1.norm() < 1e-3 and (old1 - old2).abs().max() < 1e-4
    assert summary["logprob_gap"] == pytest.approx(out["recompute"].manifest.summary["logprob_gap"], abs=2e-3)


@pytest.mark.parametrize("guard", ["learn.behavior_correction=tis", "learn.max_logprob_gap=0.1"])
def test_sampler_log_probs_refuse_the_guards_that_compare_them_with_the_learners(guard):
    with pytest.raises(ConfigError, match="learn.old_logprobs=sampler takes pi_old from the sampler"):
        load_config(None, ["learn.old_logprobs=sampler", guard])


def score_every_group(learner, batch, chunk_groups, first):
    """pi_old from a scoring pass over the whole batch, none from the first minibatch (the learner before)."""
    old = grpo.learner.pi_old.score(learner.acc.unwrap_model(learner.model), batch, chunk_groups)
    return grpo.learner.pi_old.PiOld(old, None, None, {"source": "recomputed"})


def test_the_first_minibatchs_forward_gives_its_old_log_probs_and_the_update_of_scoring_them_all(storage, monkeypatch):
    passes = scored_groups(monkeypatch)
    out = {}
    for mode in ("first minibatch", "every group scored"):
        if mode == "every group scored":
            monkeypatch.setitem(grpo.learner.pi_old.OLD_LOGPROBS, "recompute", score_every_group)
        extra = ["learn.epochs=2", "learn.max_logprob_gap=0.5", "learn.old_logprobs=recompute", F32]
        make_run(storage, mode.replace(" ", "-"), extra=extra)
        before = sum(passes)
        out[mode] = stage_function("learn")(storage, mode.replace(" ", "-"), 0)
        out[mode + " passes"] = sum(passes) - before
    assert (out["first minibatch passes"], out["every group scored passes"]) == (8, 16)
    a, b = (out[m] for m in ("first minibatch", "every group scored"))
    da, db = update(storage, "first-minibatch", a), update(storage, "every-group-scored", b)
    assert da.norm() > 1e-3 and (da - db).norm() / db.norm() < 1e-5, ((da - db).norm() / db.norm()).item()
    la, lb = (pd.read_parquet(c.path("logprobs.parquet")) for c in (a, b))
    old_a, old_b = (torch.tensor([x for row in t.old_logprobs for x in row]) for t in (la, lb))
    assert len(old_a) == len(old_b) > 0 and (old_a - old_b).abs().max() < 1e-5  # the committed pi_old: every row
    assert a.manifest.summary["logprob_gap"] == pytest.approx(b.manifest.summary["logprob_gap"], rel=1e-5)
    ma, mb = (pd.read_parquet(c.path("metrics.parquet")) for c in (a, b))
    assert ma.loss.tolist() == pytest.approx(mb.loss.tolist(), rel=1e-4, abs=1e-6) and len(ma) == 4


def test_a_model_with_dropout_scores_every_group_its_training_forward_is_not_the_snapshots():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    assert not grpo.learner.pi_old.active_dropout(Qwen2ForCausalLM(Qwen2Config(**shape)))
    assert grpo.learner.pi_old.active_dropout(Qwen2ForCausalLM(Qwen2Config(**shape, attention_dropout=0.1)))
