"""Shared fixtures: a session-scoped pool of 2 CPU ranks, respawned when a test breaks it."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import tempfile

import pytest

# Collecting imports torch, transformers and every test module: ~1 million objects that live as long as the run.
# The collector's full passes over them found nothing to free and cost ~10 s of the pure tests' ~2 minutes
# (gc.callbacks, timed); collection runs without it, and what it built is frozen out of every later pass.
gc.disable()


def pytest_collection_finish(session):
    gc.freeze()
    gc.enable()

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test downloads anything (model configs are built from classes)
# No warm standby for the pools tests make (each would prepare a second set of ranks on 2 busy cores); the tests
# of restart and recovery, and the shared 2-rank pool that tests break and restart, ask for one.
os.environ.setdefault("WORKBENCH_STANDBY", "0")
# A runtime folder of the test run's own (workbench/pool/runtime_dir.py): its ranks never take over the user's
# standby nor read the user's machine facts, and the user's kernels never take over a standby a test started.
# Removed at the end of the run; a standby still running there then sees its socket gone and exits.
_RUNTIME = tempfile.mkdtemp(prefix="workbench-tests-")
os.environ["WORKBENCH_RUNTIME_DIR"] = _RUNTIME
# A standby a killed test run leaves behind exits a minute after its last pool, not half an hour.
os.environ.setdefault("WORKBENCH_STANDBY_IDLE_S", "60")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


_RANK_FIXTURES = {"_session_pool", "_session_pool4"}


def pytest_collection_modifyitems(config, items):
    # `make check` leaves out what starts processes; a test on the shared pools starts them whoever asks first.
    for item in items:
        if _RANK_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.processes)
    if not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded_draws():
    """Every test draws the same numbers whatever ran before it: an unseeded draw in one test passed or failed by
    the suite's order (CI failed on one)."""
    import random

    import torch

    random.seed(0)
    torch.manual_seed(0)


def _start_pool(world_size: int, standby: bool = False):
    import workbench as wb

    # The recording backend, as a Workbench runs it: every collective of every test goes through it.
    return wb.Pool(world_size, device="cpu", timeout_s=180, backend_setup="workbench.telemetry.comm:register",
                   standby=standby)


def _healthy(pool):
    """A test that broke the pool (on purpose or not) must not break the next one."""
    if pool.broken:
        pool.restart()
    return pool


@pytest.fixture(scope="session")
def _session_pool():
    with _start_pool(2, standby=True) as pool:  # tests break it often: restarts take the standby
        yield pool


@pytest.fixture(scope="session")
def _session_pool4():
    with _start_pool(4) as pool:
        yield pool


@pytest.fixture
def pool(_session_pool):
    """The shared 2-rank CPU pool, healthy at the start of every test."""
    return _healthy(_session_pool)


@pytest.fixture
def pool4(_session_pool4):
    """Four CPU ranks (dp×tp, dp×pp layouts), shared by the whole session, healthy at the start of every test."""
    return _healthy(_session_pool4)


def pytest_configure(config):
    # Terminated (make test's other parts on a failure, a CI time-out), the run unwinds as if interrupted: its
    # fixtures close their pools and the runtime folder goes, so that nothing it started outlives it.
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def pytest_unconfigure(config):
    shutil.rmtree(_RUNTIME, ignore_errors=True)
