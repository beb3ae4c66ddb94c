"""The teacher and a local judge on vLLM (teacher.backend, reward.judge.backend): one run whose teacher and judge are
one tiny checkpoint (head_dim 32, as vLLM's CPU attention needs), so one engine start serves both. The vLLM teacher's
committed log-probs and top-k equal a plain transformers forward of the committed ids; the vLLM judge's answers are
transformers' greedy answers wherever no near-tie lets two float32 implementations part, its rows are committed as
the transformers judge's are, and a rerun asks its cache only. Left at auto, neither setting enters an identity."""

import importlib.util
import re

import pandas as pd
import pytest
import torch
from test_teacher import TINY, teacher_folder
from transformers import AutoModelForCausalLM

from grpo.config import ConfigError, check_judge_folder, load_config
from grpo.record.storage import open_storage
from grpo.sampling.engines import close_generators
from grpo.scoring import judge as judge_engine
from grpo.scoring.teacher import check_teachers
from grpo.tiny_model import EOS_ID
from stages import rewards, stage_function, teacher
from stages.init import init_run

installed = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
TOL = 1e-4  # float32 log-probs of two implementations (measured: 5e-7 apart on this model)
TOP_K = 3


def settings(folder: str) -> list[str]:
    judge = [f"reward.judge.model={folder}", "reward.judge.backend=vllm", "reward.judge.max_tokens=6"]
    return (
        TINY
        + [f"teacher.model={folder}", "teacher.backend=vllm", f"teacher.top_k={TOP_K}", "reward.weights=[1, 1]"]
        + judge
    )


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """Iteration 0 of a run sampled (transformers) and scored by a vLLM teacher and a vLLM judge."""
    tmp = tmp_path_factory.mktemp("vllm-scoring")
    folder = teacher_folder(tmp / "teacher", max_position_embeddings=256)  # room for a judge's prompt
    storage = open_storage((tmp / "store").as_uri())
    init_run(storage, "v", load_config(None, settings(folder)))
    out = {name: stage_function(name)(storage, "v", 0) for name in ("snapshot", "rollouts", "rewards", "teacher")}
    yield storage, folder, out
    close_generators()


def frame(committed, name: str) -> pd.DataFrame:
    return pd.read_parquet(committed.storage.uri(committed.path(name))).sort_values(["prompt_id", "sample_index"])


def logprobs(model, ids: list[int]) -> torch.Tensor:
    """(T, V) float64 log-probs of a plain forward of one unpadded sequence: row t predicts token t + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


@pytest.mark.vllm
@installed
def test_the_vllm_teacher_commits_the_transformers_log_probs_of_the_committed_ids(scored):
    storage, folder, out = scored
    ro, te = frame(out["rollouts"], "rollouts.parquet"), frame(out["teacher"], "teacher.parquet")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    near_ties = 0
    for r, t in zip(ro.itertuples(), te.itertuples()):
        p, ids = len(r.prompt_ids), list(r.prompt_ids) + list(r.response_ids)
        logp = logprobs(model, ids)[p - 1 : -1]  # (R, V): each response token's distribution
        want = logp.gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0].masked_fill(
            ~torch.tensor(r.loss_mask, dtype=torch.bool), 0.0
        )
        assert t.teacher_logprobs == pytest.approx(want.tolist(), abs=TOL)
        top = logp[torch.tensor(r.loss_mask, dtype=torch.bool)].topk(TOP_K + 1, -1)  # one more: the k-th's neighbour
        assert len(t.topk_ids) == len(top.indices) == sum(r.loss_mask)
        for got_ids, got_lp, tail, ref_lp, ref_ids in zip(
            t.topk_ids, t.topk_logprobs, t.topk_tail, top.values, top.indices
        ):
            assert list(got_lp) == pytest.approx(ref_lp[:TOP_K].tolist(), abs=TOL)  # the values, whatever ties' order
            assert tail == pytest.approx(1 - ref_lp[:TOP_K].exp().sum().item(), abs=TOL)
            gaps = (ref_lp[:-1] - ref_lp[1:]).tolist()  # gap j: between rank j and rank j + 1
            for j in range(TOP_K):
                if gaps[j] > TOL and (j == 0 or gaps[j - 1] > TOL):  # rank j is no near-tie: the same id
                    assert got_ids[j] == ref_ids[j].item()
                else:
                    near_ties += 1
    assert near_ties < te.topk_ids.map(len).sum()  # the ids were compared, not all skipped
    summary = out["teacher"].manifest.summary
    assert summary["teachers"][folder]["backend"] == "vllm (teacher.backend)"


@pytest.mark.vllm
@installed
def test_the_vllm_judge_answers_as_the_transformers_judge_and_reruns_from_its_cache(scored, tmp_path):
    storage, folder, out = scored
    cfg = load_config(None, settings(folder))
    ro = frame(out["rollouts"], "rollouts.parquet")
    rows = ro[["prompt_id", "sample_index", "prompt", "response", "ground_truth"]].to_dict("records")
    committed = frame(out["rewards"], "judge.parquet")
    assert out["rewards"].manifest.summary["judged_on"] == "vllm (reward.judge.backend)"
    assert committed[["judge_revision", "prompt_hash", "raw", "score", "attempts"]].notna().all().all()
    # the transformers judge on the same rows, its own cache (another storage)
    hf_cfg = load_config(None, [*settings(folder), "reward.judge.backend=hf"]).reward.judge
    hf, _ = judge_engine.judged(open_storage((tmp_path / "hf").as_uri()), hf_cfg, rows)
    # the vLLM judge's answer ids, again: each token transformers' greedy choice, up to near-ties
    judge = judge_engine.make_judge(cfg.reward.judge, cfg.rollout)
    messages = [m for m, _, _ in judge_engine._calls(cfg.reward.judge, rows)]
    prompts = [judge.prompt_ids(m) for m in messages]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    exact, answers = 0, judge.generated(prompts)
    assert sum(map(len, answers)) > 2 * len(answers)  # answers of several tokens, not an eos each
    for i, (p, answer) in enumerate(zip(prompts, answers)):
        assert answer[-1] == EOS_ID or len(answer) == cfg.reward.judge.max_tokens
        logp = logprobs(model, p + answer)[len(p) - 1 : -1]  # (A, V)
        top2 = logp.topk(2, -1).values
        chosen = logp.gather(-1, torch.tensor(answer)[:, None])[:, 0]
        assert (chosen >= top2[:, 0] - TOL).all()  # greedy, within float32's reach
        if ((top2[:, 0] - top2[:, 1]) > TOL).all():  # no near-tie on the way: transformers answered the same
            exact += 1
            row = committed.iloc[i]  # rubric: a call per row, in row order
            assert row.raw == hf[i]["raw"] and row.score == hf[i]["score"] and row.error == hf[i]["error"]
            assert row.prompt_hash == hf[i]["prompt_hash"] and row.judge_revision == hf[i]["judge_revision"]
    assert exact > len(prompts) // 2, exact
    _, counts = judge_engine.judged(storage, cfg.reward.judge, rows, judge)  # the run's storage: its cache
    assert counts["calls"] == 0 and counts["cached"] == committed.prompt_hash.nunique()  # a repeated response: one call


def test_backends_left_at_auto_stay_out_of_identities():
    base = load_config(None, TINY + ["teacher.model=t", "reward.judge.model=j", "reward.weights=[1, 1]"])
    assert "backend" not in teacher.stage_config(base)["teacher"]
    assert "backend" not in rewards.stage_config(base)["reward"]["judge"]
    chosen = load_config(None, TINY + ["teacher.model=t", "teacher.backend=hf", "reward.judge.model=j",
                                       "reward.judge.backend=vllm", "reward.weights=[1, 1]"])  # fmt: skip
    assert teacher.stage_config(chosen)["teacher"]["backend"] == "hf"
    assert rewards.stage_config(chosen)["reward"]["judge"]["backend"] == "vllm"


@pytest.mark.parametrize(
    "bad, says",
    [
        (["teacher.model=t", "teacher.backend=gpu"], "teacher.backend: 'gpu' is not one of"),
        (["reward.judge.model=j", "reward.judge.backend=gpu", "reward.weights=[1, 1]"], "reward.judge.backend: 'gpu'"),
        (
            ["reward.judge.url=http://x/v1", "reward.judge.model_name=m", "reward.judge.backend=vllm"],
            "reward.judge.backend goes with reward.judge.model",
        ),
    ],
)
def test_bad_backend_settings_are_refused_naming_the_field(bad, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(None, TINY + bad)


def test_a_vllm_backend_without_vllm_installed_is_refused_at_init(tmp_path, monkeypatch):
    folder = teacher_folder(tmp_path / "t")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    judge = load_config(None, [f"reward.judge.model={folder}", "reward.judge.backend=vllm", "reward.weights=[1, 1]"])
    with pytest.raises(ConfigError, match="reward.judge.backend=vllm: vLLM is not installed"):
        check_judge_folder(judge.reward.judge)
    taught = load_config(None, [f"teacher.model={folder}", "teacher.backend=vllm"])
    with pytest.raises(ConfigError, match="teacher.backend=vllm: teacher.model .*: vLLM is not installed"):
        check_teachers(taught.teacher, folder)
    check_teachers(load_config(None, [f"teacher.model={folder}"]).teacher, folder)  # auto: transformers then
