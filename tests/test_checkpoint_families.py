"""Checkpoints load and save as transformers does (grpo/record/weights.py): a MoE checkpoint in the hub's per-expert
layout is swapped into the sampler, trains and exports back to that layout; a multimodal ForConditionalGeneration
checkpoint trains its language model on text and keeps its vision tower and processor files in every policy and
export; LoRA and fsdp2 train a hybrid (Qwen3.5) and a MoE (Qwen3-MoE) family. Tiny random checkpoints from
tests/families.py, CPU, float32, the transformers sampler."""

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

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
FAST = ["learn.gradient_checkpointing=true", "learn.padding_free=false"]  # the full-sequence path: every family


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


# --- multimodal: the language model trains on text, the vision tower and processor files ride along -----------


@pytest.mark.parametrize("name", ["gemma3_vl"])  # qwen3_5_vl: once the transformers sampler decodes hybrid caches
def test_a_multimodal_checkpoint_trains_on_text_and_exports_with_its_vision_tower(world, storage, tmp_path, name):
    from transformers import AutoModelForImageTextToText

    base = family(world, name)
    architectures = json.loads((base / "config.json").read_text())["architectures"]
    assert architectures[0].endswith("ForConditionalGeneration") and checkpoint_problem(base) is None
    init_run(storage, name, config(world, base, *FAST))
    for k in range(2):
        out = run_iteration(storage, name, k)
    policy = out["learn"].manifest.files
    assert {"policy/preprocessor_config.json", "policy/config.json"} <= {f.path for f in policy}
    exported = Path(export_policy(out["learn"], committed_input(storage, name, None, "base"), str(tmp_path / "ex")))
    assert json.loads((exported / "config.json").read_text())["architectures"] == architectures
    assert (exported / "preprocessor_config.json").read_bytes() == (base / "preprocessor_config.json").read_bytes()
    trained, before = load_file(exported / "model.safetensors"), load_file(base / "model.safetensors")
    assert trained.keys() == before.keys()
    vision = [k for k in before if "visual" in k or "vision_tower" in k or "multi_modal_projector" in k]
    assert vision and all(torch.equal(trained[k], before[k]) for k in vision)  # carried unchanged
    assert any(not torch.equal(trained[k], before[k]) for k in before if k not in vision)  # the language model trained
    model, info = AutoModelForImageTextToText.from_pretrained(exported, output_loading_info=True)
    assert type(model).__name__ == architectures[0]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
