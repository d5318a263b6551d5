"""Stand-ins for the rank pool, so the UI can be driven with a real Workbench and no processes.

`FakePool` answers the Workbench's commands the way ranks would (capabilities,
apply, train) and emits synthetic StepMetrics to subscribers from a thread,
as the real pool's I/O thread does. `step_metrics` builds records with or
without the telemetry fields that probes fill.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from workbench.engine.parallel.schedule_grid import Action
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
                     comm_time_s=0.003, exposed_comm_s=0.001, overlap=2 / 3, flops=1e9, mfu=0.05)
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
    """Answers session.capabilities / apply / train like two CPU ranks would; trains at `step_s` per step."""

    def __init__(self, world_size: int = 2, step_s: float = 0.01, telemetry: bool = True) -> None:
        self.world_size, self.step_s, self.telemetry = world_size, step_s, telemetry
        self.device, self.backend = "cpu", "gloo"
        self.broken, self.broken_reason = False, None
        self.applied: list = []
        self.restarts = 0
        self.flags: dict[str, Any] = {}
        self.next_step = 0
        self.layout = ""
        self._subscribers: list[Callable[[int, Any], None]] = []

    def subscribe(self, callback: Callable[[int, Any], None]) -> Callable[[], None]:
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    def set_flag(self, name: str, value: Any) -> None:
        self.flags[name] = value

    def restart(self) -> None:
        self.restarts += 1

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list:
        return self.run_async(fn, *args, **kwargs).result()

    def run_async(self, fn: Callable, *args: Any, **kwargs: Any) -> FakeHandle:
        handle = FakeHandle()
        name = getattr(fn, "__name__", "")
        if name == "capabilities":
            handle.finish([{"device": "cpu", "name": "cpu", "bf16": True, "fp16": False}] * self.world_size)
        elif name == "apply":
            cfg, fresh = args[0], args[-1] is True
            # Like the ranks: the trained model is resharded unless a new one is asked for or its shape changed.
            resharded = bool(self.applied) and not fresh and self.applied[-1].model == cfg.model
            if not resharded:
                self.next_step = 0
            self.applied.append(cfg)
            self.layout = cfg.layout
            handle.finish([{"layout": cfg.layout, "params_local": 1, "resharded": resharded}] * self.world_size)
        elif name == "train":
            threading.Thread(target=self._train, args=(handle, *args), daemon=True).start()
        else:
            handle.finish([fn(*args, **kwargs)] * self.world_size)
        return handle

    def _train(self, handle: FakeHandle, steps: int, run_id: str, *_more: Any) -> None:
        done = []
        for _ in range(steps):
            time.sleep(self.step_s)
            for r in range(self.world_size):
                m = step_metrics(r, self.next_step, layout=self.layout, telemetry=self.telemetry)
                for callback in list(self._subscribers):  # as the pool's I/O thread delivers them
                    callback(r, m)
                if r == 0:
                    done.append(m)
            self.next_step += 1
            if self.flags.get("stop") == run_id:
                break
        handle.finish([done] * self.world_size)
