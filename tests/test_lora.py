"""learn.lora: peft adapters train, the base stays frozen and is the KL reference, each learn commits the
adapters (a small fraction of a full run's bytes), samplers serve them exactly, export merges them, and
fsdp2 with 2 processes gives the adapters of 1 process."""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from test_learn import F32
from test_real_path import chat_config, needs_vllm, world  # noqa: F401 (world: a fixture)
from test_sharding import TOL, learn_of
from test_stages import learned_files, learned_path, make_run, rewards_of_a_short_run

from flows.cli import main
from grpo.config import load_config
from grpo.record.layout import stage_dir
from grpo.record.storage import latest_committed, open_storage
from grpo.sampling.engines import close_generators
from stages import learn as learn_stage
from stages.init import init_run
from stages.iteration import run_iteration

pytestmark = pytest.mark.equivalence  # run again in CI's bf16 lane (.ci/run)

LORA = ["learn.lora={r: 2, alpha: 4}", "learn.kl_coef=0.05", F32]  # adapters compared to 1e-5 and 1e-3


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


def learn_bytes(committed) -> int:
    return sum(f.size for f in committed.manifest.files if not f.path.endswith(".parquet"))


@pytest.mark.precision_pinned
def test_lora_commits_adapters_only_the_base_is_the_reference_and_samplers_serve_the_adapters(storage):
    make_run(storage, "full", extra=["learn.kl_coef=0.05", F32])
    make_run(storage, "lora", extra=LORA)
    for k in range(2):
        run_iteration(storage, "full", k)
        out = run_iteration(storage, "lora", k)
    files = set(learned_files(learn_of(storage, "lora", 1)))
    assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json", "optimizer.pt"} <= files
    assert not any(f.startswith("policy/") for f in files)  # the base weights are never committed again
    adapter = load_file(learn_of(storage, "lora", 1).path("adapter/adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at 0: it trained
    # AdamW holds the adapters' state alone: one entry per adapter tensor
    optimizer = torch.load(learned_path(learn_of(storage, "lora", 1), "optimizer.pt"))
    assert len(optimizer["state"]) == len(adapter)
    # the reference is the base with the adapters off: no second model in memory
    assert learn_stage.WARM._learner is not None and learn_stage.WARM._learner.ref is None
    lp0 = pd.read_parquet(learn_of(storage, "lora", 0).path("logprobs.parquet"))
    lp1 = pd.read_parquet(learn_of(storage, "lora", 1).path("logprobs.parquet"))
    same = lambda a, b: all(torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5) for x, y in zip(a, b))  # noqa: E731
    assert same(lp0.old_logprobs, lp0.ref_logprobs)  # iteration 0: B = 0, the policy is the base
    assert not same(lp1.old_logprobs, lp1.ref_logprobs)
    # the snapshot of iteration 1 is the base's weights plus learn 0's adapters, and the sampler served them
    snap = latest_committed(storage, stage_dir(storage, "lora", 1, "snapshot"))
    assert {f.path for f in snap.manifest.files if f.path.startswith("adapter/")} == {
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
    }
    assert set(snap.manifest.inputs) == {"policy", "base"}
    assert out["learn"].manifest.summary["logprob_gap"] < 1e-5
    full, lora = learn_bytes(learn_of(storage, "full", 1)), learn_bytes(learn_of(storage, "lora", 1))
    print(f"bytes committed by learn 1: full {full}, LoRA r=2 {lora} ({lora / full:.3f})")
    assert lora < 0.1 * full


@pytest.mark.precision_pinned
def test_export_merges_the_adapters_into_a_self_contained_hf_folder(storage, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make_run(storage, "lora", extra=LORA)
    run_iteration(storage, "lora", 0)
    out = tmp_path / "exported"
    assert main(["--storage", storage.uri(storage.path()), "export", "--run", "lora", "--out", str(out)]) == 0
    assert "iteration 0" in capsys.readouterr().out
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    AutoTokenizer.from_pretrained(out)  # the tokenizer came along
    assert not any("lora" in k for k in merged.state_dict())
    from peft import PeftModel

    from grpo.record.checkpoint import policy_folders

    base = latest_committed(storage, stage_dir(storage, "lora", None, "base"))
    _, model_dir, adapter_dir = policy_folders(learn_of(storage, "lora", 0), base)
    peft_lm = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter_dir
    )
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, peft_lm(ids).logits, atol=1e-5)
    # a folder that exists is never overwritten: one line, exit 2
    assert main(["--storage", storage.uri(storage.path()), "export", "--run", "lora", "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err


@pytest.mark.precision_pinned
@pytest.mark.slow
def test_lora_under_fsdp2_with_two_processes_trains_the_adapters_of_one_process(storage):
    make_run(storage, "one", extra=LORA)
    make_run(storage, "two", extra=LORA + ["learn.sharding=fsdp2", "learn.num_processes=2"])
    for k in range(2):
        for r in ("one", "two"):
            run_iteration(storage, r, k)
    files = set(learned_files(learn_of(storage, "two", 1)))
    assert "dcp/.metadata" in files and "adapter/adapter_model.safetensors" in files and "optimizer.pt" not in files
    one, two = (load_file(learn_of(storage, r, 1).path("adapter/adapter_model.safetensors")) for r in ("one", "two"))
    assert sorted(one) == sorted(two)
    b_one = torch.cat([one[k].flatten() for k in sorted(one) if "lora_B" in k])  # B starts at 0: B is the update
    b_two = torch.cat([two[k].flatten() for k in sorted(one) if "lora_B" in k])
    assert b_one.norm() > 1e-4 and float((b_one - b_two).norm() / b_one.norm()) < TOL


@pytest.mark.parametrize(
    "kernels",
    [
        pytest.param(False, id="merged-in-memory", marks=needs_vllm),
        pytest.param(True, id="lora-request", marks=needs_vllm),
    ],
)
def test_vllm_serves_each_iterations_adapters_merged_in_memory_or_through_its_lora_kernels(world, storage, kernels):  # noqa: F811
    """Iteration 1 samples from learn 0's adapters on a warm engine: the sampler's log-probs are the learner's
    (gap ~1e-6), far from the base's (the reference) that an engine ignoring the adapters would give."""
    extra = [
        "rollout.backend=vllm",
        f"rollout.vllm.enable_lora={str(kernels).lower()}",
        "learn.lora={r: 4, alpha: 8}",
        "learn.lr=1e-2",
        "learn.kl_coef=0.01",
    ]
    init_run(storage, "v", load_config(None, chat_config(world, *extra)))
    try:
        outs = [run_iteration(storage, "v", k) for k in range(2)]
    finally:
        close_generators()
    assert ("enable_lora" in outs[1]["rollouts"].manifest.summary["sampler"]) == kernels
    lp = pd.read_parquet(outs[1]["learn"].path("logprobs.parquet"))
    ro = pd.read_parquet(outs[1]["rollouts"].path("rollouts.parquet")).set_index(["prompt_id", "sample_index"])
    sampler = ro.loc[list(zip(lp.prompt_id, lp.sample_index)), "sampler_logprobs"]
    flat = lambda col: torch.tensor([x for row in col for x in row])  # noqa: E731
    to_base = (flat(sampler) - flat(lp.ref_logprobs)).abs().mean().item()
    gap = outs[1]["learn"].manifest.summary["logprob_gap"]
    print(f"sampler vs learner {gap:.2e}, sampler vs base {to_base:.2e}")
    assert gap < 1e-3 and gap < 0.05 * to_base


def test_lora_learns_the_sort_task(storage):
    """test_stages.test_mean_reward_rises's recipe with LoRA adapters (r=16 on every projection) at a
    LoRA-sized lr: the mean sampled reward rises as clearly as with full fine-tuning (0.058 -> 0.138 at
    seed 0; full fine-tuning: 0.136-0.163)."""
    rewards = rewards_of_a_short_run(storage, ["learn.lr=5e-3", "learn.lora={r: 16, alpha: 32}"])
    assert rewards[-1] > 2 * rewards[0] and rewards[-1] - rewards[0] > 0.05, rewards


ADAPTERS_OF_A_PROCESS = """
import hashlib, sys
from pathlib import Path
from transformers import Qwen2Config, Qwen2ForCausalLM
from grpo.config import LoraConfig
from grpo.learner.state import Learner, with_adapter
shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1)
lm = with_adapter(Qwen2ForCausalLM(Qwen2Config(**shape)), LoraConfig(r=2, alpha=4), None, seed=0)
Learner._save_adapter(lm, None, Path(sys.argv[1]), Path(sys.argv[1]))
print(hashlib.sha256(Path(sys.argv[1], "adapter", "adapter_config.json").read_bytes()).hexdigest())
"""


@pytest.mark.precision_pinned
def test_adapters_saved_by_two_processes_are_the_same_bytes(tmp_path):
    """peft keeps target_modules as a set, whose order follows the process's string hashing (PYTHONHASHSEED): two
    processes that save the same adapters (a learn and its replay, a run and its resume) write one adapter_config."""
    root = Path(__file__).resolve().parents[1]
    digests = {
        subprocess.run(
            [sys.executable, "-c", ADAPTERS_OF_A_PROCESS, str(tmp_path / seed)],
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()[-1]
        for seed in ("1", "2", "3")
    }
    assert len(digests) == 1
