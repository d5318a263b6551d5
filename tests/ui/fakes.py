"""Stand-ins for the ranks, so the UI can be driven with a real Workbench and no processes.

`FakeSession` answers the Workbench's narrow interface to its ranks
(`RankSession`: capabilities, apply, train) the way ranks would, and emits
synthetic StepMetrics to the subscribers of a `FakePool` from a thread, as the
real pool's I/O thread does. `fake_workbench()` puts them together.
`step_metrics` builds records with or without the telemetry fields that probes fill.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import workbench as wb
from workbench.schedules import Action
from workbench.telemetry.events import Interval, StepMetrics


def step_metrics(rank: int, step: int, *, layout: str = "dp2", telemetry: bool = True, loss: float | None = None,
                 skipped: bool = False, actions: list[tuple[Action, int, int]] = ()) -> StepMetrics:
    """One synthetic step; `actions` are pipeline actions as (action, start_ms, end_ms), reported as the probes
    report them: a compute interval named like torch's actions ("1F0") and a `pipeline_actions` entry."""
    base = 1_000_000_000 + step * 20_000_000
    intervals: tuple[Interval, ...] = ()
    extra: dict[str, Any] = {}
    if telemetry:
        ms = 1_000_000
        intervals = (Interval("compute", "forward", base, base + 2 * ms),
                     Interval("compute", "backward", base + 2 * ms, base + 6 * ms),
                     Interval("comm", "all_reduce", base + 4 * ms, base + 7 * ms, bytes=1 << 20, group_size=2,
                              group="mesh_dp"),
                     Interval("wait", "all_reduce", base + 6 * ms, base + 7 * ms),
                     Interval("compute", "optimizer", base + 7 * ms, base + 8 * ms))
        intervals += tuple(Interval("compute", str(action), base + a * ms, base + b * ms) for action, a, b in actions)
        extra["pipeline_actions"] = tuple((action.stage, action.microbatch, action.kind, base + a * ms, base + b * ms)
                                          for action, a, b in actions)
        extra |= dict(memory={"parameters": 3_600_000 + rank, "gradients": 3_600_000, "optimizer": 7_200_000,
                             "activations": 0, "other": 100_000},
                     peak_memory={"parameters": 3_600_000, "gradients": 3_600_000, "optimizer": 7_200_000,
                                  "activations": 20_000_000 + rank, "other": 100_000},
                     comm_time_s=0.003, exposed_comm_s=0.001, overlap=2 / 3, flops=1e9, mfu=0.05,
                     mfu_basis="a datasheet peak (fake)")
    return StepMetrics(step=step, loss=5.0 - 0.01 * step if loss is None else loss, tokens=2048, step_time_s=0.2,
                       tokens_per_s=10240.0, rank=rank, layout=layout, skipped=skipped, intervals=intervals, **extra)


class FakeHandle:
    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: list | None = None
        self._error: BaseException | None = None

    def finish(self, value: list | None = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> list:
        if not self._done.wait(timeout):
            raise TimeoutError("still running")
        if self._error is not None:
            raise self._error
        return self._value


class FakePool:
    """The generic pool a Workbench holds: subscriptions, flags, restarts, and `run` of any function (here, once,
    in this process, its value given for every rank: what a %%ranks cell needs)."""

    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self.device, self.backend = "cpu", "gloo"
        self.broken, self.broken_reason = False, None
        self.restarts = 0
        self.flags: dict[str, Any] = {}
        self._subscribers: list[Callable[[int, Any], None]] = []

    def subscribe(self, callback: Callable[[int, Any], None]) -> Callable[[], None]:
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    def emit(self, rank: int, event: Any) -> None:
        for callback in list(self._subscribers):  # as the pool's I/O thread delivers them
            callback(rank, event)

    def set_flag(self, name: str, value: Any) -> None:
        self.flags[name] = value

    def restart(self) -> None:
        self.restarts += 1

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list:
        return [fn(*args, **kwargs)] * self.world_size


class FakeSession:
    """The Workbench's commands to its ranks (`workbench.rank_session.RankSession`) answered as two CPU ranks would:
    capabilities, apply (reshard unless a new model), and train at `step_s` per step, emitting synthetic
    StepMetrics through the pool from a thread."""

    def __init__(self, pool: FakePool, step_s: float = 0.01, telemetry: bool = True) -> None:
        self.pool, self.step_s, self.telemetry = pool, step_s, telemetry
        self.applied: list = []
        self.next_step = 0
        self.layout = ""

    def capabilities(self) -> dict[str, Any]:
        return {"device": "cpu", "name": "cpu", "bf16": True, "fp16": False}

    def apply(self, cfg: Any, corpus: Any, telemetry: bool, fresh: bool, flops_per_token: Any = None) -> dict[str, Any]:
        # Like the ranks: the trained model is resharded unless a new one is asked for or its shape changed.
        resharded = bool(self.applied) and not fresh and self.applied[-1].model == cfg.model
        if not resharded:
            self.next_step = 0
        self.applied.append(cfg)
        self.layout = cfg.layout
        return {"layout": cfg.layout, "params_local": 1, "resharded": resharded}

    def train(self, steps: int, run_id: str, saves: Any) -> FakeHandle:
        handle = FakeHandle()
        threading.Thread(target=self._train, args=(handle, steps, run_id), daemon=True).start()
        return handle

    def _train(self, handle: FakeHandle, steps: int, run_id: str) -> None:
        done = []
        for _ in range(steps):
            time.sleep(self.step_s)
            for r in range(self.pool.world_size):
                m = step_metrics(r, self.next_step, layout=self.layout, telemetry=self.telemetry)
                self.pool.emit(r, m)
                if r == 0:
                    done.append(m)
            self.next_step += 1
            if self.pool.flags.get("stop") == run_id:
                break
        handle.finish([done] * self.pool.world_size)


def fake_workbench(world_size: int = 2, step_s: float = 0.01) -> wb.Workbench:
    """A real Workbench over the fakes: `bench.pool` is a FakePool, `bench.session` a FakeSession."""
    pool = FakePool(world_size)
    return wb.Workbench(pool=pool, session=FakeSession(pool, step_s))
