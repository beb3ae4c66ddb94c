"""Prefect wiring of the GRPO stages: the flow `grpo` in flows/grpo.py, deployed by prefect.yaml."""
