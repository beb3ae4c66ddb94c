"""TRL's GRPOTrainer as the benchmarks set it up (vs_trl.py's two recipes, agent_calculator.py's): the settings they
share in one place, each benchmark's own passed in. TRL is imported when called: it is in the bench extra only."""

from __future__ import annotations

from pathlib import Path


def grpo_config(
    out: Path,
    *,
    batch: int,
    steps: int,
    group: int,
    epochs: int,
    max_tokens: int,
    lr: float,
    schedule: str,
    max_steps: int,
    seed: int,
    cpu: bool = True,
    bf16: bool = False,
    **more,
):
    """TRL's GRPOConfig for `steps` optimizer steps of `batch` samples over each generation (`group` samples a
    prompt, up to `max_tokens` at temperature 1), `epochs` passes over it, no KL; AdamW at `lr` on a `schedule`
    (TRL's lr_scheduler_type) for `max_steps` in all; one log line an iteration (its `steps` x `epochs` optimizer
    steps); nothing saved or reported. `more`: other GRPOConfig fields (loss_type, adam_beta2, ...)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=steps,
        num_generations=group,
        num_iterations=epochs,
        max_completion_length=max_tokens,
        temperature=1.0,
        beta=0.0,
        learning_rate=lr,
        lr_scheduler_type=schedule,
        max_steps=max_steps,
        use_cpu=cpu,
        bf16=bf16,
        logging_steps=steps * epochs,
        save_strategy="no",
        report_to="none",
        seed=seed,
        disable_tqdm=True,
        **more,
    )


def grpo_trainer(config, model_dir: str, tok, reward, dataset, callbacks: list, **more):
    """TRL's GRPOTrainer on the model in `model_dir` (float32 weights), one reward function, the tokenizer `tok`.
    `more`: other GRPOTrainer arguments (environment_factory, ...)."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    return GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32"),
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=callbacks,
        **more,
    )
