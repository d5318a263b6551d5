"""The emulation on a rank: tells the recording backend what each process group costs on the emulated cluster,
and keeps the time dilation measured.

Every group the recording backend creates passes through `remember_group` (called by
`workbench.telemetry.comm`), so the emulation knows each group's global ranks whenever it is switched on:
at the start, from ``$WORKBENCH_CLUSTER`` (a `Cluster` as JSON, which `wb.Workbench(cluster=...)` sets), or
later by `install(cluster)` sent through `pool.run`. Off, nothing here runs per collective.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

from workbench.emulation.cluster import Cluster, dilation_from_steps, group_lines

ENV = "WORKBENCH_CLUSTER"
"""The environment variable a rank reads its cluster from: `Cluster.to_json()`."""

MEASURED_STEPS = 3
"""The dilation is the median over this many latest steps: one slow step (a collection, a page fault) does not
swing it."""

_groups: dict[str, tuple[tuple[int, ...], int]] = {}
"""uid -> (the group's global ranks, this rank's global rank)."""
_cluster: Cluster | None = None
_recent: deque = deque(maxlen=MEASURED_STEPS)
"""The latest steps' metrics, for the measured dilation."""


def _native():
    from workbench.telemetry import native

    return native.load()


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_world_size()
    return 1 + max((max(ranks) for ranks, _ in _groups.values()), default=0)  # the world is the first group


def remember_group(uid: str, global_ranks: list[int] | tuple[int, ...], group_rank: int) -> None:
    """A process group was created (the recording backend's creator calls this with the group's global ranks
    and this rank's place in it): remember it, and price it if a cluster is emulated."""
    ranks = tuple(global_ranks)
    _groups[uid] = (ranks, ranks[group_rank])
    if _cluster is None and os.environ.get(ENV):
        install(Cluster.from_json(os.environ[ENV]))
    elif _cluster is not None:
        _price(uid)


def _price(uid: str) -> None:
    ranks, me = _groups[uid]
    lines = group_lines(ranks, me, _cluster.topology)
    _native().emulation_set_group(uid, *lines.as_native())


def install(cluster: Cluster) -> str:
    """Emulate `cluster` on this rank from now on; returns the status line. Every rank must install the same."""
    global _cluster
    _cluster = cluster.for_world(_world_size())
    _recent.clear()
    ext = _native()
    ext.emulation_clear()
    for uid in _groups:
        _price(uid)
    ext.emulation_set_dilation(_cluster.dilation or 0.0)  # measured: unpaced until the first step is measured
    if _device_is_cuda():
        import ctypes

        from workbench.telemetry import cuda

        lib = cuda.load()
        ext.emulation_set_cuda_pacer(ctypes.cast(lib.wb_emulate_stamp, ctypes.c_void_p).value,
                                     ctypes.cast(lib.wb_emulate_hold, ctypes.c_void_p).value)
    return status()["line"]


def uninstall() -> None:
    """Back to this machine's own links."""
    global _cluster
    _cluster = None
    _recent.clear()
    ext = _native()
    ext.emulation_clear()
    ext.emulation_set_dilation(0.0)


def _device_is_cuda() -> bool:
    from workbench.pool import rank

    return rank.info is not None and rank.info.device.startswith("cuda")


def cluster() -> Cluster | None:
    return _cluster


def dilation() -> float | None:
    """The dilation collectives are paced with now; None while unpaced (emulation off, or not measured yet)."""
    value = _native().emulation_dilation()
    return value if _cluster is not None and value > 0 else None


def after_step(metrics: Any, precision: str) -> None:
    """Measure the dilation from a finished step (`StepMetrics`): its compute spans, less waits, against the
    target GPU's time for the step's FLOPs; the median of the latest few. A fixed dilation, or no cluster,
    leaves it as it is."""
    if _cluster is None or _cluster.dilation is not None or not metrics.intervals:
        return
    _recent.append(metrics)
    measured = dilation_from_steps(list(_recent), _cluster, precision, MEASURED_STEPS)
    if measured is not None:
        _native().emulation_set_dilation(measured)


def status() -> dict[str, Any]:
    """What this rank emulates: the status line, the dilation, and (collectives paced, of them overrun: the
    real transfer outlasted the emulated time)."""
    from workbench.emulation.cluster import status_line

    paced, overruns = _native().emulation_counts()
    d = dilation()
    return {"line": status_line(_cluster, d), "dilation": d, "paced": paced, "overruns": overruns,
            "cluster": _cluster}
