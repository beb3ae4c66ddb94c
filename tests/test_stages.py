"""Stages on a tiny model in tmp_path: commits, reuse, force, audits, failures and learning."""

import contextlib

import duckdb
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from test_learn import F32

from flows.cli import main
from grpo.config import ConfigError, load_config
from grpo.record import resume as state
from grpo.record.layout import stage_dir
from grpo.record.lineage import next_iteration
from grpo.record.storage import committed_attempts, latest_committed, list_attempts, open_storage
from stages import STAGES, StageError, stage_function
from stages.init import init_run
from stages.iteration import run_iteration

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
    # what these tests were written for, pinned: one epoch, a constant lr, cut-off responses scored 0
    "learn.epochs=1",
    "learn.lr=3e-3",
    "learn.lr_decay_steps=0",
    "reward.truncated_reward=0",
    "rollout.max_tokens=16",
    "model.initializer_range=0.02",
]


def make_run(storage, run_id="t", extra=()):
    cfg = load_config(None, TINY + list(extra))
    init_run(storage, run_id, cfg)
    return cfg


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


def test_one_iteration_commits_every_stage_readable_by_pandas_and_duckdb(storage):
    make_run(storage)
    out = run_iteration(storage, "t", 0)
    assert list(out) == list(STAGES)
    files = {
        "rollouts": "rollouts.parquet",
        "rewards": "rewards.parquet",
        "advantages": "advantages.parquet",
        "learn": "metrics.parquet",
        "eval": "eval.parquet",
    }
    for stage, name in files.items():
        uri = storage.uri(out[stage].path(name))
        df = pd.read_parquet(uri)
        assert len(df) > 0, stage
        assert duckdb.sql(f"SELECT count(*) FROM read_parquet('{uri[len('file://') :]}')").fetchall()[0][0] == len(df)
    ro = pd.read_parquet(storage.uri(out["rollouts"].path("rollouts.parquet")))
    assert len(ro) == 16 * 4 and ro.groupby("prompt_id").size().eq(4).all()
    assert (ro.response_ids.map(len) == ro.sampler_logprobs.map(len)).all()
    assert set(ro.finish_reason) <= {"stop", "length"}
    rw = ro.merge(
        pd.read_parquet(storage.uri(out["rewards"].path("rewards.parquet"))), on=["prompt_id", "sample_index"]
    )
    cut = rw[rw.finish_reason == "length"]
    assert len(cut) and (cut.reward == 0).all()  # reward.truncated_reward=0
    assert all(dict(c)["truncated"] == 1.0 for c in cut.components)
    assert all("truncated" not in dict(c) for c in rw[rw.finish_reason == "stop"].components)
    adv = pd.read_parquet(storage.uri(out["advantages"].path("advantages.parquet")))
    assert adv.groupby("prompt_id").advantage.sum().abs().max() < 1e-5  # normalized: zero-mean groups
    lp = pd.read_parquet(storage.uri(out["learn"].path("logprobs.parquet")))
    merged = ro.merge(lp, on=["prompt_id", "sample_index"])
    assert (merged.old_logprobs.map(len) == merged.response_ids.map(len)).all()
    # the learner's old log-probs are the sampler's (float32), up to numerics: the learner's precision's
    gap = max(abs(a - b) for x, y in zip(merged.old_logprobs, merged.sampler_logprobs) for a, b in zip(x, y))
    assert gap < {"no": 1e-3, "bf16": 5e-2}[out["learn"].manifest.summary["precision"]["autocast"]]
    # the new policy differs from the snapshot it started from
    snap = load_file(out["snapshot"].path("policy/model.safetensors"))
    new = load_file(out["learn"].path("policy/model.safetensors"))
    assert any(not torch.equal(snap[k], new[k]) for k in snap)
    assert out["snapshot"].manifest.file("policy/model.safetensors").uri  # referenced, not copied


@pytest.mark.precision_pinned
def test_rerun_is_noop_and_force_adds_attempt_without_touching_old(storage):
    make_run(storage)
    snap = stage_function("snapshot")(storage, "t", 0)
    first = stage_function("rollouts")(storage, "t", 0)
    before = storage.read_bytes(first.path("rollouts.parquet"))
    again = stage_function("rollouts")(storage, "t", 0)
    assert again.attempt_dir == first.attempt_dir
    forced = stage_function("rollouts")(storage, "t", 0, force=True)
    assert forced.attempt_dir != first.attempt_dir
    assert storage.read_bytes(first.path("rollouts.parquet")) == before
    assert len(list_attempts(storage, stage_dir(storage, "t", 0, "rollouts"))) == 2
    # same seeds, same sampler: the forced attempt reproduces the rows
    assert pd.read_parquet(storage.uri(forced.path("rollouts.parquet"))).equals(
        pd.read_parquet(storage.uri(first.path("rollouts.parquet")))
    )
    assert snap.manifest.identity == stage_function("snapshot")(storage, "t", 0).manifest.identity


@pytest.mark.precision_pinned
def test_missing_input_names_uri_and_command(storage):
    make_run(storage)
    with pytest.raises(StageError, match=r"rollouts.*grpo stage rollouts --run t --iteration 0"):
        stage_function("rewards")(storage, "t", 0)
    with pytest.raises(StageError, match="no such run"):
        stage_function("snapshot")(storage, "nope", 0)


@pytest.mark.precision_pinned
def test_config_errors_name_the_field():
    for bad, field in [
        (["rollout.group_size=1"], "rollout.group_size"),
        (["learn.minibatch_size=30"], "learn.minibatch_size"),
        (["learn.microbatch_size=2"], r"learn.microbatch_size \(2\) must be divisible by rollout.group_size"),
        (["model.initializer_range=0"], "model.initializer_range"),
        (["advantage.mode=zscore"], "advantage.mode"),
        (["rollout.backend=tgi"], "rollout.backend"),
        (["task.name=chess"], "valid tasks"),
        (["learn.clip_eps_high=-1"], "learn.clip_eps_high"),
        (["rollout.temperature=.nan"], "rollout.temperature: expected a finite number"),
        (["rollout.stop=5"], "rollout.stop: expected a list"),
        (["rollout.stop=[5]"], "rollout.stop: expected a list of strings"),
        (["learn.betas=[1,2,3]"], "learn.betas: expected two numbers"),
        (["learn.betas=5"], "learn.betas: expected two numbers"),
        (["learn.betas=[0.9, 1.5]"], r"learn.betas must each be in \[0, 1\)"),
        (["task.system_prompt=[1]"], None),  # a string setting takes the text as typed
        (["reward.weights=[1.0]"], "reward.weights has 1 weight"),
        (["task.name=math"], "task.dataset: task 'math' makes no prompts"),
        (["eval.samples_per_prompt=0"], "eval.samples_per_prompt"),
    ]:
        if field is None:
            assert load_config(None, TINY + bad)
            continue
        with pytest.raises(ConfigError, match=field):
            load_config(None, TINY + bad)


@pytest.mark.precision_pinned
@pytest.mark.parametrize("config", [None, {}, [], {"task": {}}, "x"])
def test_a_partial_or_damaged_run_json_is_refused(storage, config):
    import json

    make_run(storage)
    path = storage.path("runs", "t", "run.json")
    storage.fs.pipe_file(path, json.dumps({"run_id": "t", "config": config}).encode())
    with pytest.raises(StageError, match=r"run.json: config lacks .*edited or damaged"):
        stage_function("snapshot")(storage, "t", 0)


@pytest.mark.precision_pinned
def test_reward_errors_recorded_then_stage_fails_over_threshold(storage, monkeypatch):
    from grpo.tasks import sort

    real = sort.SortTask.reward

    def flaky(self, response, ground_truth, prompt):
        if hash(response) % 4 == 0:
            raise RuntimeError("boom")
        return real(self, response, ground_truth, prompt)

    monkeypatch.setattr(sort.SortTask, "reward", flaky)  # the fork pool inherits the patch
    make_run(storage, extra=["reward.max_error_fraction=1.0"])
    stage_function("snapshot")(storage, "t", 0)
    stage_function("rollouts")(storage, "t", 0)
    out = stage_function("rewards")(storage, "t", 0)
    df = pd.read_parquet(storage.uri(out.path("rewards.parquet")))
    errs = df[df.error.notna()]
    assert len(errs) and (errs.reward == 0).all() and errs.error.str.contains("RuntimeError: boom").all()
    assert out.manifest.summary["errors"] == len(errs)

    make_run(storage, "strict", extra=["reward.max_error_fraction=0.0"])
    stage_function("snapshot")(storage, "strict", 0)
    stage_function("rollouts")(storage, "strict", 0)
    with pytest.raises(StageError, match="max_error_fraction"):
        stage_function("rewards")(storage, "strict", 0)
    with pytest.raises(Exception, match="no committed attempt"):
        latest_committed(storage, stage_dir(storage, "strict", 0, "rewards"))


@pytest.mark.precision_pinned
def test_overlong_shaping_is_a_reward_component_a_query_shows(storage):
    """reward.overlong_buffer: each response's reward loses penalty * (length - (max_tokens - buffer)) / buffer
    past max_tokens - buffer tokens, after truncated_reward; the term is the component `overlong`."""
    from grpo.query import query
    from grpo.scoring.shaping import overlong_penalty

    make_run(storage, "o", extra=["reward.overlong_buffer=6", "reward.overlong_penalty=0.5"])  # max_tokens 16
    for s in ["snapshot", "rollouts", "rewards"]:
        out = stage_function(s)(storage, "o", 0)
    rw = pd.read_parquet(storage.uri(out.path("rewards.parquet"))).merge(
        pd.read_parquet(storage.uri(stage_function("rollouts")(storage, "o", 0).path("rollouts.parquet"))),
        on=["prompt_id", "sample_index"],
    )
    lengths, comps = rw.response_ids.map(len), rw.components.map(dict)
    terms = [overlong_penalty(n, 16, 6, 0.5) for n in lengths]
    assert [c["overlong"] for c in comps] == pytest.approx(terms)
    assert {round(t, 4) for t in terms} >= {0.0, -0.5}  # short responses and cut-off ones (length 16)
    base = [0.0 if fr == "length" else c["total"] for fr, c in zip(rw.finish_reason, comps)]  # truncated_reward=0
    assert rw.reward.tolist() == pytest.approx([b + t for b, t in zip(base, terms)])
    shown = query(
        storage, "o", "SELECT sum(components['overlong']) AS s, min(components['overlong']) AS m FROM rewards"
    )
    assert (shown.s[0], shown.m[0]) == pytest.approx((sum(terms), -0.5))


@pytest.mark.precision_pinned
def test_rewards_doctests():
    import doctest

    import grpo.runtime.pool
    import grpo.scoring.score
    import grpo.scoring.shaping

    results = [doctest.testmod(m) for m in (grpo.runtime.pool, grpo.scoring.score, grpo.scoring.shaping)]
    assert sum(r.attempted for r in results) >= 3 and not any(r.failed for r in results)


@pytest.mark.precision_pinned
def test_reward_timeout_is_recorded(storage, monkeypatch):
    import time

    from grpo.tasks import sort

    monkeypatch.setattr(sort.SortTask, "reward", lambda self, r, g, p: time.sleep(5))
    make_run(
        storage,
        extra=[
            "reward.timeout_s=0.05",
            "reward.max_error_fraction=1.0",
            "rollout.prompts_per_iteration=4",
            "learn.minibatch_size=16",
            "learn.microbatch_size=16",
        ],
    )
    stage_function("snapshot")(storage, "t", 0)
    stage_function("rollouts")(storage, "t", 0)
    df = pd.read_parquet(storage.uri(stage_function("rewards")(storage, "t", 0).path("rewards.parquet")))
    assert df.error.str.startswith("timeout").all()


@pytest.mark.precision_pinned
def test_score_batch_keeps_sample_order_across_jobs_and_times_out_one_sample_at_a_time(monkeypatch):
    import time

    import pyarrow as pa

    from grpo.config import RewardConfig
    from grpo.runtime.pool import _fork_pool
    from grpo.scoring.score import batch_items, score_batch, scorer_key
    from grpo.tasks import get_task, sort

    real = sort.SortTask.reward

    def slow_on_marker(self, response, ground_truth, prompt):
        if response == "slow":
            time.sleep(5)
        return real(self, response, ground_truth, prompt)

    monkeypatch.setattr(sort.SortTask, "reward", slow_on_marker)  # the fork pool inherits the patch
    task = get_task("sort")
    examples = task.generate(700, seed=0)  # 700 samples: 8 jobs of 88 for 2 workers
    responses = [e.ground_truth if i % 3 else "1 2" for i, e in enumerate(examples)]
    slow = {5, 6, 400}  # two in a row in one job, one in another
    for i in slow:
        responses[i] = "slow"
    batch = pa.RecordBatch.from_pydict(
        {
            "response": responses,
            "ground_truth": [e.ground_truth for e in examples],
            "prompt": [e.prompt for e in examples],
            "row": ["{}"] * len(examples),
        }
    )
    with _fork_pool(2) as pool:
        scored = score_batch(
            pool, scorer_key(load_config(), None), RewardConfig(workers=2, timeout_s=0.2), batch_items(batch)
        )
    assert len(scored) == 700
    for i, ((reward, components, error), e) in enumerate(zip(scored, examples)):
        if i in slow:
            assert (reward, components, error) == (0.0, {}, "timeout after 0.2s")
        else:  # the samples after a timeout in the same job still score, each with its own limit
            assert error is None and components == real(task, responses[i], e.ground_truth, e.prompt)
            assert reward == (1.0 if i % 3 else components["total"])


@pytest.mark.precision_pinned
def test_reward_pool_is_kept_only_while_warm_and_never_after_a_failure():
    import os

    from grpo.runtime.pool import _WarmPools

    pools = _WarmPools()
    pids = []
    for _ in range(2):  # cold: a pool per stage
        with pools.pool(1) as pool:
            pids.append(pool.apply(os.getpid))
    assert pids[0] != pids[1]
    with pools.keep():
        with pools.pool(1) as pool:
            warm = pool.apply(os.getpid)
        with pools.pool(1) as pool:
            assert pool.apply(os.getpid) == warm  # the same worker served the next stage
        with pytest.raises(RuntimeError):
            with pools.pool(1):
                raise RuntimeError("reward worker hung")
        with pools.pool(1) as pool:
            assert pool.apply(os.getpid) != warm  # the failed stage's pool is gone
    assert not pools._pools  # and leaving keep() closes what was kept


@pytest.mark.precision_pinned
def test_a_pool_failed_as_it_starts_is_terminated_despite_the_parents_sigterm_handler():
    """Prefect installs a SIGTERM handler that does not exit; a worker forked with it must not run
    it: a stage that fails as soon as its pool started terminates the pool, and terminate() waits
    for every worker to die (it hung the flow test that injects a reward fault)."""
    import signal
    import threading

    from grpo.runtime.pool import _WarmPools

    pools, done = _WarmPools(), threading.Event()

    def fail_at_once(times: int):
        for i in range(times):
            with pools.keep() if i % 2 else contextlib.nullcontext():  # warm and cold pools
                with pytest.raises(RuntimeError):
                    with pools.pool(2):
                        raise RuntimeError("the stage failed")
        done.set()

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        threading.Thread(target=fail_at_once, args=(20,), daemon=True).start()
        assert done.wait(120), "terminate() waits for a worker that survived SIGTERM"
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_nan_loss_fails_learn_and_commits_nothing(storage, monkeypatch):
    import grpo.core as core

    make_run(storage)
    for s in ["snapshot", "rollouts", "rewards", "advantages"]:
        stage_function(s)(storage, "t", 0)
    real = core.grpo_microbatch_step

    def nan_step(spec, logp, *a, **k):
        return real(spec, logp * float("nan"), *a, **k)

    monkeypatch.setattr(core, "grpo_microbatch_step", nan_step)
    with pytest.raises(StageError, match="non-finite"):
        stage_function("learn")(storage, "t", 0)
    assert list_attempts(storage, stage_dir(storage, "t", 0, "learn"))  # it started...
    with pytest.raises(Exception, match="no committed attempt"):  # ...and committed nothing
        latest_committed(storage, stage_dir(storage, "t", 0, "learn"))


def state_of(learned):
    """The resume state committed after learn `learned` (grpo.record.resume), once this process's commit is done."""
    state.wait()
    return state.committed_state(learned.storage, learned.manifest.run_id, learned)


def learned_files(learned) -> dict:
    """{file: the attempt listing it} of a learn and the state committed after it (grpo.record.resume)."""
    held = state_of(learned)
    return {f.path: c for c in (learned, held) if c is not None for f in c.manifest.files}


def learned_path(learned, name: str) -> str:
    """Where a file of learn `learned` or of its committed state lies."""
    return learned_files(learned)[name].path(name)


def test_optimizer_state_carries_to_next_iteration(storage):
    make_run(storage)
    run_iteration(storage, "t", 0)
    assert next_iteration(storage, "t") == 1
    out = run_iteration(storage, "t", 1)
    assert (
        out["learn"]
        .manifest.inputs["previous"]
        .uri.endswith(latest_committed(storage, stage_dir(storage, "t", 0, "learn")).attempt_dir.rsplit("/", 1)[1])
    )
    state0 = torch.load(state_of(latest_committed(storage, stage_dir(storage, "t", 0, "learn"))).path("optimizer.pt"))
    state1 = torch.load(state_of(out["learn"]).path("optimizer.pt"))
    steps = lambda s: next(iter(s["state"].values()))["step"].item()  # noqa: E731
    assert steps(state1) == 2 * steps(state0)  # AdamW continued counting


def test_lr_decays_over_the_run_across_iterations(storage):
    """lr decays with AdamW's step count, which optimizer.pt carries into the next iteration."""
    make_run(storage, "decay", extra=["learn.minibatch_size=16", "learn.lr=0.004", "learn.lr_decay_steps=8"])
    lrs = []
    for k in range(2):  # 64 samples / 16 = 4 steps an iteration
        out = run_iteration(storage, "decay", k)
        lrs += pd.read_parquet(out["learn"].path("metrics.parquet"))["lr"].tolist()
    assert lrs == pytest.approx([0.004 * (1 - s / 8) for s in range(8)])


@pytest.mark.precision_pinned
@pytest.mark.parametrize("agg_mode", ["seq_mean_token_mean", "token_mean"])
def test_two_processes_give_the_same_update_as_one(storage, agg_mode):
    """token_mean: each rank's tokens differ, and the minibatch's token count divides them all (grpo.core)."""
    for run_id, nproc in [("one", 1), ("two", 2)]:
        make_run(storage, run_id, extra=[f"learn.num_processes={nproc}", f"learn.agg_mode={agg_mode}", F32])
        for s in ["snapshot", "rollouts", "rewards", "advantages", "learn"]:
            stage_function(s)(storage, run_id, 0)
    one = latest_committed(storage, stage_dir(storage, "one", 0, "learn"))
    two = latest_committed(storage, stage_dir(storage, "two", 0, "learn"))
    assert two.manifest.summary["world_size"] == 2
    w1, w2 = (load_file(c.path("policy/model.safetensors")) for c in (one, two))
    base = load_file(
        latest_committed(storage, stage_dir(storage, "one", None, "base")).path("policy/model.safetensors")
    )
    # compare the updates; Adam's m / sqrt(v) can blow float noise up on near-zero gradients, so
    # the whole update must agree to a small relative error, not every weight bit for bit
    d1 = torch.cat([(w1[k] - base[k]).flatten() for k in sorted(w1)])
    d2 = torch.cat([(w2[k] - base[k]).flatten() for k in sorted(w1)])
    assert d1.norm() > 1e-3
    assert (d1 - d2).norm() / d1.norm() < 1e-3, ((d1 - d2).norm() / d1.norm()).item()
    m1, m2 = (pd.read_parquet(c.path("metrics.parquet")) for c in (one, two))
    for col in ["loss", "grad_norm"]:  # every step saw the same minibatch and gradient
        assert m1[col].tolist() == pytest.approx(m2[col].tolist(), rel=1e-4, abs=1e-6), col
    # the extremes are the extremes over both ranks' samples (a mean of the ranks' maxima is lower)
    assert m1.ratio_max.iloc[-1] > 1 + 1e-4 > 1 - 1e-4 > m1.ratio_min.iloc[-1]  # the second step moved off 1
    for col in ["ratio_max", "ratio_min"]:
        assert m1[col].tolist() == pytest.approx(m2[col].tolist(), rel=1e-5), col


@pytest.mark.precision_pinned
def test_cli_stage_and_status(storage, capsys):
    make_run(storage)
    assert main(["--storage", storage.url, "stage", "snapshot", "--run", "t", "--iteration", "0"]) == 0
    assert main(["--storage", storage.url, "stage", "rewards", "--run", "t", "--iteration", "0"]) == 2
    assert "grpo stage rollouts" in capsys.readouterr().err
    assert main(["--storage", storage.url, "status", "--run", "t"]) == 0
    assert "ok x1" in capsys.readouterr().out


SHORT_RUN = [  # the recipe of benchmarks/sort.yaml at 512 samples an iteration
    "rollout.prompts_per_iteration=64",
    "rollout.group_size=8",
    "learn.minibatch_size=128",
    "learn.microbatch_size=128",
    "rollout.max_tokens=5",
    "task.params={credit: position}",
    "reward.truncated_reward=null",
    "model.initializer_range=0.05",
    "learn.epochs=2",
]


def rewards_of_a_short_run(storage, extra, iterations=6) -> list[float]:
    """Mean sampled reward of each of `iterations` iterations of SHORT_RUN + extra."""
    make_run(storage, "learns", extra=SHORT_RUN + list(extra))
    return [
        run_iteration(storage, "learns", k)["advantages"].manifest.summary["reward_mean"] for k in range(iterations)
    ]


def test_mean_reward_rises(storage):
    """A short budget on the sort task: GRPO must clearly raise the mean sampled reward.

    The recipe of benchmarks/sort.yaml (position credit, answer-length responses scored as they
    are, lr 1.5e-3, 2 epochs), so 6 iterations of 512 samples (48 AdamW steps) move the reward
    far beyond its sampling noise.
    """
    rewards = rewards_of_a_short_run(storage, ["learn.lr=1.5e-3"])
    # the first policy's mean reward is ~0.06 with a sampling std of ~0.005 at 512 samples;
    # seeds 0-2 end at 0.136-0.163
    assert rewards[-1] > 2 * rewards[0] and rewards[-1] - rewards[0] > 0.05, rewards


@pytest.mark.s3
def test_all_stages_on_s3(s3, monkeypatch, tmp_path):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))  # checkpoints download here
    storage = open_storage(f"s3://{s3.bucket}/stages-{tmp_path.name}")
    make_run(storage)
    out = run_iteration(storage, "t", 0)
    assert next_iteration(storage, "t") == 1
    run_iteration(storage, "t", 1)  # optimizer state and the new policy come back from S3
    uri = storage.uri(out["rollouts"].path("rollouts.parquet"))
    assert uri.startswith("s3://")
    df = pd.read_parquet(uri, storage_options=s3.storage_options())
    con = duckdb.connect()
    con.register_filesystem(storage.fs)
    assert con.execute(f"SELECT count(*) FROM read_parquet('{uri}')").fetchall()[0][0] == len(df) == 64


def test_user_dataset_and_arithmetic_task(storage, tmp_path):
    data = tmp_path / "arith.jsonl"
    data.write_text(
        "".join(f'{{"prompt": "{a} + {b} * 2 =", "ground_truth": "{a + 2 * b}"}}\n' for a in range(4) for b in range(3))
    )
    make_run(storage, "ar", extra=["task.name=arithmetic", "task.params={max_operand: 9}", f"task.dataset={data}"])
    out = run_iteration(storage, "ar", 0)
    ro = pd.read_parquet(storage.uri(out["rollouts"].path("rollouts.parquet")))
    assert set(ro.prompt) <= {f"{a} + {b} * 2 =" for a in range(4) for b in range(3)}
    rw = pd.read_parquet(storage.uri(out["rewards"].path("rewards.parquet")))
    assert {"format", "correct"} <= set(dict(rw.components[0]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1 + 1 ="}\n')
    with pytest.raises(
        ConfigError, match=r"task.dataset.*bad\.jsonl.*no column 'prompt'"
    ):  # at init, before anything is written
        make_run(storage, "bad", extra=["task.name=arithmetic", f"task.dataset={bad}"])
    assert not storage.exists(storage.path("runs", "bad", "run.json"))


def test_a_forced_earlier_stage_makes_the_later_ones_stale_and_grpo_run_rebuilds_them(storage, capsys):
    """After `rollouts --force`, learn must not train on advantages of the old samples (issue: lineage)."""
    make_run(storage)
    run_iteration(storage, "t", 0)
    run_iteration(storage, "t", 1)
    stage_function("rollouts")(storage, "t", 1, force=True)  # new samples (another attempt, same seeds)
    with pytest.raises(
        StageError,
        match=r"learn iteration 1: input .* is stale: .*rewards.* was made from "
        r".*rollouts/attempt-0001.* which .*rollouts/attempt-0002.* replaced",
    ):
        stage_function("learn")(storage, "t", 1)
    with pytest.raises(StageError, match="grpo run --run t --start 1"):
        stage_function("advantages")(storage, "t", 1)
    assert next_iteration(storage, "t") == 1  # iteration 1 is unfinished again
    assert main(["--storage", storage.url, "status", "--run", "t"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["1"][:2] == ["ok", "x1"] and "stale" in " ".join(rows["1"])
    before = {s: list_attempts(storage, stage_dir(storage, "t", 1, s)) for s in STAGES}
    assert main(["--storage", storage.url, "run", "--run", "t", "--iterations", "1"]) == 0
    after = {s: list_attempts(storage, stage_dir(storage, "t", 1, s)) for s in STAGES}
    assert {s for s in STAGES if after[s] != before[s]} == {"rewards", "advantages", "learn", "eval"}
    assert next_iteration(storage, "t") == 2


def test_exploded_weights_are_never_committed_nor_sampled_from(storage, tmp_path):
    make_run(storage, extra=["learn.lr=1e9", "learn.max_grad_norm=1e9", "learn.minibatch_size=64"])  # one step
    run_iteration_until = [stage_function(s)(storage, "t", 0) for s in STAGES[:4]]
    assert run_iteration_until
    with pytest.raises(StageError, match=r"learn iteration 0: non-finite weights .* nothing committed; lower learn.lr"):
        stage_function("learn")(storage, "t", 0)
    assert not committed_attempts(storage, stage_dir(storage, "t", 0, "learn"))
    # a base model with a NaN weight is refused at init, before anything is written
    from safetensors.torch import load_file, save_file

    from grpo.tiny_model import build_for_task

    model = build_for_task(str(tmp_path / "nan"), "sort", hidden_size=64, num_heads=2, intermediate_size=128)
    weights = load_file(f"{model}/model.safetensors")
    name = sorted(weights)[0]
    weights[name][0, 0] = float("nan")
    save_file(weights, f"{model}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=rf"non-finite weights in {name}"):
        make_run(storage, "nan", extra=[f"model.base_model={model}"])
    assert not storage.exists(storage.path("runs", "nan", "run.json"))


@pytest.mark.precision_pinned
def test_an_init_killed_after_run_json_is_finished_by_the_command_the_error_names(storage, capsys):
    import shutil

    make_run(storage)
    shutil.rmtree(stage_dir(storage, "t", None, "base"))  # as if killed before the base model committed
    with pytest.raises(StageError, match=r"run `grpo init --run t` \(it reads run.json\)") as err:
        stage_function("snapshot")(storage, "t", 0)
    command = str(err.value).split("`")[1].split()
    assert main(["--storage", storage.url] + command[1:]) == 0
    assert stage_function("snapshot")(storage, "t", 0)


def test_a_sampler_serving_stale_weights_trips_max_logprob_gap_and_tis_trains_through_it(storage, monkeypatch):
    from grpo.sampling.engines import close_generators
    from grpo.sampling.hf import HFGenerator

    make_run(storage, extra=["learn.max_logprob_gap=0.01", "learn.lr=1e-2"])
    close_generators()
    for s in STAGES[:5]:
        stage_function(s)(storage, "t", 0)
    # from here the sampler keeps the base weights: iteration 1 samples from them, not from learn 0's
    monkeypatch.setattr(HFGenerator, "load_weights", lambda self, model_dir: setattr(self, "model_dir", model_dir))
    stage_function("eval")(storage, "t", 0)
    for s in STAGES[:4]:
        stage_function(s)(storage, "t", 1)
    with pytest.raises(
        StageError, match=r"learn iteration 1: the sampler's log-probs differ .*learn.max_logprob_gap=0.01"
    ):
        stage_function("learn")(storage, "t", 1)
    close_generators()  # a fresh sampler loads the base weights, then (still patched) keeps them
    make_run(storage, "tis", extra=["learn.behavior_correction=tis", "learn.tis_cap=2", "learn.lr=1e-2"])
    run_iteration(storage, "tis", 0)
    for s in STAGES[:4]:
        stage_function(s)(storage, "tis", 1)
    out = stage_function("learn")(storage, "tis", 1)
    assert out.manifest.summary["logprob_gap"] > 0.01  # recorded, and corrected for rather than refused
    close_generators()


def test_status_verify_shows_corrupt_the_error_says_what_to_run_and_gc_lists_then_removes(storage, capsys):
    import os
    from pathlib import Path

    make_run(storage)
    run_iteration(storage, "t", 0)
    first = latest_committed(storage, stage_dir(storage, "t", 0, "rewards"))
    stage_function("rewards")(storage, "t", 0, force=True)  # supersedes attempt 1
    run_iteration(storage, "t", 0)  # advantages, learn, eval rebuilt on it
    failed = Path(stage_dir(storage, "t", 0, "advantages")) / "attempt-0009-dead00"  # a crashed attempt
    failed.mkdir()
    (failed / "advantages.parquet").write_bytes(b"half")
    (Path(storage.path("runs", "t")) / "run.json.tmp-1234").write_bytes(b"{")
    old = 1_000_000_000
    for p in [failed, failed / "advantages.parquet", Path(storage.path("runs", "t", "run.json.tmp-1234"))]:
        os.utime(p, (old, old))
    capsys.readouterr()
    assert main(["--storage", storage.url, "gc", "--run", "t"]) == 0
    listed = capsys.readouterr().out
    assert "failed" in listed and "attempt-0009-dead00" in listed and "run.json.tmp-1234" in listed
    assert "superseded" in listed and first.attempt_dir.rsplit("/", 1)[-1] in listed
    assert "nothing removed (dry run)" in listed and failed.exists()
    snap = latest_committed(storage, stage_dir(storage, "t", 0, "snapshot"))
    assert snap.manifest.files[0].uri and "base" not in [line.split()[0] for line in listed.splitlines()]
    # superseded attempts are removed only once replaced for --older-than-s: these were just now
    assert main(["--storage", storage.url, "gc", "--run", "t", "--delete", "--older-than-s", "0"]) == 0
    assert not failed.exists() and not Path(first.attempt_dir).exists()
    assert run_iteration(storage, "t", 0)  # the kept chain still reads and verifies
    # a committed file edited afterwards: status --verify says corrupt, the next reader says what to run
    eval_dir = latest_committed(storage, stage_dir(storage, "t", 0, "eval")).attempt_dir
    with open(f"{eval_dir}/eval.parquet", "r+b") as f:
        f.seek(20)
        f.write(b"\xff")
    capsys.readouterr()
    assert main(["--storage", storage.url, "status", "--run", "t", "--verify"]) == 2  # non-zero: something is corrupt
    out = capsys.readouterr()
    assert "corrupt x1" in out.out and "grpo stage eval --run t --iteration 0 --force" in out.err
    assert "newest policy: iteration 0, " in out.out and " export --run t   # into " in out.out
    adv_dir = latest_committed(storage, stage_dir(storage, "t", 0, "advantages")).attempt_dir
    with open(f"{adv_dir}/advantages.parquet", "r+b") as f:
        f.seek(20)
        f.write(b"\xff")
    with pytest.raises(StageError, match=r"grpo stage advantages --run t --iteration 0 --force"):
        stage_function("learn")(storage, "t", 0, force=True)
