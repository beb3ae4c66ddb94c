"""Checkpoints load and save as transformers does (grpo/record/weights.py): a MoE checkpoint in the hub's per-expert
layout is swapped into the sampler, trains and exports back to that layout; a multimodal ForConditionalGeneration
checkpoint trains its language model on text and keeps its vision tower and processor files in every policy and
export; LoRA and fsdp2 train a hybrid (Qwen3.5) and a MoE (Qwen3-MoE) family. Tiny random checkpoints from
tests/families.py, CPU, float32, the transformers sampler."""

import importlib.util
import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from flows.cli import main
from flows.commands.export import export_policy
from grpo.config import load_config
from grpo.record.checkpoint import checkpoint_problem, safetensors_shapes
from grpo.record.lineage import committed_input
from grpo.record.storage import open_storage
from grpo.record.weights import load_model, read_weights
from grpo.sampling.hf import HFGenerator
from stages.init import init_run
from stages.iteration import run_iteration
from tests.families import build_family_model

TEXTS = [f"Tom has {a} apples and buys {b} more. How many apples? #### {a + b}" for a in range(5) for b in range(4)]
TEXTS += ["<|im_start|>system\nYou solve.<|im_end|>\n<|im_start|>user\n<|im_start|>assistant\n"]
STEP = ["rollout.group_size=2", "learn.minibatch_size=4", "learn.microbatch_size=2"]  # forced_batch: a step


def flat(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def config(world: Path, model: Path, *extra: str):
    return load_config(
        None,
        [
            f"model.base_model={model}",
            "task.name=math",
            f"task.dataset={world / 'data.parquet'}",
            "task.prompt_column=question",
            "task.answer_column=answer",
            "task.prompt_format=chat",
            "rollout.backend=hf",
            "rollout.prompts_per_iteration=4",
            "rollout.group_size=2",
            "rollout.max_tokens=6",
            "learn.minibatch_size=8",
            "learn.microbatch_size=4",
            "learn.mixed_precision=no",
            "eval.n_prompts=2",
            "eval.split_fraction=0.25",
            "reward.workers=1",
            f"reward.functions=[{world / 'length.py'}:length]",
            "reward.truncated_reward=null",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    rows = [dict(question=f"Tom has {i % 5} apples and buys {i % 4} more.", answer=f"#### {i % 9}") for i in range(16)]
    pd.DataFrame(rows).to_parquet(root / "data.parquet")
    # samples of a random model differ in their text: every group has advantages, so every iteration updates
    (root / "length.py").write_text("def length(response, ground_truth, prompt, **row):\n    return len(response)\n")
    return root


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


def family(world: Path, name: str, seed: int = 0) -> Path:
    out = world / f"{name}-{seed}"
    if not out.exists():
        build_family_model(str(out), name, TEXTS, seed=seed)
        if name.endswith("_vl"):
            processor_files(out, name)
    return out


def processor_files(out: Path, name: str) -> None:
    """What a real multimodal checkpoint ships beside its weights: the image processor's preprocessor_config.json
    (and Qwen's video_preprocessor_config.json), written by transformers' own processor classes."""
    from transformers import Gemma3ImageProcessor, Qwen2VLImageProcessor

    if name.startswith("qwen"):
        Qwen2VLImageProcessor().save_pretrained(out)
        (out / "video_preprocessor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))
    else:
        Gemma3ImageProcessor().save_pretrained(out)


def hub_layout_expert_keys(model_dir: Path) -> list[str]:
    return sorted(k for k in safetensors_shapes(model_dir) if re.search(r"mlp\.experts\.\d+\.(gate|up|down)_proj", k))


# --- MoE: the hub's per-expert layout in, the fused experts in memory, the same layout out ---------------------


def test_the_sampler_swaps_in_a_hub_layout_moe_checkpoint_through_transformers(world):
    first, second = family(world, "qwen3_moe"), family(world, "qwen3_moe", seed=1)
    assert hub_layout_expert_keys(second), "the checkpoint is not in the hub's per-expert layout"
    sampler = HFGenerator(str(first))
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sampler.model.state_dict())  # fused in memory
    sampler.load_weights(str(second))
    expected = load_model(str(second), torch.float32).state_dict()
    got = sampler.model.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert sampler.model.lm_head.weight is sampler.model.model.embed_tokens.weight  # still tied


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_a_sharded_bf16_checkpoint_is_checked_and_swapped_in_as_transformers_loads_it(world, tmp_path, name):
    """Sharded safetensors (an index and several files) in bfloat16, read into a float32 sampler: the files' own
    names (Llama) directly, the hub's per-expert layout (Qwen3-MoE) through from_pretrained; both as
    from_pretrained gives them, the tied head still tied."""
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(family(world, name, seed=1), dtype=torch.bfloat16).save_pretrained(
        sharded, max_shard_size="40KB"
    )
    for f in family(world, name).glob("tokenizer*"):
        (sharded / f.name).write_bytes(f.read_bytes())
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 1
    assert checkpoint_problem(sharded) is None
    sampler = HFGenerator(str(family(world, name)))
    sampler.load_weights(str(sharded))
    expected = load_model(str(sharded), torch.float32).state_dict()
    got = sampler.model.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert next(sampler.model.parameters()).dtype == torch.float32
    assert sampler.model.lm_head.weight is sampler.model.model.embed_tokens.weight


def test_weights_that_do_not_fit_are_refused_in_one_line(world):
    sampler = HFGenerator(str(family(world, "qwen3_moe")))
    with pytest.raises(ValueError) as err:
        read_weights(sampler.model, str(family(world, "llama")))
    assert "\n" not in str(err.value) and str(family(world, "llama")) in str(err.value)


def test_a_hub_layout_moe_checkpoint_trains_and_exports_back_to_that_layout(world, storage, tmp_path):
    base = family(world, "qwen3_moe")
    assert checkpoint_problem(base) is None
    init_run(storage, "moe", config(world, base))
    for k in range(2):  # iteration 1's sampler swaps in learn 0's policy (read_weights)
        out = run_iteration(storage, "moe", k)
    policy = out["learn"]
    exported = Path(export_policy(policy, committed_input(storage, "moe", None, "base"), str(tmp_path / "export")))
    assert safetensors_shapes(exported).keys() == safetensors_shapes(base).keys()  # the hub's keys, per expert
    assert {k: s for k, (s, _) in safetensors_shapes(exported).items()} == {
        k: s for k, (s, _) in safetensors_shapes(base).items()
    }
    assert checkpoint_problem(exported) is None
    trained, before = load_file(exported / "model.safetensors"), load_file(base / "model.safetensors")
    assert any(not torch.equal(trained[k], before[k]) for k in hub_layout_expert_keys(base))  # the experts trained
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_lora_on_a_moe_checkpoint_samples_its_adapters_and_exports_merged_into_the_hub_layout(world, storage, tmp_path):
    """Two iterations (iteration 1's sampler takes learn 0's adapters, the experts' among them), then export: the
    adapters merged into the base's weights, saved in the hub's per-expert layout."""
    base = family(world, "qwen3_moe")
    init_run(storage, "moe-lora", config(world, base, "learn.lora={r: 2, alpha: 4}"))
    for k in range(2):
        out = run_iteration(storage, "moe-lora", k)
    adapter = {f.path for f in out["learn"].manifest.files if f.path.startswith("adapter/")}
    assert "adapter/adapter_model.safetensors" in adapter
    exported = Path(
        export_policy(out["learn"], committed_input(storage, "moe-lora", None, "base"), str(tmp_path / "x"))
    )
    assert {k: s for k, (s, _) in safetensors_shapes(exported).items()} == {
        k: s for k, (s, _) in safetensors_shapes(base).items()
    }
    trained, before = load_file(exported / "model.safetensors"), load_file(base / "model.safetensors")
    assert any(not torch.equal(trained[k], before[k]) for k in hub_layout_expert_keys(base))  # experts' adapters


# --- multimodal: the language model trains on text, the vision tower and processor files ride along -----------


@pytest.mark.parametrize("name", ["qwen3_5_vl", "gemma3_vl"])
def test_a_multimodal_checkpoint_trains_on_text_and_exports_with_its_vision_tower(world, storage, tmp_path, name):
    from transformers import AutoModelForImageTextToText

    base = family(world, name)
    architectures = json.loads((base / "config.json").read_text())["architectures"]
    assert architectures[0].endswith("ForConditionalGeneration") and checkpoint_problem(base) is None
    init_run(storage, name, config(world, base))
    for k in range(2):
        out = run_iteration(storage, name, k)
    policy = out["learn"].manifest.files
    assert {"policy/preprocessor_config.json", "policy/config.json"} <= {f.path for f in policy}
    exported = tmp_path / "ex"
    assert main(["--storage", storage.url, "export", "--run", name, str(exported)]) == 0
    assert json.loads((exported / "config.json").read_text())["architectures"] == architectures
    assert "AutoModelForImageTextToText.from_pretrained(" in (exported / "README.md").read_text()  # the model card
    assert (exported / "preprocessor_config.json").read_bytes() == (base / "preprocessor_config.json").read_bytes()
    trained, before = load_file(exported / "model.safetensors"), load_file(base / "model.safetensors")
    assert trained.keys() == before.keys()
    vision = [k for k in before if "visual" in k or "vision_tower" in k or "multi_modal_projector" in k]
    assert vision and all(torch.equal(trained[k], before[k]) for k in vision)  # carried unchanged
    assert any(not torch.equal(trained[k], before[k]) for k in before if k not in vision)  # the language model trained
    model, info = AutoModelForImageTextToText.from_pretrained(exported, output_loading_info=True)
    assert type(model).__name__ == architectures[0]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


# --- the learner alone on a forced batch: hybrid (Qwen3.5) and MoE families, LoRA and fsdp2 -----------------------


def forced_batch(vocab: int, groups: int = 2, g: int = 2, seed: int = 0):
    """Random prompts (P, 5) and responses (P*G, 4), advantages +1 / -1 in every group: an update that moves."""
    from grpo.learner.batch import Batch

    gen, n = torch.Generator().manual_seed(seed), groups * g
    prompt_ids = torch.randint(3, vocab, (groups, 5), generator=gen)
    response_ids = torch.randint(3, vocab, (n, 4), generator=gen)
    mask = torch.ones(n, 4)
    advantages = torch.tensor([1.0, -1.0] * (n // 2))
    return Batch(
        prompt_ids,
        torch.ones_like(prompt_ids),
        response_ids,
        mask,
        mask,
        torch.full((n, 4), -math.log(vocab)),  # a random model's log-prob of a token: the ratio starts near 1
        torch.full((n, 4), -1),  # sampled by the base (version -1), which iteration 0 starts from
        advantages,
        advantages.clone(),
        g,
        [i // g for i in range(n)],
        [i % g for i in range(n)],
    )


def learn_once(model_dir: Path, out: Path, *settings: str, nproc: int = 1) -> Path:
    """One learn of `forced_batch` on the checkpoint in model_dir (policy and reference), in this process or under
    torchrun (gloo on CPU); returns the folder its policy/ (or adapter/) is in."""
    from grpo.learner.launch import learner_args, run_distributed
    from grpo.learner.rank import new_learner, train_and_save

    # pi_old the sampler's (forced_batch's) and no KL: the update alone
    cfg = load_config(
        None, ["learn.old_logprobs=sampler", "learn.kl_coef=0", "learn.mixed_precision=no", *STEP, *settings]
    )
    vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size") or 300
    batch = forced_batch(min(vocab, 300))
    out.mkdir(parents=True)
    if nproc == 1:
        train_and_save(new_learner(cfg, 0, str(model_dir), str(model_dir), None, None), "t", 0, batch, str(out))
        return out
    folders = dict(policy_dir=str(model_dir), ref_dir=str(model_dir), state_dir=None, adapter_dir=None)
    (out / "tmp").mkdir()
    run_distributed(learner_args(cfg, "t", 0, batch, folders, str(out), str(out / "tmp")), nproc)
    return out


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_multimodal_qwen3_5_learner_trains_its_language_model_and_saves_its_vision_tower(world, tmp_path, nproc):
    """In one process and sharded over two (fsdp2), with weight decay: the vision tower is frozen (AdamW holds the
    language model alone) and saved unchanged, the architecture is the checkpoint's."""
    from transformers import AutoModelForImageTextToText

    base = family(world, "qwen3_5_vl")
    sharded = ["learn.sharding=fsdp2", "learn.num_processes=2"] if nproc == 2 else []
    policy = learn_once(base, tmp_path / "out", "learn.weight_decay=0.1", *sharded, nproc=nproc) / "policy"
    config = json.loads((policy / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "vision_config" in config
    trained, before = load_file(policy / "model.safetensors"), load_file(base / "model.safetensors")
    assert trained.keys() == before.keys()
    vision = [k for k in before if k.startswith("model.visual.")]
    assert vision and all(torch.equal(trained[k], before[k]) for k in vision)
    assert any(not torch.equal(trained[k], before[k]) for k in before if k.startswith("model.language_model."))
    model, info = AutoModelForImageTextToText.from_pretrained(policy, output_loading_info=True)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    if nproc == 1:  # AdamW holds the language model's parameters alone
        (group,) = torch.load(policy.parent / "optimizer.pt", weights_only=True)["param_groups"]
        assert len(group["params"]) == sum(1 for n, _ in model.named_parameters() if not n.startswith("model.visual."))


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_moe"])
def test_lora_with_the_default_targets_trains_a_hybrid_and_a_moe_family(world, tmp_path, name):
    """The default target_modules are layers of both (Qwen3-MoE's gate/up/down_proj inside its experts, which
    transformers fuses and peft adapts as the fused tensors); a typo is still refused."""
    from grpo.config import ConfigError
    from stages.init import check_lora_targets

    base, lora = family(world, name), "learn.lora={r: 2, alpha: 4}"
    check_lora_targets(load_config(None, [lora]), str(base))
    with pytest.raises(ConfigError, match="'q_prj' names no linear layer"):
        check_lora_targets(load_config(None, ["learn.lora={r: 2, target_modules: [q_prj, q_proj]}"]), str(base))
    adapter = load_file(learn_once(base, tmp_path / "out", lora) / "adapter/adapter_model.safetensors")
    trained = {k for k, v in adapter.items() if "lora_B" in k and v.abs().max() > 0}  # B starts at 0
    assert any(".self_attn.q_proj." in k for k in trained) and any(".mlp." in k for k in trained), trained
    if name == "qwen3_moe":
        assert any(".mlp.experts." in k for k in trained)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_moe"])
def test_fsdp2_on_two_processes_trains_a_hybrid_and_a_moe_family_as_one_process_does(world, tmp_path, name):
    base = family(world, name)
    one = load_file(learn_once(base, tmp_path / "one") / "policy/model.safetensors")
    two = learn_once(base, tmp_path / "two", "learn.sharding=fsdp2", "learn.num_processes=2", nproc=2)
    sharded, before = load_file(two / "policy/model.safetensors"), load_file(base / "model.safetensors")
    assert sharded.keys() == before.keys() == one.keys()  # the hub's layout, per-expert for the MoE
    assert any(not torch.equal(sharded[k], before[k]) for k in before)
    assert max((sharded[k] - one[k]).abs().max().item() for k in one) < 1e-5


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_a_trained_moe_policy_loads_in_vllm_and_samples_what_transformers_does(world, tmp_path):
    """The policy the learner saves (what export copies) in the hub's per-expert layout: vLLM's Qwen3-MoE loader
    takes it, and its greedy tokens and log-probs are those of the transformers sampler on the same folder."""
    from grpo.sampling.base import SamplingSpec
    from grpo.sampling.vllm_engine import VLLMGenerator

    policy = learn_once(family(world, "qwen3_moe"), tmp_path / "out") / "policy"
    prompts, spec = [[5, 9, 17, 33], [40, 41, 42]], SamplingSpec(temperature=0.0, max_tokens=4)
    want = HFGenerator(str(policy)).generate(prompts, spec)
    engine = VLLMGenerator(str(policy), enforce_eager=True, max_model_len=64)
    try:
        got = engine.generate(prompts, spec)
    finally:
        engine.close()
    for (a,), (b,) in zip(want, got):
        assert a.response_ids == b.response_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
