"""On-policy distillation (the `teacher` section, stages/teacher.py): the teacher's log-probs are a plain forward of the
committed ids, the per-token reverse-KL advantages by hand, the learner's loss with (B, T) advantages per token, an
iteration end to end, a teacher of another tokenizer refused at init, a rescore with another teacher that samples
nothing, staleness, a student whose reverse KL to its teacher falls, and the flow's force_stage and placement taking
the stage where a run has a teacher (refused in one line where it has none)."""

import json
import math
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from grpo import core
from grpo.config import ConfigError, load_config
from grpo.record.layout import STAGES, run_json, stage_dir, stages_of
from grpo.record.storage import committed_attempts, latest_committed, load_manifest, open_storage
from grpo.scoring import teacher as engine
from grpo.tiny_model import build_for_task, build_tiny_model
from stages import stage_function
from stages.init import init_run
from stages.iteration import run_iteration
from stages.rescore import rescore

TINY = [
    "rollout.backend=hf",
    "rollout.prompts_per_iteration=8",
    "rollout.group_size=4",
    "learn.minibatch_size=32",
    "learn.microbatch_size=16",
    "eval.n_prompts=8",
    "model.hidden_size=64",
    "model.num_heads=2",
    "model.intermediate_size=128",
    "reward.workers=1",
    "learn.epochs=1",
    "learn.lr_decay_steps=0",
    "rollout.max_tokens=8",
]
SHAPE = dict(hidden_size=64, num_heads=2, intermediate_size=128)


def teacher_folder(path, seed=7, **fields) -> str:
    """A tiny model of the sort task's vocabulary (the student's tokenizer files), other weights than the student's."""
    return build_for_task(str(path), "sort", seed=seed, **{**SHAPE, **fields})


def frame(committed, name: str) -> pd.DataFrame:
    return pd.read_parquet(committed.storage.uri(committed.path(name))).sort_values(["prompt_id", "sample_index"])


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    """A run distilled from a fixed teacher (mode add, top-k stored and trained on: GKD), one iteration committed."""
    tmp = tmp_path_factory.mktemp("teacher")
    storage = open_storage((tmp / "store").as_uri())
    extra = [f"teacher.model={teacher_folder(tmp / 'teacher')}", "teacher.mode=add", "teacher.coef=0.5"]
    init_run(
        storage,
        "d",
        load_config(None, TINY + extra + ["teacher.top_k=3", "teacher.batch_size=3", "teacher.gkd_coef=0.5"]),
    )
    return storage, tmp, run_iteration(storage, "d", 0)


def test_teacher_logprobs_are_a_plain_forward_of_the_committed_ids(taught):
    storage, tmp, out = taught
    assert list(out) == ["snapshot", "rollouts", "rewards", "teacher", "advantages", "learn", "eval"]
    ro, te = frame(out["rollouts"], "rollouts.parquet"), frame(out["teacher"], "teacher.parquet")
    model = AutoModelForCausalLM.from_pretrained(str(tmp / "teacher"), dtype=torch.float32).eval()
    for r, t in zip(ro.itertuples(), te.itertuples()):
        ids = torch.tensor([list(r.prompt_ids) + list(r.response_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)  # one sequence, no padding
        p = len(r.prompt_ids)
        want = [logp[p + j - 1, tok].item() for j, tok in enumerate(r.response_ids)]
        assert t.teacher_logprobs == pytest.approx(want, abs=1e-5)
        assert len(t.topk_ids) == sum(r.loss_mask) and all(len(k) == 3 for k in t.topk_ids)
        for j, (ids_k, lps_k, tail) in enumerate(zip(t.topk_ids, t.topk_logprobs, t.topk_tail)):
            top = logp[p + j - 1].topk(3)
            assert list(ids_k) == top.indices.tolist() and lps_k == pytest.approx(top.values.tolist(), abs=1e-5)
            assert tail == pytest.approx(1 - top.values.exp().sum().item(), abs=1e-5)
    summary = out["teacher"].manifest.summary
    [(spec, pin)] = summary["teachers"].items()
    assert spec == str(tmp / "teacher") and pin["revision"].startswith("files:") and len(pin["vocabulary"]) == 64
    tokens = [(s - t) for r, te_ in zip(ro.itertuples(), te.itertuples())
              for s, t in zip(r.sampler_logprobs, te_.teacher_logprobs)]  # fmt: skip
    assert summary["reverse_kl"] == pytest.approx(sum(tokens) / len(tokens), rel=1e-4)


def test_token_advantages_are_the_reverse_kl_plus_the_group_advantage(taught):
    storage, _, out = taught
    ro, te = frame(out["rollouts"], "rollouts.parquet"), frame(out["teacher"], "teacher.parquet")
    ad, ta = frame(out["advantages"], "advantages.parquet"), frame(out["advantages"], "token_advantages.parquet")
    for r, t, a, tok in zip(ro.itertuples(), te.itertuples(), ad.itertuples(), ta.itertuples()):
        want = [a.advantage - 0.5 * (s - lt) for s, lt in zip(r.sampler_logprobs, t.teacher_logprobs)]
        assert tok.token_advantage == pytest.approx(want, abs=1e-5)
    assert out["learn"].manifest.inputs["advantages"] == out["advantages"].ref()
    assert out["learn"].manifest.inputs["teacher"] == out["teacher"].ref()  # GKD's top-k (teacher.gkd_coef)
    assert 0 < out["learn"].manifest.summary["gkd_kl"] < 50


def test_gkd_top_k_forward_kl_by_hand():
    student = torch.log(torch.tensor([[[0.4, 0.2], [0.7, 0.1]]]))  # (1, 2, 2): two tokens, top 2
    teacher = torch.log(torch.tensor([[[0.5, 0.3], [0.6, 0.3]]]))
    tail = torch.tensor([[0.2, 0.1]])
    want = [
        0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.2) + 0.2 * math.log(0.2 / 0.4),
        0.6 * math.log(0.6 / 0.7) + 0.3 * math.log(0.3 / 0.1) + 0.1 * math.log(0.1 / 0.2),
    ]
    assert core.topk_forward_kl(student, teacher, tail)[0].tolist() == pytest.approx(want, abs=1e-6)
    with pytest.raises(ConfigError, match="teacher.gkd_coef must be >= 0 and needs teacher.top_k"):
        load_config(None, ["teacher.model=t", "teacher.gkd_coef=1"])


def test_teacher_advantages_by_hand():
    sampler = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, 0.0]])
    teacher = torch.tensor([[-0.5, -3.0, -0.5], [-1.1, -0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    group = torch.tensor([1.0, -2.0])
    alone = core.teacher_advantages(sampler, teacher, mask, group, "reverse_kl", 1.0)
    assert alone.tolist() == [[0.5, -1.0, 0.0], [-1.0, 0.0, 0.0]]
    added = core.teacher_advantages(sampler, teacher, mask, group, "add", 2.0)
    assert added.tolist() == [[2.0, -1.0, 1.0], [-4.0, -2.0, 0.0]]
    with pytest.raises(ValueError, match="unknown teacher mode 'kl'"):
        core.teacher_advantages(sampler, teacher, mask, group, "kl", 1.0)


def test_the_loss_with_token_advantages_is_a_loop_per_token():
    torch.manual_seed(0)
    logp, old = -torch.rand(3, 5) * 2, -torch.rand(3, 5) * 2
    adv, mask = torch.randn(3, 5), (torch.rand(3, 5) > 0.2).float()
    logp.requires_grad_(True)
    spec = core.LossSpec(loss_type="grpo_clip", agg_mode="token_mean", clip_eps=0.2)
    loss, _ = core.grpo_microbatch_step(spec, logp, mask, gradient_accumulation_steps=1, advantages=adv,
                                        old_logprobs=old)  # fmt: skip
    total, n = 0.0, 0
    for b in range(3):
        for t in range(5):
            if mask[b, t]:
                ratio = torch.exp(logp[b, t] - old[b, t]).item()
                a = adv[b, t].item()
                total += -min(ratio * a, min(max(ratio, 0.8), 1.2) * a)
                n += 1
    assert loss.item() == pytest.approx(total / n, abs=1e-6)
    with pytest.raises(ValueError, match="gspo"):
        core.policy_gradient_loss("gspo", logp, loss_mask=mask, advantages=adv, old_logprobs=old)


def test_settings_that_cannot_take_token_advantages_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match="learn.loss_type=gspo with teacher"):
        load_config(None, ["teacher.model=t", "learn.loss_type=gspo"])
    with pytest.raises(ConfigError, match="teacher.model: name the teacher"):
        load_config(None, ["teacher.coef=2"])
    with pytest.raises(ConfigError, match="teacher.coef=0 needs teacher.gkd_coef > 0"):
        load_config(None, ["teacher.model=t", "teacher.coef=0"])
    with pytest.raises(ConfigError, match="teacher.coef must be >= 0"):
        load_config(None, ["teacher.model=t", "teacher.coef=-1"])
    pure_gkd = load_config(None, ["teacher.model=t", "teacher.coef=0", "teacher.top_k=4", "teacher.gkd_coef=1"])
    assert pure_gkd.teacher.coef == 0  # TRL's beta=0: the forward KL alone
    with pytest.raises(ConfigError, match="teacher.routes and teacher.route_column go together"):
        load_config(None, ["teacher.model=t", "teacher.routes={a: b}"])
    cfg = load_config(None, [])
    assert cfg.teacher is None and "teacher" not in cfg.to_dict() and stages_of(cfg) == STAGES


def test_init_refuses_a_teacher_of_another_tokenizer_in_one_line(tmp_path):
    storage = open_storage((tmp_path / "store").as_uri())
    other = build_tiny_model(str(tmp_path / "other"), ["a", "b", "c"], **SHAPE)  # another vocabulary
    with pytest.raises(ConfigError) as e:
        init_run(storage, "x", load_config(None, TINY + [f"teacher.model={other}"]))
    assert str(e.value).startswith(f"teacher.model {other}: its tokenizer's vocabulary") and "\n" not in str(e.value)
    assert not storage.exists(run_json(storage, "x"))  # nothing written


def test_a_rescore_with_another_teacher_samples_nothing(taught):
    storage, tmp, _ = taught
    foreign = build_tiny_model(str(tmp / "foreign"), ["a", "b", "c"], **SHAPE)  # another vocabulary: refused first
    with pytest.raises(ConfigError, match="its tokenizer's vocabulary"):
        rescore(storage, "d", 0, 0, [f"teacher.model={foreign}"], "d3")
    assert not storage.exists(run_json(storage, "d3"))
    other = teacher_folder(tmp / "teacher2", seed=11)
    rescore(storage, "d", 0, 0, [f"teacher.model={other}"], "d2")
    rollouts = [load_manifest(storage, a, verify=False)[0] for a in committed_attempts(storage, stage_dir(
        storage, "d2", 0, "rollouts"))]  # fmt: skip
    assert len(rollouts) == 1 and rollouts[0].origin is not None  # the parent's, by reference: nothing sampled
    scored = latest_committed(storage, stage_dir(storage, "d2", 0, "teacher"))
    assert scored.manifest.origin is None and list(scored.manifest.summary["teachers"]) == [other]
    parent = latest_committed(storage, stage_dir(storage, "d", 0, "teacher"))
    assert scored.manifest.inputs["rollouts"].manifest_sha256 != parent.manifest.inputs["rollouts"].manifest_sha256
    same = frame(parent, "teacher.parquet").teacher_logprobs.map(list)
    assert not (frame(scored, "teacher.parquet").teacher_logprobs.map(list) == same).all()
    assert json.loads(storage.read_bytes(run_json(storage, "d2")))["config"]["teacher"]["model"] == other


def sharpened(folder, cfg, scale: float) -> str:
    """The run's own base model (the tiny model its config builds) at temperature 1 / scale: the final norm's weight
    times `scale` multiplies every logit by it. A teacher the student can reach (by sharpening its distribution) and
    far enough at first to show it."""
    build_for_task(str(folder), cfg.task.name, cfg.task.params, cfg.model, cfg.seed)
    weights = load_file(f"{folder}/model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * scale
    save_file(weights, f"{folder}/model.safetensors", metadata={"format": "pt"})
    return str(folder)


def test_with_staleness_the_teacher_scores_the_tokens_as_sampled_and_distillation_lowers_the_reverse_kl(tmp_path):
    """A student distilled (mode reverse_kl) from a fixed teacher, itself at a third of the temperature, sampling one
    policy behind (rollout.staleness=1): each iteration's teacher stage reads the rollouts alone (no policy) and scores
    the ids as the older policy sampled them, and the reverse KL it records falls well below where it started."""
    storage = open_storage((tmp_path / "store").as_uri())
    extra = ["rollout.staleness=1", "learn.lr=1e-3", "rollout.prompts_per_iteration=32", "eval.every=100"]
    teacher = sharpened(tmp_path / "teacher", load_config(None, TINY + extra), 3.0)
    init_run(storage, "s", load_config(None, TINY + extra + [f"teacher.model={teacher}"]))
    kl = []
    for k in range(6):
        out = run_iteration(storage, "s", k, last=False)
        assert set(out["teacher"].manifest.inputs) == {"rollouts"}
        kl.append(out["teacher"].manifest.summary["reverse_kl"])
    ro, te = frame(out["rollouts"], "rollouts.parquet"), frame(out["teacher"], "teacher.parquet")
    assert set(ro.policy_version) == {3}  # iteration 5 sampled with learn 3's policy (rollout.staleness=1)
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    for r, t in list(zip(ro.itertuples(), te.itertuples()))[:4]:  # the ids as that older policy sampled them
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([list(r.prompt_ids) + list(r.response_ids)])).logits[0], -1)
        want = [logp[len(r.prompt_ids) + j - 1, tok].item() for j, tok in enumerate(r.response_ids)]
        assert t.teacher_logprobs == pytest.approx(want, abs=1e-5)
    assert sum(kl[4:]) / 2 < 0.6 * sum(kl[:2]) / 2, kl  # measured: 0.48, 0.43 at first; 0.14, 0.21 after 4 updates


def test_several_teachers_routed_by_a_dataset_column(tmp_path):
    rows = [{"prompt": f"sort {i % 10} 3 1 :", "ground_truth": f"1 3 {i % 10}", "kind": "ab"[i % 2]} for i in range(40)]
    (tmp_path / "sort.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, second = teacher_folder(tmp_path / "t1", seed=1), teacher_folder(tmp_path / "t2", seed=2)
    storage = open_storage((tmp_path / "store").as_uri())
    extra = [f"task.dataset={tmp_path / 'sort.jsonl'}", f"teacher.model={first}", "teacher.route_column=kind"]
    init_run(storage, "r", load_config(None, TINY + extra + [f"teacher.routes={{b: {second}}}"]))
    for stage in ("snapshot", "rollouts", "rewards", "teacher"):
        out = stage_function(stage)(storage, "r", 0)
    ro, te = (
        frame(latest_committed(storage, stage_dir(storage, "r", 0, "rollouts")), "rollouts.parquet"),
        frame(out, "teacher.parquet"),
    )
    kinds = ro.row.map(lambda r: json.loads(r)["kind"])
    assert set(kinds) == {"a", "b"} and list(te.teacher) == [{"a": first, "b": second}[k] for k in kinds]
    models = {m: AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32).eval() for m in (first, second)}
    for r, t in list(zip(ro.itertuples(), te.itertuples()))[:8]:
        with torch.no_grad():
            ids = torch.tensor([list(r.prompt_ids) + list(r.response_ids)])
            logp = torch.log_softmax(models[t.teacher](ids).logits[0], -1)
        want = [logp[len(r.prompt_ids) + j - 1, tok].item() for j, tok in enumerate(r.response_ids)]
        assert t.teacher_logprobs == pytest.approx(want, abs=1e-5)
    assert set(out.manifest.summary["teachers"]) == {first, second}


def test_gkd_step_is_the_forward_kl_of_a_plain_forward_over_the_teachers_top_k(taught, monkeypatch):
    """The learner's GKD term on the committed batch (load_batch: rollouts, token advantages, the teacher's top-k) with
    the base model as the student, its top-k log-probs gathered from the policy-gradient loss's own forward
    (forward_logprobs' topk, PolicyLM training as the learner does): the token mean of topk_forward_kl, the
    student's log-probs from one unpadded forward a sample; the sampled tokens' log-probs are the plain forward's."""
    from grpo.learner.loop import gkd_term
    from grpo.learner.model import PolicyLM, forward_logprobs
    from grpo.record.checkpoint import local_checkpoint
    from grpo.record.lineage import committed_input
    from stages.learn_data import load_batch

    storage, _, out = taught
    batch = load_batch(storage, out["rollouts"], out["advantages"], 0, 4, {"teacher": out["teacher"]})
    student = AutoModelForCausalLM.from_pretrained(
        local_checkpoint(committed_input(storage, "d", None, "base")), dtype=torch.float32
    )
    groups = torch.tensor([0, 1])
    rows = batch.rows(groups)
    packed_calls, packed_path = [], PolicyLM._packed
    monkeypatch.setattr("grpo.learner.model.PACK_MIN_SAVING", 0.0)  # pack whatever it saves
    monkeypatch.setattr(PolicyLM, "_packed", lambda self, *a: packed_calls.append(1) or packed_path(self, *a))
    got = {}  # padding_free: the responses packed into shared rows (the path that gathers them apart), else a row each
    for packed in (False, True):
        logp, _, student_topk = forward_logprobs(
            PolicyLM(student, padding_free=packed).train(), batch, groups, topk=True
        )
        got[packed] = gkd_term(batch, rows, student_topk, batch.loss_mask[rows]).item()
    total, n = 0.0, 0
    for r in rows.tolist():
        prompt = batch.prompt_ids[r // 4][batch.prompt_mask[r // 4].bool()]
        length = int(batch.response_mask[r].sum())
        with torch.no_grad():
            logits = student(torch.cat([prompt, batch.response_ids[r, :length]])[None]).logits[0]
        plain = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + length], -1)  # (L, V)
        sampled = plain.gather(-1, batch.response_ids[r, :length, None])[:, 0]
        assert logp[rows.tolist().index(r), :length].tolist() == pytest.approx(sampled.tolist(), abs=1e-5)
        for t in range(length):
            if batch.loss_mask[r, t]:
                s = plain[t, batch.topk_ids[r, t]][None, None]
                kl = core.topk_forward_kl(s, batch.topk_logprobs[r, t][None, None], batch.topk_tail[r, t][None, None])
                total, n = total + kl.item(), n + 1
    assert got == {False: pytest.approx(total / n, abs=1e-5), True: pytest.approx(total / n, abs=1e-5)}
    assert packed_calls  # padding_free's forward took the packed path


def test_a_cpu_teacher_is_kept_warm_between_stages_by_folder_and_revision(tmp_path):
    """warm_model: the same model object for the same folder, revision and CPU device (no load per teacher stage);
    another revision (changed files) loads again and replaces it."""
    folder, cpu = teacher_folder(tmp_path / "t"), torch.device("cpu")
    first = engine.warm_model(folder, "files:a", cpu)
    assert engine.warm_model(folder, "files:a", cpu) is first
    other = engine.warm_model(folder, "files:b", cpu)
    assert other is not first and engine.warm_model(folder, "files:b", cpu) is other
    assert engine.warm_model(folder, "files:a", cpu) is not first  # one kept: the last one asked for


def test_the_flow_runs_the_teacher_between_rewards_and_advantages(prefect_api, tmp_path):
    """The Prefect flow `grpo` with a teacher section: the teacher task runs (sample's optional step) and the
    advantages it commits read that teacher attempt."""
    from flows.grpo import grpo

    url = (tmp_path / "store").as_uri()
    grpo(run_id="f", iteration=0, overrides=TINY + [f"teacher.model={teacher_folder(tmp_path / 't')}"], storage_url=url)
    storage = open_storage(url)
    taught, adv = (latest_committed(storage, stage_dir(storage, "f", 0, s)) for s in ("teacher", "advantages"))
    assert adv.manifest.inputs["teacher"] == taught.ref() and taught.manifest.summary["samples"] == 32
    assert committed_attempts(storage, stage_dir(storage, "f", 0, "eval"))  # the iteration finished


def test_the_flow_forces_the_teacher_stage_where_the_run_has_one_and_refuses_it_in_one_line_where_not(
    prefect_api, tmp_path
):
    from flows.grpo import grpo

    url = (tmp_path / "store").as_uri()
    storage = open_storage(url)
    grpo(run_id="f", iteration=0, overrides=TINY + [f"teacher.model={teacher_folder(tmp_path / 't')}"], storage_url=url)
    order = stages_of(load_config(None, TINY + ["teacher.model=t"]))

    def attempts() -> dict[str, list[str]]:
        return {s: committed_attempts(storage, stage_dir(storage, "f", 0, s)) for s in order}

    before = attempts()
    grpo(run_id="f", iteration=0, storage_url=url, force_stage="teacher")
    after = attempts()
    assert [s for s in order if after[s] != before[s]] == ["teacher", "advantages", "learn", "eval"]
    assert all(len(after[s]) == len(before[s]) + 1 for s in ("teacher", "advantages", "learn", "eval"))
    for parameter, given in (
        ("force_stage", {"force_stage": "teacher"}),
        ("placement", {"placement": {"teacher": "warm"}}),
    ):
        state = grpo(run_id="plain", overrides=TINY, storage_url=url, return_state=True, **given)  # no teacher section
        assert state.is_failed() and "\n" not in state.message, state.message
        assert f"{parameter}: stage 'teacher' runs only in a run whose config sets the teacher section" in state.message
        assert not storage.exists(run_json(storage, "plain"))  # refused before anything is written


def test_the_teacher_stage_is_placed_on_a_pool_as_any_stage(taught, monkeypatch):
    """Routing only (no worker): check_placement takes `teacher`, the deployment's flow grpo-stage accepts it as its
    `stage` parameter, and Placement sends it (forced, here) to its pool's deployment."""
    import prefect.deployments

    from flows.placement import Placement, check_placement, stage_flow
    from stages.common import load_run

    storage, _, out = taught
    check_placement({"teacher": "warm", "rollouts": "warm"})  # warm: no pool looked up
    with pytest.raises(ConfigError, match=r"^placement: unknown stage\(s\) \['teachers'\]; stages: .*'teacher'"):
        check_placement({"teachers": "warm"})
    params = {"storage_url": storage.url, "run_id": "d", "iteration": 7, "stage": "teacher"}
    assert stage_flow.validate_parameters(params)["stage"] == "teacher"
    sent = []
    monkeypatch.setattr(
        prefect.deployments,
        "run_deployment",
        lambda name, **k: sent.append((name, k["parameters"])) or SimpleNamespace(id=1),
    )
    monkeypatch.setattr(Placement, "wait_flow_runs", lambda self, stage, runs, *_: "done")
    at = Placement({"teacher": "gpu"}, storage, "d", 7, load_run(storage, "d"), "teacher")
    assert at("teacher", out["rollouts"].uri) == "done"
    assert [(name, p["stage"], p["force"], p["upstream"]) for name, p in sent] == [
        ("grpo-stage/gpu", "teacher", True, out["rollouts"].uri)
    ]
