"""The model card every `grpo export` writes (README.md, as the Hugging Face Hub reads it): the base model, the run
and iteration the weights come from, the settings that shaped them, the eval at that iteration, and how to load
the folder."""

from __future__ import annotations

from grpo.config import RunConfig

SETTINGS = [
    "task.name", "task.dataset", "reward.functions", "rollout.prompts_per_iteration", "rollout.group_size",
    "rollout.max_tokens", "rollout.temperature", "learn.loss_type", "learn.agg_mode", "learn.lr", "learn.epochs",
    "learn.minibatch_size", "learn.kl_coef", "learn.clip_eps", "advantage.mode", "learn.lora", "seed",
]  # fmt: skip
"""The settings a card lists (every one is in the run's run.json, and `grpo config show` prints them all)."""


def model_card(
    cfg: RunConfig,
    run_id: str,
    k: int | None,
    source: str,
    evaluated: dict | None,
    adapter: bool,
    folder: str,
    auto: str = "AutoModelForCausalLM",
    warm_start: bool = False,
) -> str:
    """README.md of an export into `folder`: iteration k's policy of run `run_id` (None: its base model), from the
    committed attempt `source`; `evaluated`: that iteration's eval summary (None: not evaluated there); `adapter`:
    an unmerged peft adapter; `auto`: the transformers auto class that loads it as its architecture
    (grpo.record.weights.model_class: AutoModelForImageTextToText for a multimodal checkpoint); `warm_start`: the
    run's warm start (`grpo sft`, k None), `evaluated` its summary (the gate's held-out figures where it has one)."""
    base = cfg.model.base_model
    front = ["---", f"library_name: {'peft' if adapter else 'transformers'}"]
    front += [f"base_model: {base}"] if base and "://" not in base and not base.startswith(("/", ".")) else []
    front += ["tags:", "- grpo", "- grpo-flow", "- reinforcement-learning", "---", ""]
    what = f"the policy of iteration {k}" if k is not None else "the base model (before any training)"
    what = "the warm start (`grpo sft`, supervised steps before GRPO's iteration 0)" if warm_start else what
    form = (
        "a LoRA adapter, unmerged (peft)" if adapter else "full weights" + (", LoRA merged" if cfg.learn.lora else "")
    )
    title = "warm start" if warm_start else f"iteration {k}" if k is not None else "base model"
    at = "- (warm start)" if warm_start else k if k is not None else "- (base)"
    held = f"the warm start's gate: {eval_line(evaluated) or 'no gate set (sft.gate_pass_at_k)'}" if warm_start else ""
    lines = [
        f"# {run_id}, {title}",
        "",
        f"{'Supervised' if warm_start else 'GRPO with verifiable rewards'}, trained by grpo-flow: {what} of run "
        f"`{run_id}`, {form}.",
        "",
        f"- base model: {base or 'a tiny model built from the config (model.*), no download'}",
        f"- run: `{run_id}`, iteration {at}; committed attempt `{source}`",
        f"- held-out figures of {held}" if warm_start else f"- eval at this iteration: {eval_line(evaluated)}",
        "",
        "## Settings that matter",
        "",
        "| setting | value |",
        "| --- | --- |",
        *[f"| `{s}` | `{value(cfg, s)}` |" for s in SETTINGS],
        "",
        "The run's every setting: `grpo config show --run " + run_id + "`.",
        "",
        "## Load",
        "",
        "```python",
        *(load_adapter(base, folder, auto) if adapter else load_model(folder, auto)),
        "```",
        "",
    ]
    return "\n".join(front + lines)


def eval_line(summary: dict | None) -> str:
    """The eval's figures, or why there are none.

    >>> eval_line({"exact_match": 0.75, "reward_mean": 0.8125, "prompts": 128, "avg@4": 0.5})
    'exact_match 0.75, reward_mean 0.8125, avg@4 0.5 (128 held-out prompts)'
    >>> eval_line(None)
    'not evaluated at this iteration (eval.every)'
    """
    if not summary or summary.get("skipped"):
        return "not evaluated at this iteration (eval.every)"
    keys = ["exact_match", "reward_mean"] + [k for k in summary if k.startswith(("avg@", "pass@"))]
    figures = ", ".join(f"{k} {summary[k]:.4g}" for k in keys if isinstance(summary.get(k), (int, float)))
    n = summary.get("prompts")
    return figures + (f" ({n} held-out prompts)" if n else "")


def value(cfg: RunConfig, setting: str):
    node = cfg
    for part in setting.split("."):
        node = getattr(node, part)
    return node


def load_model(folder: str, auto: str) -> list[str]:
    return [
        f"from transformers import {auto}, AutoTokenizer",
        "",
        f'model = {auto}.from_pretrained("{folder}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{folder}")',
    ]


def load_adapter(base: str | None, folder: str, auto: str) -> list[str]:
    where = f'"{base}"' if base else '"BASE_FOLDER")  # the run\'s base: grpo export --run RUN --iteration -1'
    return [
        "from peft import PeftModel",
        f"from transformers import {auto}, AutoTokenizer",
        "",
        f"base = {auto}.from_pretrained({where}" + (")" if base else ""),
        f'model = PeftModel.from_pretrained(base, "{folder}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{folder}")',
    ]
