"""Shared fixtures: a session-scoped pool of 2 CPU ranks, respawned when a test breaks it."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def pytest_collection_modifyitems(config, items):
    if not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def _session_pool():
    import workbench as wb

    # The recording backend, as a Workbench runs it: every collective of every test goes through it.
    pool = wb.Pool(2, device="cpu", timeout_s=120, backend_setup="workbench.telemetry.comm:register")
    yield pool
    pool.close()


@pytest.fixture
def pool(_session_pool):
    """The shared 2-rank CPU pool, healthy at the start of every test."""
    if _session_pool.broken:
        _session_pool.restart()
    yield _session_pool


@pytest.fixture(scope="session")
def _session_pool4():
    import workbench as wb

    pool = wb.Pool(4, device="cpu", timeout_s=180, backend_setup="workbench.telemetry.comm:register")
    yield pool
    pool.close()


@pytest.fixture
def pool4(_session_pool4):
    """Four CPU ranks (dp×tp, dp×pp layouts), shared by the whole session, healthy at the start of every test."""
    if _session_pool4.broken:
        _session_pool4.restart()
    yield _session_pool4
