"""The GPU path's settings, at tiny size on the CPU: precision, memory savers, engine settings and the
hand-over of the accelerator between sampler and learner (the GPU itself: benchmarks/gpu_check.py)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_learn import F32, TINY  # the same tiny run
from test_stages import learned_files, learned_path

from grpo.config import ConfigError, load_config
from grpo.learner import MASTER_WEIGHTS
from grpo.record.storage import open_storage
from grpo.sampling import engines
from grpo.tiny_model import build_for_task
from stages import stage_function
from stages.init import init_run
from stages.iteration import run_iteration
from stages.learn import WARM

pytestmark = pytest.mark.equivalence  # run again in CI's bf16 lane (.ci/run)


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


@pytest.fixture(scope="module")
def bf16_base(tmp_path_factory):
    """The tiny sort model saved in bfloat16, as most hub checkpoints are."""
    from transformers import AutoModelForCausalLM

    src = build_for_task(
        str(tmp_path_factory.mktemp("f32")), "sort", hidden_size=64, num_heads=2, intermediate_size=128
    )
    out = tmp_path_factory.mktemp("bf16")
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(out)
    for f in Path(src).iterdir():  # tokenizer and generation config as they are
        if not (out / f.name).exists():
            (out / f.name).write_bytes(f.read_bytes())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    return out


def dtypes(path) -> set:
    with safe_open(str(path), framework="pt") as f:
        return {f.get_slice(k).get_dtype() for k in f.keys()}


@pytest.mark.precision_pinned
def test_bf16_base_trains_under_autocast_writes_bf16_and_a_cold_resume_equals_a_warm_one(storage, bf16_base):
    """Checkpoints keep the base's bf16; the float32 master weights beside them make iteration 1 built
    from the committed files (cold) equal to the one kept in memory (warm), bit for bit."""
    cfg = load_config(None, TINY + [f"model.base_model={bf16_base}", "learn.mixed_precision=bf16"])
    outs = {}
    for run_id in ("warm", "cold"):
        init_run(storage, run_id, cfg)
        outs[run_id] = [run_iteration(storage, run_id, 0)]
        if run_id == "cold":
            WARM.take(None)  # what a new process has: nothing in memory
        outs[run_id].append(run_iteration(storage, run_id, 1))
        WARM.take(None)
    learn = outs["cold"][1]["learn"]
    assert dtypes(learn.path("policy/model.safetensors")) == {"BF16"}
    with safe_open(learn.path("policy/model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied to the embedding, saved once as in the base
    assert json.loads(Path(learn.path("policy/config.json")).read_text())["dtype"] == "bfloat16"
    assert dtypes(learned_path(learn, MASTER_WEIGHTS)) == {"F32"}
    assert outs["cold"][1]["rollouts"].manifest.summary["sampler"]["dtype"] == "bfloat16"  # model.dtype auto
    for k in (0, 1):
        files = [load_file(learned_path(o[k]["learn"], MASTER_WEIGHTS)) for o in (outs["warm"], outs["cold"])]
        assert all(torch.equal(files[0][n], files[1][n]) for n in files[0]), k
    # bf16 sampler against the bf16-autocast learner: the gap the GPU check bounds at 0.05
    assert learn.manifest.summary["logprob_gap"] < 0.05


@pytest.mark.precision_pinned
def test_gradient_checkpointing_and_small_logprob_chunks_give_the_same_update(storage):
    policies = []
    for run_id, extra in [("plain", []), ("saver", ["learn.gradient_checkpointing=true", "learn.logprob_chunk=7"])]:
        init_run(storage, run_id, load_config(None, TINY + extra + [F32]))
        for s in ["snapshot", "rollouts", "rewards", "advantages", "learn"]:
            out = stage_function(s)(storage, run_id, 0)
        WARM.take(None)
        policies.append(load_file(out.path("policy/model.safetensors")))
    base = load_file(stage_function("snapshot")(storage, "plain", 0).path("policy/model.safetensors"))
    d = [torch.cat([(p[k] - base[k]).flatten() for k in sorted(base)]) for p in policies]
    assert d[0].norm() > 1e-3 and (d[0] - d[1]).norm() / d[0].norm() < 1e-4


@pytest.mark.parametrize("keep", [True, False])
def test_the_sampler_is_kept_or_closed_before_the_learner(storage, keep):
    init_run(storage, "r", load_config(None, TINY + [f"rollout.keep_engine={str(keep).lower()}"]))
    engines.close_generators()
    for s in ["snapshot", "rollouts", "rewards", "advantages"]:
        stage_function(s)(storage, "r", 0)
    live = engines._CACHE.get("hf")
    assert live is not None
    stage_function("learn")(storage, "r", 0)
    WARM.take(None)
    assert (engines._CACHE.get("hf") is live) == keep and (("hf" in engines._CACHE) == keep)
    stage_function("eval")(storage, "r", 0)  # starts (or reuses) a sampler again
    assert "hf" in engines._CACHE
    engines.close_generators()


@pytest.mark.precision_pinned
def test_engine_settings_resolve_for_the_platform_pass_through_and_restart_the_engine(tmp_path):
    model = build_for_task(str(tmp_path / "m"), "sort", hidden_size=64, num_heads=2, intermediate_size=128)
    cfg = load_config(None, ["rollout.max_prompt_tokens=20", "rollout.max_tokens=16"])
    settings = engines.engine_settings("vllm", cfg.rollout, "auto", model)
    assert settings == {
        "dtype": "float32",
        "max_model_len": 36,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "kv_cache_dtype": "auto",
        "tensor_parallel_size": 1,
        "enable_sleep_mode": False,
    }
    cfg = load_config(
        None,
        [
            "rollout.vllm.max_model_len=48",
            "rollout.vllm.enable_prefix_caching=true",
            "rollout.vllm.kv_cache_dtype=fp8",
            "model.dtype=bfloat16",
        ],
    )
    settings = engines.engine_settings("vllm", cfg.rollout, cfg.model.dtype, model)
    assert (
        settings["max_model_len"],
        settings["enable_prefix_caching"],
        settings["kv_cache_dtype"],
        settings["dtype"],
    ) == (48, True, "fp8", "bfloat16")
    assert engines.engine_settings("hf", cfg.rollout, "auto", model) == {"dtype": "float32"}
    assert (
        settings["max_model_len"] == 48
        and 64 == json.loads((Path(model) / "config.json").read_text())["max_position_embeddings"]
    )
    for bad, field in [
        ("rollout.vllm.gpu_memory_utilization=1.5", "gpu_memory_utilization"),
        ("rollout.vllm.kv_cache_dtype=int3", "kv_cache_dtype"),
        ("model.dtype=fp4", "model.dtype"),
        ("learn.mixed_precision=fp16", "mixed_precision"),
        ("learn.logprob_chunk=0", "logprob_chunk"),
    ]:
        with pytest.raises(ConfigError, match=field):
            load_config(None, [bad])
    try:
        first = engines.get_generator("hf", model, dtype="float32")
        assert engines.get_generator("hf", model, dtype="float32") is first
        second = engines.get_generator("hf", model, dtype="bfloat16")  # other settings: a new engine
        assert second is not first and next(second.model.parameters()).dtype == torch.bfloat16
    finally:
        engines.close_generators()


@pytest.mark.precision_pinned
def test_fsdp2_keeps_float32_master_weights_in_its_sharded_state_and_a_cold_resume_equals_a_warm_one(
    storage, bf16_base, tmp_path
):
    """learn.sharding=fsdp2 with a bf16 base: policy/ in bf16, the float32 weights and AdamW state in dcp/
    (no master.safetensors); iteration 1 resumed from dcp/ equals the one kept in memory, bit for bit."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    cfg = load_config(
        None, TINY + [f"model.base_model={bf16_base}", "learn.mixed_precision=bf16", "learn.sharding=fsdp2"]
    )
    outs = {}
    for run_id in ("warm", "cold"):
        init_run(storage, run_id, cfg)
        outs[run_id] = [run_iteration(storage, run_id, 0)]
        if run_id == "cold":
            WARM.take(None)
        outs[run_id].append(run_iteration(storage, run_id, 1))
        WARM.take(None)
    learn = outs["cold"][1]["learn"]
    files = set(learned_files(learn))
    assert "dcp/.metadata" in files and MASTER_WEIGHTS not in files and "optimizer.pt" not in files
    assert dtypes(learn.path("policy/model.safetensors")) == {"BF16"}
    dcp_to_torch_save(learned_path(learn, "dcp/.metadata").rsplit("/", 1)[0], tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    assert {v.dtype for v in state["model"].values()} == {torch.float32}
    w, c = (load_file(o[1]["learn"].path("policy/model.safetensors")) for o in (outs["warm"], outs["cold"]))
    assert all(torch.equal(w[n], c[n]) for n in w)


def test_auto_precision_is_bf16_only_on_a_gpu_that_has_it_natively(monkeypatch):
    """`auto` is float32 on every CPU, AVX512-BF16 or AMX included (measured: RESULTS.md), bf16 on a GPU with
    native bf16; GRPO_AUTO_PRECISION forces what `auto` resolves to (CI's bf16 lane), an explicit setting wins."""
    from grpo.learner import precision as learner

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(learner.AUTO_PRECISION_ENV, raising=False)
    for native in (False, True):
        monkeypatch.setattr(learner, "cpu_has_native_bf16", lambda n=native: n)
        assert learner.autocast_precision("auto", cpu)[0] == "no"
        assert learner.autocast_precision("bf16", cpu) == ("bf16", "learn.mixed_precision")  # asked for
    assert "bf16 here is native" in learner.autocast_precision("auto", cpu)[1]
    for native, want in ((True, "bf16"), (False, "no")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, n=native: n)
        assert learner.autocast_precision("auto", gpu)[0] == want
    monkeypatch.setenv(learner.AUTO_PRECISION_ENV, "bf16")
    assert learner.autocast_precision("auto", cpu) == ("bf16", "auto: GRPO_AUTO_PRECISION=bf16")
    assert learner.autocast_precision("no", cpu)[0] == "no"
    monkeypatch.setenv(learner.AUTO_PRECISION_ENV, "fp16")
    with pytest.raises(ConfigError, match="GRPO_AUTO_PRECISION='fp16': use bf16 or no"):
        learner.autocast_precision("auto", cpu)
    # YAML 1.1 reads a bare `no` as false: the setting still means "no"
    assert load_config(None, ["learn.mixed_precision=no"]).learn.mixed_precision == "no"
    assert load_config(None).learn.mixed_precision == "auto"


def test_auto_precision_trains_as_the_precision_it_resolves_to(storage, monkeypatch):
    """learn.mixed_precision=auto commits the weights of the explicit setting it resolves to (float32 on a CPU;
    bf16 where GRPO_AUTO_PRECISION forces it, as on a GPU), and the learn manifest says which and why."""
    from grpo.learner import precision as learner

    def learn(run_id: str, setting: str, forced: str | None = None):
        monkeypatch.delenv(learner.AUTO_PRECISION_ENV, raising=False)
        if forced:
            monkeypatch.setenv(learner.AUTO_PRECISION_ENV, forced)
        init_run(storage, run_id, load_config(None, TINY + [f"learn.mixed_precision={setting}"]))
        WARM.take(None)
        out = run_iteration(storage, run_id, 0)["learn"]
        return load_file(out.path("policy/model.safetensors")), out.manifest.summary["precision"]

    same = lambda a, b: all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    (f32, f32_why), (bf16, bf16_why) = learn("no", "no"), learn("bf16", "bf16")
    assert not same(f32, bf16)  # the two precisions train differently
    assert f32_why == {"autocast": "no", "why": "learn.mixed_precision"} and bf16_why["autocast"] == "bf16"
    for forced, want, why in ((None, f32, "auto: "), ("bf16", bf16, "auto: GRPO_AUTO_PRECISION=bf16")):
        weights, precision = learn(f"auto-{forced}", "auto", forced)
        assert same(weights, want) and precision["why"].startswith(why)


@pytest.mark.precision_pinned
def test_a_run_made_before_auto_precision_goes_on_in_float32(storage):
    """A run made when learn.mixed_precision defaulted to "no" stores "no"; the same config today (the setting
    not given: `auto`) continues it as it began; another precision for it is refused."""
    from stages.common import StageError, load_run

    init_run(storage, "old", load_config(None, TINY + ["learn.mixed_precision=no"]))
    init_run(storage, "old", load_config(None, TINY))  # what a scheduled deployment sends after the upgrade
    assert load_run(storage, "old").learn.mixed_precision == "no"
    with pytest.raises(StageError, match="different config"):
        init_run(storage, "old", load_config(None, TINY + ["learn.mixed_precision=bf16"]))
    init_run(storage, "new", load_config(None, TINY))
    assert load_run(storage, "new").learn.mixed_precision == "auto"


@pytest.mark.precision_pinned
def test_a_run_made_before_auto_old_logprobs_goes_on_recomputing(storage):
    """learn.old_logprobs defaulted to "recompute" before `auto`: a run that stored it keeps it when the same
    config comes today, and a run.json written before the field existed reads as "recompute", its learn identity
    the one its committed stages have."""
    import json

    from grpo.record.layout import run_json
    from stages import learn
    from stages.common import load_run

    init_run(storage, "old", load_config(None, TINY + ["learn.old_logprobs=recompute"]))
    init_run(storage, "old", load_config(None, TINY))
    assert load_run(storage, "old").learn.old_logprobs == "recompute"
    raw = json.loads(storage.read_bytes(run_json(storage, "old")))
    del raw["config"]["learn"]["old_logprobs"], raw["config"]["learn"]["mixed_precision"]  # a run.json from before
    init_run(storage, "older", load_config(None, TINY))
    storage.write_bytes_atomic(run_json(storage, "older"), json.dumps(raw | {"run_id": "older"}).encode())
    older = load_run(storage, "older")
    assert (older.learn.old_logprobs, older.learn.mixed_precision) == ("recompute", "no")
    before = load_config(None, TINY + ["learn.old_logprobs=recompute", "learn.mixed_precision=no"])
    assert learn.stage_config(older) == learn.stage_config(before)
    assert "old_logprobs" not in learn.stage_config(older)["learn"]  # as before the setting existed
    init_run(storage, "older", load_config(None, TINY))  # the same config after the upgrade: no change
    init_run(storage, "new", load_config(None, TINY))
    assert load_run(storage, "new").learn.old_logprobs == "auto"
