"""grpo-flow: GRPO with verifiable rewards as batch stages over object storage."""
