"""One module per GRPO stage: plain functions over storage URLs, no Prefect.

Every stage function has the signature `(storage, run_id, iteration, force=False) -> Committed`.
"""

from __future__ import annotations

import functools
import importlib

from grpo.record.layout import OPTIONAL_STAGES, STAGES, STATE_STAGE
from grpo.record.lineage import dead_end
from stages.common import StageError

# the function of each stage of grpo.record.layout.STAGES (the order lives there): module stages.<name>,
# function <name>, except where named here
_FUNCTIONS = {name: f"stages.{name}:{ {'eval': 'evaluate'}.get(name, name) }" for name in (*STAGES, *OPTIONAL_STAGES)}
_FUNCTIONS[STATE_STAGE] = "stages.learn:remake_state"  # a learn's resume state, remade alone (`grpo stage state`)


def stage_function(name: str):
    """The function of stage `name`; unknown names list the valid ones. Called with force=True it first refuses
    a new attempt the run could not rebuild after (grpo.record.lineage.dead_end), writing nothing."""
    if name not in _FUNCTIONS:
        raise StageError(f"unknown stage {name!r}; valid stages: {', '.join(_FUNCTIONS)}")
    module, attr = _FUNCTIONS[name].split(":")
    fn = getattr(importlib.import_module(module), attr)

    @functools.wraps(fn)
    def run(storage, run_id: str, iteration: int, force: bool = False, **kwargs):
        if force and (stuck := dead_end(storage, run_id, iteration, name)):
            raise StageError(stuck)
        return fn(storage, run_id, iteration, force=force, **kwargs)

    return run


__all__ = ["STAGES", "StageError", "stage_function"]
