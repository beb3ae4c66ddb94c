"""Asynchronous iterations in one process (issue 32.2): with rollout.staleness >= 1 and the learner on another device
than the sampler (learn.device, rollout.device), the flow `grpo` runs learn k in a thread of its flow run while it
samples iteration k+1 and evaluates iteration k-1, and commits the bytes the same run commits stage after stage;
on one device, or at S = 0, it stays in order. A bad device fails in one line, naming the field, before anything
is written.

This machine has one device, the CPU: the flow's test runs force "apart" through the one function that says it
(grpo.devices.apart), which both the flow (flows/placement.py overlapping) and the learn stage (no sleeping sampler,
no offloaded learner) ask. Learn k is held after its first optimizer step until rollouts k+1 has written rows (or
60 s, which then fails the overlap check): the overlap is made certain, not timed. benchmarks/gpu_check.py
--overlap runs the real thing on two GPUs."""

import importlib.util
import re
import threading
from pathlib import Path

import pytest
import torch
from test_staleness import RUN, cold, one_thread  # noqa: F401 (one_thread: a fixture the tests use)

import schemas.parquet
from flows.grpo import grpo
from flows.placement import overlapping
from grpo import devices
from grpo.config import ConfigError, load_config
from grpo.learner import loop
from grpo.record.layout import STAGES, STATE_STAGE, stage_dir
from grpo.record.storage import committed_attempts, latest_committed, open_storage
from grpo.report import overlaps, stage_times
from grpo.sampling import engines
from stages import StageError, learn

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.equivalence, pytest.mark.precision_pinned]

ITERATIONS = 4
OVERRIDES = RUN + ["rollout.staleness=1", "learn.behavior_correction=tis", "rollout.chunk_prompts=8"]


def committed_files(storage) -> dict:
    """{(iteration, stage): [(file, sha256)]} of the newest committed attempt of every stage and state commit."""
    out = {}
    for k in range(ITERATIONS):
        for s in (*STAGES, STATE_STAGE):
            if committed_attempts(storage, where := stage_dir(storage, "r", k, s)):
                out[k, s] = sorted((f.path, f.sha256) for f in latest_committed(storage, where).manifest.files)
    return out


def times(storage, stage: str) -> dict[int, tuple[float, float]]:
    """{iteration: (start, commit)} of a stage, in seconds (grpo.report.stage_times)."""
    return {r["iteration"]: (r["start"], r["end"]) for r in stage_times(storage, "r") if r["stage"] == stage}


def releases(monkeypatch) -> list[int]:
    """Counts the learn stage's hand-overs of the accelerator (the sampler put to sleep for the learner)."""
    calls = []
    release = learn.release_accelerator
    monkeypatch.setattr(learn, "release_accelerator", lambda keep: (calls.append(1), release(keep)))
    return calls


def hold_learns_for_the_next_rollouts(monkeypatch) -> list[str]:
    """Learn k waits after its first optimizer step until rollouts k+1 has written rows (60 s at most); returns the
    learns that waited in vain."""
    sampled = {k: threading.Event() for k in range(ITERATIONS + 1)}
    missed = []
    write, report = schemas.parquet.ParquetWriter.write, loop.progress

    def write_rows(self, rows):
        write(self, rows)
        for k, event in sampled.items():
            if self.name == "rollouts" and f"/iter-{k:04d}/rollouts/" in self.path:
                event.set()

    def progress(label, n, *args, **kwargs):
        report(label, n, *args, **kwargs)
        k = int(label.split()[-1])
        if n == 1 and k < ITERATIONS - 1 and not sampled[k + 1].wait(60):
            missed.append(label)

    monkeypatch.setattr(schemas.parquet.ParquetWriter, "write", write_rows)
    monkeypatch.setattr(loop, "progress", progress)
    return missed


@pytest.mark.usefixtures("one_thread")
def test_apart_devices_sample_the_next_iteration_while_learn_runs_in_a_thread_and_commit_the_same_bytes(
    prefect_api, tmp_path, monkeypatch
):
    params = {"run_id": "r", "overrides": OVERRIDES, "iterations": ITERATIONS}
    # one device, as this machine is: in order, the sampler handed the device at every learn
    cold()
    handed = releases(monkeypatch)
    in_order = open_storage((tmp_path / "in-order").as_uri())
    grpo(storage_url=in_order.url, **params)
    assert overlaps(stage_times(in_order, "r")) == [] and len(handed) == ITERATIONS

    # learner and sampler apart: learn k in a thread beside rollouts k+1, the sampler never put to sleep
    cold()
    handed.clear()
    monkeypatch.setattr(devices, "apart", lambda cfg: True)
    missed = hold_learns_for_the_next_rollouts(monkeypatch)
    storage = open_storage((tmp_path / "apart").as_uri())
    out = grpo(storage_url=storage.url, **params)
    assert out["eval"].startswith(storage.url) and not missed and not handed
    learns, sampled = times(storage, "learn"), times(storage, "rollouts")
    for k in range(ITERATIONS - 1):  # learn k's [start, commit] meets rollouts k+1's
        assert sampled[k + 1][0] < learns[k][1] and learns[k][0] < sampled[k + 1][1], k
        assert learns[k + 1][0] >= learns[k][1]  # at most one learn at a time
    assert overlaps(stage_times(storage, "r")) == list(range(ITERATIONS - 1))
    files = committed_files(storage)
    assert len(files) == ITERATIONS * (len(STAGES) + 1)  # the learner's state commits too
    assert files == committed_files(in_order)  # every file of every stage and state, byte for byte

    # run again: every stage reused, none rerun
    assert grpo(storage_url=storage.url, **params | {"iteration": 0}) == out


def test_overlap_in_one_process_needs_staleness_and_devices_apart(monkeypatch):
    stale, in_step = load_config(None, ["rollout.staleness=1"]), load_config(None, [])
    assert not overlapping(stale, {})  # this machine: learner and sampler on its one device
    assert overlapping(stale, {"learn": "gpu"})  # learn on a pool of its own
    monkeypatch.setattr(devices, "apart", lambda cfg: True)
    assert overlapping(stale, {}) and not overlapping(in_step, {}) and not overlapping(in_step, {"learn": "gpu"})


def test_devices_resolve_on_the_machine_and_vllm_samples_on_cuda_0(monkeypatch):
    cfg = load_config(None, ["rollout.device=cpu", "learn.device=cpu"])
    assert devices.sampler_device(cfg.rollout) == devices.learner_device(cfg.learn) == torch.device("cpu")
    assert not devices.apart(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with two GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    two = load_config(None, ["rollout.device=cuda", "learn.device=cuda:1"])
    assert devices.sampler_device(two.rollout) == torch.device("cuda", 0) and devices.apart(two)
    assert devices.apart(load_config(None, ["learn.device=cpu"]))  # a GPU sampler (auto), a CPU learner
    assert not devices.apart(load_config(None, ["learn.device=cuda:0"]))  # auto is cuda:0
    hf = load_config(None, ["rollout.device=cuda:1"])
    with pytest.raises(ConfigError, match=r"^rollout.device=cuda:1: vLLM in one process samples on cuda:0"):
        devices.sampler_device(hf.rollout, "vllm")
    if importlib.util.find_spec("vllm") is not None:
        backend, why = engines.choose_backend("auto", "unused", devices.sampler_device(hf.rollout))
        assert backend == "hf" and "rollout.device cuda:1" in why
    with pytest.raises(ConfigError, match=r"^learn.device=cuda:2: this machine has 2 CUDA device\(s\)"):
        devices.check(load_config(None, ["learn.device=cuda:2"]), {"learn"})
    devices.check(load_config(None, ["learn.device=cuda:2"]), {"rollouts", "eval"})  # learn runs elsewhere


@pytest.mark.parametrize(
    "setting, line",
    [
        ("learn.device=cuda:99", r"init r: learn.device=cuda:99: this machine has \d+ CUDA device\(s\)"),
        ("rollout.device=gpu", r"init r: rollout.device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    ],
)
def test_a_device_the_machine_lacks_fails_in_one_line_before_anything_is_written(prefect_api, tmp_path, setting, line):
    store = tmp_path / "store"
    state = grpo(run_id="r", overrides=RUN + [setting], storage_url=store.as_uri(), return_state=True)
    assert state.is_failed() and "\n" not in state.message
    assert re.fullmatch(line + r"[^\n]*", state.message), state.message
    assert not store.exists() or not any(Path(store).rglob("*.json"))  # no run.json, no manifest


@pytest.mark.usefixtures("one_thread")
def test_a_learn_that_fails_in_its_thread_fails_the_flow_in_its_line_and_the_run_resumes(
    prefect_api, tmp_path, monkeypatch
):
    cold()
    monkeypatch.setattr(devices, "apart", lambda cfg: True)
    train_and_save = learn.train_and_save

    def fails_at_1(learner, run_id, k, *args):
        if k == 1:
            raise StageError("learn iteration 1: the learner gave up")
        return train_and_save(learner, run_id, k, *args)

    monkeypatch.setattr(learn, "train_and_save", fails_at_1)
    storage = open_storage((tmp_path / "s").as_uri())
    params = {"run_id": "r", "overrides": OVERRIDES, "storage_url": storage.url}
    state = grpo(iterations=3, return_state=True, **params)
    assert state.is_failed() and state.message == "learn iteration 1: the learner gave up"
    done = lambda k, s: bool(committed_attempts(storage, stage_dir(storage, "r", k, s)))  # noqa: E731
    assert done(0, "eval") and not done(1, "learn")  # eval 0 ran beside learn 1
    assert done(2, "advantages")  # iteration 2 sampled meanwhile: it reads learn 0 alone (S = 1)
    monkeypatch.setattr(learn, "train_and_save", train_and_save)
    out = grpo(iterations=2, **params)  # iteration next (1): its sampling and iteration 2's reused
    assert out["eval"].startswith(storage.url) and done(2, "eval")
    assert len(committed_attempts(storage, stage_dir(storage, "r", 2, "rollouts"))) == 1


def test_the_transformers_samplers_first_adapters_draw_nothing_from_torchs_global_generator(tmp_path):
    """A learner in another thread draws its dropout from that generator (and saves its state in rng.pt)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo.config import ModelConfig
    from grpo.sampling.hf import HFGenerator
    from grpo.tiny_model import build_for_task

    build_for_task(str(tmp_path / "m"), "sort", {}, ModelConfig(), 0)
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    get_peft_model(lm, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(tmp_path / "a")
    sampler = HFGenerator(str(tmp_path / "m"))
    before = torch.get_rng_state()
    sampler.load_adapter(str(tmp_path / "a"))
    assert torch.equal(torch.get_rng_state(), before) and sampler.adapter_dir == str(tmp_path / "a")
