"""One module per GRPO stage: plain functions over storage URLs, no Prefect.

Every stage function has the signature `(storage, run_id, iteration, force=False) -> Committed`.
"""

from __future__ import annotations

import importlib

from grpo.layout import STAGES
from stages.common import StageError

# the function of each stage of grpo.layout.STAGES (the order lives there): module stages.<name>,
# function <name>, except where named here
_FUNCTIONS = {name: f"stages.{name}:{ {'eval': 'evaluate'}.get(name, name) }" for name in STAGES}


def stage_function(name: str):
    """The function of stage `name`; unknown names list the valid ones."""
    if name not in _FUNCTIONS:
        raise StageError(f"unknown stage {name!r}; valid stages: {', '.join(STAGES)}")
    module, attr = _FUNCTIONS[name].split(":")
    return getattr(importlib.import_module(module), attr)


__all__ = ["STAGES", "StageError", "stage_function"]
