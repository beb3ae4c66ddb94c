"""Deployment glue: what a worker does before it runs a flow of this checkout (prefect.yaml's pull step)."""

from __future__ import annotations

import os
from pathlib import Path


def work_in_checkout() -> dict[str, str]:
    """Prefect pull step (prefect.yaml): run the flow from the checkout this module is in.

    It runs on the worker's machine when a flow run starts, so the deployment stores no path;
    relative paths (GRPO_STORAGE=storage, a config file) then mean what they mean in a shell at
    the repo root. A process worker would otherwise start each flow run in a temporary folder.
    """
    root = Path(__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file():
        raise RuntimeError(f"{root} is not a grpo-flow checkout: install with `./setup.sh` in a clone")
    os.chdir(root)
    return {"directory": str(root)}
