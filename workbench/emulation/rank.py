"""The emulation on a rank: tells the recording backend what each process group costs on the emulated cluster,
and keeps the time dilation measured.

The recording backend keeps every group it creates with its global ranks (`workbench.telemetry.comm.groups`), so
the emulation prices each one whenever it is switched on by `install(cluster)`, sent through `pool.run`
(`wb.Workbench(cluster=...)` does), and each new one as it is created. Off, nothing here runs per collective.

Where every rank of the pool is on one host, each group's ranks share a small file (mapped memory) in which
each stamps when it issued each collective, so the backend knows exactly when a collective's last peer arrived
(CLOCK_MONOTONIC is one clock for the whole host). Across hosts it estimates that from this machine's own
transfer times, measured by `calibrate`.
"""

from __future__ import annotations

import os
import re
import socket
from collections import deque
from dataclasses import replace
from typing import Any

from workbench.emulation.cluster import (DEFAULT_REAL, Cluster, RealLinks, dilation_from_steps, fit_real, group_lines,
                                        stage_target_s)
from workbench.pool import rank

MEASURED_STEPS = 3
"""The dilation is the lowest over this many latest steps: one slow step (a collection, a page fault) does not
swing it."""

_cluster: Cluster | None = None
_arrivals: str | None = None
"""The folder of the groups' shared arrival files; None when the ranks span hosts."""
_real: RealLinks = dict(DEFAULT_REAL)
"""This machine's own transport, measured by `calibrate` (a conservative default until then)."""
_recent: deque = deque(maxlen=MEASURED_STEPS)
"""The latest steps' metrics, for the measured dilation, all of the layout `_layout`."""
_layout: Any = None
_targets: tuple[Any, tuple[float, ...]] | None = None
"""(layout, the target GPU's compute per pipeline stage of it), as the notebook sent it (`set_targets`)."""


def _native():
    from workbench.telemetry import native

    return native.load()


def _groups() -> dict[str, tuple[tuple[int, ...], int]]:
    """Every group of this process: uid -> (its global ranks, this rank's global rank)."""
    from workbench.telemetry import comm

    return comm.groups


def _on_group(uid: str) -> None:
    """A process group was created (the recording backend tells): price it if a cluster is emulated."""
    if _cluster is not None:
        _price(uid)


def _price(uid: str) -> None:
    ranks, me = _groups()[uid]
    lines = group_lines(ranks, me, _cluster.topology, _real)
    # One file per group, named by its uid, which every member knows alike.
    shared = os.path.join(_arrivals, "group-" + re.sub(r"[^A-Za-z0-9_.-]", "_", uid)) if _arrivals else ""
    _native().emulation_set_group(uid, *lines.as_native(), ranks.index(me), shared)


def install(cluster: Cluster, arrivals: str | None = None) -> str:
    """Emulate `cluster` (shaped for the world: `Cluster.for_world`) on this rank from now on; returns the status
    line. Every rank runs it at once (through `pool.run`), with the same `arrivals`: a folder every rank can
    write, for the groups' shared arrival times (used only when every rank is on this host)."""
    import torch.distributed as dist

    global _cluster, _arrivals
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    # Shaped once, in the notebook (`workbench.emulated`); a bare one sent here directly is shaped for this world.
    _cluster = cluster if cluster.topology is not None else cluster.for_world(dist.get_world_size())
    _arrivals = arrivals if arrivals and len(set(hosts)) == 1 else None
    rank.place_on_nodes([_cluster.topology.node_of(r) for r in range(dist.get_world_size())])
    _recent.clear()
    ext = _native()
    ext.emulation_clear()
    for uid in _groups():
        _price(uid)
    from workbench.telemetry import comm

    comm.observe_groups(_on_group)  # and each group created from now on
    ext.emulation_set_dilation(_cluster.dilation or 0.0)  # measured: unpaced until the first step is measured
    if _device_is_cuda():
        import ctypes

        from workbench.telemetry import cuda

        lib = cuda.load()
        ext.emulation_set_cuda_pacer(ctypes.cast(lib.wb_emulate_stamp, ctypes.c_void_p).value,
                                     ctypes.cast(lib.wb_emulate_hold, ctypes.c_void_p).value)
    return status()["line"]


CALIBRATION_SIZES = (2**16, 2**21)


def calibrate() -> dict[str, tuple[float, float]]:
    """Measure this machine's own transport (every kind, unpaced, at two sizes on the world group) and price
    every group with it; all ranks at once. Returns kind -> (latency s, s per bus byte). Only ranks on several
    hosts need it (elsewhere the arrivals are read, not estimated)."""
    import torch.distributed as dist

    from workbench.emulation.collectives import KINDS, time_kinds

    global _real
    ext = _native()
    paced = ext.emulation_dilation()
    ext.emulation_set_dilation(0.0)
    gathered: list = [None] * dist.get_world_size()
    try:
        times = time_kinds(KINDS, CALIBRATION_SIZES, reps=2)
        # The slowest rank's times: a collective ends together everywhere, so that is what each one waited.
        dist.all_gather_object(gathered, times)
    finally:
        ext.emulation_set_dilation(paced)
    slowest = {key: max(t[key] for t in gathered) for key in times}
    _real = fit_real(slowest, *CALIBRATION_SIZES, n=dist.get_world_size())
    if _cluster is not None:
        for uid in _groups():
            _price(uid)
    return dict(_real)


def uninstall() -> None:
    """Back to this machine's own links."""
    global _cluster
    _cluster = None
    rank.place_on_nodes(None)
    _recent.clear()
    ext = _native()
    ext.emulation_clear()
    ext.emulation_set_dilation(0.0)


def _device_is_cuda() -> bool:
    # Asked as the world group is created too, before the rank knows its device: CUDA present is enough.
    import torch

    return torch.cuda.is_available()


def cluster() -> Cluster | None:
    return _cluster


def dilation() -> float | None:
    """The dilation collectives are paced with now; None while unpaced (emulation off, or not measured yet)."""
    value = _native().emulation_dilation()
    return value if _cluster is not None and value > 0 else None


def set_targets(cfg: Any, stages: tuple[float, ...]) -> None:
    """The target GPU's compute of one step per pipeline stage of layout `cfg`
    (`workbench.emulation.predict.stage_compute_s`), which a measured dilation divides by: computed once in the
    notebook when the layout is applied, so no rank runs the estimator."""
    global _targets
    _targets = (cfg, tuple(stages))


def _target_s(cfg: Any, rank: int) -> float:
    if _targets is None or _targets[0] != cfg:
        raise RuntimeError(f"emulation: no target compute for {cfg.layout}, which a measured time dilation divides "
                           "by; the notebook sends it when it applies a layout (emulation.rank.set_targets)")
    return stage_target_s(_targets[1], cfg, rank)


def after_step(metrics: Any, cfg: Any) -> Any:
    """The step's metrics (`StepMetrics`) with the dilation its collectives were paced with; and the dilation
    measured from it: its compute spans, less waits, against the target GPU's compute of the same step
    (sent by `set_targets`), the lowest of the latest few of this layout, then agreed with the other ranks (the
    largest), so every rank paces for the same cluster time. Every rank calls it after every step. A fixed
    dilation, or no cluster, leaves the dilation as it is. The engine's session calls it as a step observer
    (`workbench.engine.session.observe_steps`, registered by the Workbench when it installs a cluster)."""
    global _layout
    if _cluster is None:
        return metrics
    paced = dilation()
    if _cluster.dilation is None and metrics.intervals:
        if cfg != _layout:  # a new layout computes differently: its dilation is measured afresh (paced meanwhile)
            _recent.clear()
            _layout = cfg
        _recent.append(metrics)
        target = _target_s(cfg, metrics.rank)
        agreed = _agree(dilation_from_steps(list(_recent), target, MEASURED_STEPS))
        if agreed is not None:
            _native().emulation_set_dilation(agreed)
    return replace(metrics, dilation=paced) if paced is not None else metrics


def _agree(mine: float | None) -> float | None:
    """The largest of the ranks' values, by one all-reduce that is itself not paced (nothing else is in flight
    between steps, and every rank has as many steps measured, so all send a value or all send none)."""
    import torch
    import torch.distributed as dist

    ext = _native()
    paced = ext.emulation_dilation()
    ext.emulation_set_dilation(0.0)
    try:
        device = rank.info.device if rank.info is not None and rank.info.device.startswith("cuda") else "cpu"
        value = torch.tensor([mine or 0.0], dtype=torch.float64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    finally:
        ext.emulation_set_dilation(paced)
    return value.item() or None


def status() -> dict[str, Any]:
    """What this rank emulates: the status line, the dilation, and (collectives paced, of them overrun: the
    real transfer outlasted the emulated time)."""
    from workbench.emulation.cluster import status_line

    paced, overruns = _native().emulation_counts()
    d = dilation()
    return {"line": status_line(_cluster, d), "dilation": d, "paced": paced, "overruns": overruns,
            "cluster": _cluster, "arrivals": "shared" if _arrivals else "estimated"}
