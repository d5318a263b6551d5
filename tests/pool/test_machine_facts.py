"""What ranks measure about the machine is measured once per machine: restarted ranks, and the ranks of the next
pool or kernel of the user, read it."""

from __future__ import annotations

import os

import pytest

from workbench import machine

pytestmark = [pytest.mark.processes, pytest.mark.mostly_waits]  # make check leaves these out: each starts its own
# processes; make test runs them beside the tests that compute (tests/run_suite.py)


def _cpu_peaks(budget_s: float) -> tuple[dict, int]:
    from workbench import hardware

    return hardware.measure_cpu(budget_s).peak_flops, os.getpid()


def test_restarted_ranks_reuse_the_first_ranks_cpu_measurement(pool):
    budget = 0.013  # a figure no other test asks for: this test's ranks measure it first
    first = pool.run(_cpu_peaks, budget)
    pool.restart()
    again = pool.run(_cpu_peaks, budget)
    assert {pid for _, pid in first}.isdisjoint(pid for _, pid in again), "fresh processes"
    # A timed measurement is never the same float twice: equal figures were read, not measured again.
    assert {tuple(p.items()) for p, _ in again} <= {tuple(p.items()) for p, _ in first}


def test_without_a_pool_folder_a_fact_is_measured_at_each_call(monkeypatch, tmp_path):
    calls = []

    def measure():
        calls.append(1)
        return {"n": len(calls)}

    monkeypatch.delenv(machine.MACHINE_FACTS, raising=False)
    assert [machine.machine_fact("x", measure)["n"] for _ in range(2)] == [1, 2]
    monkeypatch.setenv(machine.MACHINE_FACTS, str(tmp_path))
    assert [machine.machine_fact("x y/z", measure)["n"] for _ in range(2)] == [3, 3]
    # Kept under the machine's identity: measured again on another CPU, or with another torch.
    assert [p.name for p in tmp_path.iterdir()] == [f"x_y_z-{machine.machine_identity()}.json"]
    (tmp_path / f"x_y_z-{machine.machine_identity()}.json").write_text("{half")  # a rank that died while writing
    assert machine.machine_fact("x y/z", measure)["n"] == 4


def _fact(name: str) -> tuple[dict, int]:
    return machine.machine_fact(name, lambda: {"pid": os.getpid()}), os.getpid()


def test_the_next_pool_reads_what_an_earlier_pool_measured():
    """A notebook's first apply does not measure the CPU again: the user's earlier pools did (the folder is the
    user's runtime folder, private to this test run)."""
    import workbench as wb

    name = f"test-next-pool-{os.getpid()}"
    with wb.Pool(2, device="cpu", standby=False) as first:
        measured = first.run(_fact, name)
    with wb.Pool(2, device="cpu", standby=False) as second:
        read = second.run(_fact, name)
    assert {pid for _, pid in read}.isdisjoint(pid for _, pid in measured)
    assert {f["pid"] for f, _ in read} <= {pid for _, pid in measured}, "read, not measured again"
