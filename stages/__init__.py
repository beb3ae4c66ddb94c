"""One module per GRPO stage: plain functions over storage URLs, no Prefect."""
