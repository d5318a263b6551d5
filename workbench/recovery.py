"""Training that recovers by itself: `bench.train(steps, recover=True)`.

The run trains in chunks of `snapshot_every` steps. After each chunk the
notebook takes a snapshot of the training state (model, optimizer, loss
scale, counters: full CPU tensors from rank 0, identical on every rank; data
position and random generators from each rank) and keeps the latest one.
When a rank dies, freezes or hangs, the run restarts the pool (its warm
standby makes that about a second), builds the same layout, restores the
snapshot and trains on from there. Data are a pure function of the step and
the ranks' threads do not change, so the replayed steps give the same losses
bit for bit on CPU; the store records each recovery (`store.recoveries`) and
forgets the lost steps, so the history holds every step once.

Memory: the notebook holds one snapshot, a full copy of the model and its
optimizer state (for AdamW 12 bytes per parameter in fp32: ~10 MB for
`tiny`); taking one costs a gather of the state and its transfer, once per
chunk. A failure that is not the ranks' (an exception in user code, an
out-of-memory error) is raised as usual: replaying it would fail again.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from workbench.pool import CollectiveTimeout, PoolBroken, RankFrozen, WorkerDied
from workbench.telemetry.events import StepMetrics
from workbench.telemetry.runs import Recovery

if TYPE_CHECKING:
    from workbench.checkpoints import SaveSchedule
    from workbench.workbench import Workbench

RECOVERABLE = (WorkerDied, RankFrozen, CollectiveTimeout)
"""What a restart cures: a rank that died, froze, or made no progress."""


def recoverable(failure: BaseException) -> bool:
    """A failure of the ranks (also when it broke the pool between two commands), not of the code or the user."""
    if isinstance(failure, PoolBroken):
        failure = failure.__cause__
    return isinstance(failure, RECOVERABLE)


class RecoveringRun:
    """The handle of a run that recovers by itself (what `Run` waits on): chunks, snapshots and restarts, driven
    from a thread of the notebook's."""

    def __init__(self, bench: "Workbench", steps: int, run_id: str, saves: "SaveSchedule | None",
                 snapshot_every: int, max_failures: int) -> None:
        self.bench, self.steps, self.run_id, self.saves = bench, steps, run_id, saves
        self.snapshot_every, self.max_failures = snapshot_every, max_failures
        self.metrics: list[StepMetrics] = []
        self.recoveries: list[Recovery] = []
        self.failure: BaseException | None = None
        self._stopping = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name=f"workbench-run-{run_id}", daemon=True)
        self._thread.start()

    # -- what Run needs --------------------------------------------------------------------------
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> list[list[StepMetrics]]:
        """[every step's metrics, each step once] (one entry, like a rank-0 command's result)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the run is still training after {timeout} s (it keeps training)")
        if self.failure is not None:
            raise self.failure
        return [list(self.metrics)]

    def stop(self) -> None:
        """No chunk starts after this; the ranks are asked to stop the current one at the next step."""
        self._stopping = True

    # -- the run ---------------------------------------------------------------------------------
    def _supervise(self) -> None:
        try:
            snapshot = self._snapshot()
            failures_in_a_row = 0
            while len(self.metrics) < self.steps and not self._stopping:
                chunk = min(self.snapshot_every, self.steps - len(self.metrics))
                try:
                    trained = self.bench.session.train(chunk, self.run_id, self.saves).result()[0]
                    more = len(trained) == chunk and len(self.metrics) + chunk < self.steps and not self._stopping
                    # The chunk counts once the snapshot after it is held: a failure in between replays it.
                    after = self._snapshot() if more else None
                except Exception as failure:  # noqa: BLE001 - only the ranks' failures are recovered from
                    while True:
                        failures_in_a_row += 1
                        if not recoverable(failure) or failures_in_a_row > self.max_failures:
                            raise failure
                        try:
                            self._recover(failure, snapshot)
                            break
                        except Exception as again:  # noqa: BLE001 - e.g. the fresh ranks failed too
                            failure = again
                    continue
                failures_in_a_row = 0
                self.metrics.extend(trained)
                if len(trained) < chunk:
                    break  # stopped at a step boundary, on request
                if after is not None:
                    snapshot = after
        except BaseException as e:  # noqa: BLE001 - raised from result()
            self.failure = e
        finally:
            self._done.set()

    def _snapshot(self) -> list[dict[str, Any]]:
        return self.bench.session.snapshot()

    def _recover(self, failure: BaseException, snapshot: list[dict[str, Any]]) -> None:
        """A fresh pool (the standby), the same layout, the snapshot; the lost steps forgotten."""
        t0 = time.monotonic()
        bench, step = self.bench, snapshot[0]["next_step"]
        history = bench.history
        replayed = sum(1 for m in history if m.step >= step)
        bench.pool.restart()
        if bench.cluster is not None:
            bench.emulation.install(bench.config)  # fresh ranks run on their own links until told
        bench.session.apply(bench.config, bench.corpus, bench.telemetry, True)
        bench.session.restore(snapshot)
        bench.store.truncate(step)
        mark = Recovery(step, replayed, str(failure).splitlines()[0], time.monotonic() - t0)
        self.recoveries.append(mark)
        bench.store.add_recovery(mark)
