"""train(recover=True)'s logic without processes: chunks, snapshots, restarts, what the history keeps.

A fake session trains "steps" whose loss is a pure function of the step; it fails where the test says. The
real thing, with ten SIGKILLs and SIGSTOPs on real ranks, is the soak in test_fault_drills.py.
"""

from __future__ import annotations

import threading

import pytest

from workbench.pool import PoolBroken, RankFrozen, RemoteError, WorkerDied
from workbench.recovery import RecoveringRun
from workbench.telemetry.events import StepMetrics
from workbench.telemetry.store import TelemetryStore


def metrics(step: int) -> StepMetrics:
    return StepMetrics(step=step, loss=1.0 / (step + 1), tokens=16, step_time_s=0.01, tokens_per_s=1.0)


class Done:
    def __init__(self, value=None, error=None):
        self.value, self.error = value, error

    def result(self, timeout=None):
        if self.error is not None:
            raise self.error
        return [self.value]


class FakeSession:
    """Trains by emitting each step into the store; `failures` maps a call number of train() to an error raised
    after `at` steps of that chunk were emitted."""

    def __init__(self, store: TelemetryStore, failures: dict[int, tuple[int, BaseException]]) -> None:
        self.store, self.failures = store, failures
        self.next_step, self.calls, self.log = 0, 0, []

    def train(self, steps, run_id, saves):
        self.calls += 1
        at, error = self.failures.get(self.calls, (steps, None))
        done = []
        for _ in range(min(at, steps)):
            m = metrics(self.next_step)
            self.store.add(0, m)
            done.append(m)
            self.next_step += 1
        return Done(done, error)

    def snapshot(self):
        self.log.append(("snapshot", self.next_step))
        return [{"next_step": self.next_step, "rng": None, "state": {"at": self.next_step}}]

    def apply(self, cfg, corpus, telemetry, fresh, flops_per_token=None):
        self.log.append(("apply", fresh))

    def restore(self, snapshot):
        self.next_step = snapshot[0]["next_step"]
        self.log.append(("restore", self.next_step))
        return self.next_step


class FakePool:
    def __init__(self) -> None:
        self.restarts = 0

    def restart(self) -> None:
        self.restarts += 1


class FakeBench:
    def __init__(self, failures) -> None:
        self.store = TelemetryStore()
        self.session, self.pool = FakeSession(self.store, failures), FakePool()
        self.config, self.corpus, self.telemetry = object(), None, False
        self.cluster = None  # this machine's own links: nothing to re-emulate after a restart

    @property
    def history(self):
        return self.store.steps(0)


def run(bench, steps=10, every=3, max_failures=3):
    return RecoveringRun(bench, steps, "run", None, every, max_failures)


def test_without_failures_it_trains_in_chunks_with_a_snapshot_between_them():
    bench = FakeBench({})
    assert [m.step for m in run(bench).result(10)[0]] == list(range(10))
    assert [e for e in bench.session.log if e[0] == "snapshot"] == [("snapshot", s) for s in (0, 3, 6, 9)]
    assert bench.pool.restarts == 0 and bench.store.recoveries == []


def test_a_dead_rank_sends_it_back_to_the_last_snapshot_and_every_step_is_kept_once():
    # The third chunk (steps 6..8) dies after two of its steps were reported.
    bench = FakeBench({3: (2, WorkerDied(1, -9))})
    trained = run(bench).result(10)[0]
    assert [m.step for m in trained] == list(range(10))
    assert [m.step for m in bench.history] == list(range(10)), "the lost steps 6, 7 were forgotten, then retrained"
    [mark] = bench.store.recoveries
    assert (mark.step, mark.replayed) == (6, 2) and mark.reason.startswith("rank 1 died")
    assert bench.pool.restarts == 1
    assert ("apply", True) in bench.session.log and ("restore", 6) in bench.session.log


def test_a_failure_that_broke_the_pool_between_chunks_is_recovered_from_too():
    broken = PoolBroken("the pool is broken")
    broken.__cause__ = RankFrozen(0, 2.5, "its process is stopped", "nothing", "")
    bench = FakeBench({2: (0, broken)})
    assert [m.step for m in run(bench).result(10)[0]] == list(range(10))
    assert bench.store.recoveries[0].step == 3


def test_errors_of_the_code_are_raised_not_replayed():
    bench = FakeBench({2: (1, RemoteError(0, "ValueError", "bad", "tb"))})
    with pytest.raises(RemoteError):
        run(bench).result(10)
    assert bench.pool.restarts == 0


def test_it_gives_up_after_max_failures_without_progress():
    bench = FakeBench({n: (0, WorkerDied(0, -9)) for n in range(2, 10)})
    with pytest.raises(WorkerDied):
        run(bench, max_failures=3).result(10)
    assert bench.pool.restarts == 3


def test_a_stop_ends_it_at_a_chunk_boundary():
    bench, started, runs = FakeBench({}), threading.Event(), []
    real_train = bench.session.train

    def train_then_stop(steps, run_id, saves):
        started.wait(10)
        runs[0].stop()  # as Run.stop does, while the first chunk trains
        return real_train(steps, run_id, saves)

    bench.session.train = train_then_stop
    runs.append(run(bench))
    started.set()
    assert [m.step for m in runs[0].result(10)[0]] == [0, 1, 2]
