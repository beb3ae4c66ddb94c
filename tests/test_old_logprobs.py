"""learn.old_logprobs=sampler: pi_old from the sampler, no scoring pass; where the sampler runs the learner's
numerics (the transformers backend in float32) the update is the one a recomputed pi_old gives."""

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from test_learn import make_run

import grpo.learner
from grpo.config import ConfigError, load_config
from grpo.layout import stage_dir
from grpo.storage import latest_committed, open_storage
from stages import stage_function


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


def test_sampler_log_probs_give_the_recomputed_update_without_the_scoring_pass(storage, monkeypatch):
    passes = []
    score = grpo.learner.score
    whole = lambda *a, groups=None, **k: passes.append(groups is None) or score(*a, groups=groups, **k)  # noqa: E731
    monkeypatch.setattr(grpo.learner, "score", whole)  # a pass over the whole batch; not the weights' probe
    out = {}
    for mode in ("recompute", "sampler"):
        make_run(storage, mode, extra=[f"learn.old_logprobs={mode}"])
        before = sum(passes)
        out[mode] = stage_function("learn")(storage, mode, 0)
        out[mode + " passes"] = sum(passes) - before
    assert out["recompute passes"] == 1 and out["sampler passes"] == 0  # no KL: no reference pass either

    base = load_file(
        latest_committed(storage, stage_dir(storage, "sampler", None, "base")).path("policy/model.safetensors")
    )
    w = {mode: load_file(out[mode].path("policy/model.safetensors")) for mode in ("recompute", "sampler")}
    d1, d2 = (torch.cat([(w[m][k] - base[k]).flatten() for k in sorted(base)]) for m in ("recompute", "sampler"))
    assert d1.norm() > 1e-3
    assert (d1 - d2).norm() / d1.norm() < 1e-3, ((d1 - d2).norm() / d1.norm()).item()
    m1, m2 = (pd.read_parquet(out[m].path("metrics.parquet")) for m in ("recompute", "sampler"))
    assert m1.loss.tolist() == pytest.approx(m2.loss.tolist(), rel=1e-4, abs=1e-6)
    assert out["sampler"].manifest.summary["logprob_gap"] == 0.0  # pi_old is the sampler's, by construction


@pytest.mark.parametrize("guard", ["learn.importance_correction=tis", "learn.max_logprob_gap=0.1"])
def test_sampler_log_probs_refuse_the_guards_that_compare_them_with_the_learners(guard):
    with pytest.raises(ConfigError, match="learn.old_logprobs=sampler takes pi_old from the sampler"):
        load_config(None, ["learn.old_logprobs=sampler", guard])
