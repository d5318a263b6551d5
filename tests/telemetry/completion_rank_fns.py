"""Rank functions for tests/telemetry/test_completion_order.py: collectives whose completion stamps run late."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from workbench.telemetry import native


@contextlib.contextmanager
def late_stamps(ms: float) -> Iterator[None]:
    """Every CPU completion callback stores its span `ms` late, as a completion thread scheduled late does."""
    native.load().delay_cpu_stamps(int(ms * 1e6))
    try:
        yield
    finally:
        native.load().delay_cpu_stamps(0)


def delay_stamps(ms: float) -> None:
    native.load().delay_cpu_stamps(int(ms * 1e6))


def paced_past_completion() -> int:
    """Collectives the emulation paced whose real transfer ended before their emulated time (all but overruns)."""
    paced, overruns = native.load().emulation_counts()
    return paced - overruns


def collectives_found_done(ms: float) -> dict[str, int]:
    """For each way a caller learns a collective is done, how many spans the recorder holds right after (1 each)."""
    import torch
    import torch.distributed as dist

    recorder = native.recorder()
    was = recorder.enabled
    recorder.set_enabled(True)
    found = {}
    try:
        with late_stamps(ms):
            dist.barrier()
            native.drain()
            dist.all_reduce(torch.ones(256))  # torch waits on the Work inside
            found["wait inside the call"] = _collectives(native.drain())
            work = dist.all_reduce(torch.ones(256), async_op=True)
            work.wait()
            found["wait"] = _collectives(native.drain())
            work = dist.all_reduce(torch.ones(256), async_op=True)
            while not work.is_completed():
                pass
            found["is_completed"] = _collectives(native.drain())
            dist.all_reduce(torch.ones(256), async_op=True).get_future().wait()
            found["future"] = _collectives(native.drain())
    finally:
        recorder.set_enabled(was)
    return found


def _collectives(records) -> int:
    return sum(r.kind == "comm" for r in records)
