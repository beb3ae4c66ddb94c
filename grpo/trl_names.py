"""TRL's GRPOConfig names and what each is here, for a user coming from TRL: docs/coming-from-trl.md's table is this
dict (tests/test_api.py holds them equal), and a config naming a TRL field gets its setting in its one line.

Taken from benchmarks/vs_trl.py, which runs TRL 1.16's GRPOTrainer on the recipes grpo-flow runs.
"""

from __future__ import annotations

GRPO_CONFIG: dict[str, tuple[str, str]] = {
    "num_generations": ("rollout.group_size", "samples per prompt, G"),
    "generation_batch_size": ("rollout.prompts_per_iteration", "prompts an iteration samples: TRL's / G"),
    "per_device_train_batch_size": ("learn.minibatch_size", "samples per optimizer step, all processes together"),
    "gradient_accumulation_steps": ("learn.microbatch_size", "samples per forward/backward; they add up to the step"),
    "steps_per_generation": ("learn.minibatch_size", "steps an iteration: prompts x G x epochs / minibatch_size"),
    "num_iterations": ("learn.epochs", "passes over an iteration's samples (mu)"),
    "max_completion_length": ("rollout.max_tokens", "longest response, in tokens"),
    "temperature": ("rollout.temperature", ""),
    "top_p": ("rollout.top_p", ""),
    "use_vllm": ("rollout.backend", "`vllm`; `auto` picks it on a GPU and for models of 10M parameters and up"),
    "beta": ("learn.kl_coef", "0 (TRL's default too) skips the reference"),
    "sync_ref_model": ("learn.ref_update_every", "N: the reference is the policy of every Nth iteration"),
    "epsilon": ("learn.clip_eps", ""),
    "epsilon_high": ("learn.clip_eps_high", "DAPO's upper clip"),
    "loss_type": (
        "learn.agg_mode",
        "grpo: seq_mean_token_mean, dapo/bnpo: token_mean, dr_grpo: seq_mean_token_sum_norm",
    ),
    "importance_sampling_level": ("learn.loss_type", "`sequence`: gspo"),
    "scale_rewards": ("advantage.mode", "`group` (TRL's default): normalized; `none`: centered"),
    "reward_weights": ("reward.weights", ""),
    "mask_truncated_completions": ("reward.truncated_reward", "a cut-off response scores this (TRL drops it)"),
    "vllm_importance_sampling_correction": ("learn.behavior_correction", "`tis` (truncated importance sampling)"),
    "vllm_importance_sampling_cap": ("learn.tis_cap", ""),
    "learning_rate": ("learn.lr", ""),
    "lr_scheduler_type": ("learn.lr_decay_steps", "linear to 0 over this many steps; 0 constant"),
    "adam_beta1": ("learn.betas", "(beta1, beta2)"),
    "adam_beta2": ("learn.betas", "(beta1, beta2)"),
    "weight_decay": ("learn.weight_decay", ""),
    "max_grad_norm": ("learn.max_grad_norm", ""),
    "bf16": ("learn.mixed_precision", "`bf16`; `auto` picks it where the device computes it natively"),
    "gradient_checkpointing": ("learn.gradient_checkpointing", ""),
    "use_liger_kernel": ("learn.logprob_kernel", "`liger` (CUDA)"),
    "seed": ("seed", ""),
    "report_to": ("tracking.backend", "tensorboard, mlflow or wandb"),
    "log_completions": ("tracking.backend", "a table of 8 completions an iteration goes to the tracker"),
    "max_steps": ("", "iterations: `grpo run --iterations N`, train(iterations=N)"),
    "num_train_epochs": ("", "iterations: `grpo run --iterations N`, train(iterations=N)"),
    "output_dir": ("", "storage (`--storage`, $GRPO_STORAGE) and the run id; `grpo export` writes the model"),
    "max_tool_calling_iterations": (
        "rollout.max_turns",
        "assistant turns, the answer's included: N tool turns = N + 1",
    ),
}
"""TRL GRPOConfig field -> (the setting here, "" where it is no setting; how it maps)."""

GRPO_TRAINER: dict[str, tuple[str, str]] = {
    "train_dataset": ("task.dataset", "train(train_dataset=...): a datasets.Dataset, a DataFrame or a path"),
    "reward_funcs": ("reward.functions", "TRL's signatures, environments included; train(reward_funcs=[...])"),
    "tools": ("rollout.tools", "`file.py:function` or `package.module:function`; train(tools=[fn])"),
    "environment_factory": (
        "rollout.environment",
        "`file.py:Class`, or an OpenEnv URL; train(environment_factory=Cls)",
    ),
    "rollout_func": ("rollout.rollout_func", "`file.py:function`, fn(prompts, sampler); train(rollout_func=fn)"),
}
"""TRL GRPOTrainer argument -> (the setting here; how it maps): the agent's, and where data and rewards go."""

NAMES = GRPO_CONFIG | GRPO_TRAINER
"""Every TRL name README's "Coming from TRL" table maps."""


def hint(name: str) -> str:
    """What a TRL name is here, for an unknown setting's line ('' for a name TRL does not have).

    >>> hint("num_generations")
    "TRL's num_generations is rollout.group_size here (samples per prompt, G)"
    """
    if name not in NAMES:
        return ""
    setting, how = NAMES[name]
    what = setting or how
    return f"TRL's {name} is {what} here" + (f" ({how})" if setting and how else "")
