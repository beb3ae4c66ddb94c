"""Progress inside a rollouts chunk (the prompts whose samples have all ended, as the sampler goes) only watches
the sampling: the committed rollouts are byte for byte those of a sampler never asked for progress."""

import functools
import importlib.util
import logging
import re

import pytest
from test_stages import make_run

from grpo import progress
from grpo.record.storage import open_storage
from grpo.sampling import engines
from stages import stage_function

VLLM = pytest.param(
    "vllm",
    marks=[
        pytest.mark.vllm,
        pytest.mark.slow,
        pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    ],
)


def sample(tmp_path, name: str, backend: str):
    """Snapshot and rollouts of iteration 0 of a tiny run in its own storage: the rollouts' committed files."""
    storage = open_storage((tmp_path / name).as_uri())
    make_run(storage, "t", extra=[f"rollout.backend={backend}", "rollout.chunk_prompts=8"])  # 16 prompts: 2 chunks
    stage_function("snapshot")(storage, "t", 0)
    out = stage_function("rollouts")(storage, "t", 0)
    return {f.path: f.sha256 for f in out.manifest.files}


@pytest.mark.parametrize("backend", ["hf", VLLM])
def test_progress_within_a_chunk_leaves_the_samples_as_they_are(tmp_path, monkeypatch, caplog, backend):
    cls = engines.BACKENDS[backend]
    generate = cls.generate
    try:
        monkeypatch.setattr(
            cls,
            "generate",
            lambda self, prompts, spec, budgets=None, progress=None: generate(self, prompts, spec, budgets),
        )
        silent = sample(tmp_path, "silent", backend)  # the sampler never sees a progress callback

        monkeypatch.setattr(cls, "generate", generate)
        monkeypatch.setattr("stages.rollouts.Progress", functools.partial(progress.Progress, every_s=0))
        with caplog.at_level(logging.INFO, logger="grpo.progress"):
            watched = sample(tmp_path, "watched", backend)  # every step's count reported
    finally:
        engines.close_generators()
    assert watched == silent and "rollouts.parquet" in watched

    counts = [
        int(m.group(1)) for r in caplog.records if (m := re.fullmatch(r"rollouts 0: (\d+)/16 prompts", r.message))
    ]
    assert counts == sorted(counts) and counts[-1] == 16, counts
    assert {8, 16} <= set(counts)  # each chunk's end
    assert set(counts) - {8, 16}, counts  # and prompts ending inside the chunks
