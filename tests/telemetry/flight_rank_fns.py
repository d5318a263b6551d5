"""Rank-side functions for the flight-recorder tests (module-level, so the pool's ranks can import them)."""

from __future__ import annotations

import threading
import time


def skip_a_collective(timeout_s: float = 3.0) -> dict:
    """Two fresh 2-rank groups ("flight_dp", "flight_tp") with a short timeout: both ranks run one collective on
    each, then rank 1 skips the second dp all-reduce and all-gathers on tp instead. While the main thread is
    blocked, another thread reads this rank's ring (as a pool's I/O thread would); each blocked collective then
    ends at the groups' timeout. The world group is never touched, so the pool stays usable."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from workbench.telemetry import flight

    rank = dist.get_rank()
    timeout = timedelta(seconds=timeout_s)
    dp = dist.new_group([0, 1], timeout=timeout, group_desc="flight_dp")
    tp = dist.new_group([0, 1], timeout=timeout, group_desc="flight_tp")
    x = torch.ones(8)
    dist.all_reduce(x, group=dp)
    dist.broadcast(x, 0, group=tp)
    read: dict = {}

    def reader() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not flight.snapshot().collectives[-1].pending:
            time.sleep(0.01)
        read["ring"] = flight.diagnose()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        if rank == 0:
            dist.all_reduce(x, group=dp)  # rank 1 skips this one...
        else:
            dist.all_gather([torch.empty(8), torch.empty(8)], x, group=tp)  # ...and waits here instead
    except RuntimeError as e:  # the group's timeout ends the wait
        read["error"] = str(e)[:200]
    thread.join(timeout_s)
    read["after"] = flight.diagnose()["collectives"][-1]
    return read
