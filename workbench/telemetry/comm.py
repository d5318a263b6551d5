"""The recording communication backend: every collective of every layout, timed natively.

``register()`` makes ``init_process_group(backend="workbench")`` (and every
sub-group: ``new_group``, DeviceMesh) build a C++ backend that wraps gloo
for CPU tensors and NCCL for CUDA tensors, forwards each operation unchanged,
and records one span per collective into the rank's recorder: on CPU start
when it is issued and end in a native completion callback; on CUDA two CUDA
event marks on the streams, resolved at step end (``gpu_timeline``); payload
bytes as nccl-tests counts them. Nothing in Python is patched, so DDP's C++ reducer, FSDP2,
DTensor and pipeline send/recv are all seen alike.

With ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch wraps this backend in its own
``_ProcessGroupWrapper`` (desync checks on a separate helper gloo group, which
is not recorded), so the checks stay available.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from workbench.telemetry import native

BACKEND_NAME = "workbench"

groups: dict[str, tuple[tuple[int, ...], int]] = {}
"""Every process group this process created through the backend: uid -> (the group's global ranks, this rank's
global rank)."""
_group_observers: list[Callable[[str], None]] = []


def observe_groups(observer: Callable[[str], None]) -> None:
    """Have `observer(uid)` called for each group created from now on (`groups[uid]` says whose it is); once,
    however often it is registered. The emulated cluster prices each group so (`workbench.emulation.rank`)."""
    if observer not in _group_observers:
        _group_observers.append(observer)


def register() -> str:
    """Make ``backend="workbench"`` available to ``init_process_group``; returns the name.

    Idempotent. Must run in every rank before the world group is created.
    """
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    # One backend object serves both devices: ProcessGroup keys backends by
    # type, and two CUSTOM ones in one group would alias each other.
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=devices)
    ext = native.load()  # fail here, with the build error, rather than inside init_process_group
    # A crash in a collective can corrupt the heap, and torch's fatal-signal handler then dies in malloc before it
    # prints the crashing thread: the extension prints that thread's frames first, allocating nothing.
    ext.install_crash_frames()
    # Every operation through this backend lands in the rank's flight ring: a hang report shows where each rank is.
    from workbench.pool import rank as rank_api
    from workbench.telemetry import flight

    rank_api.add_diagnostic(flight.DIAGNOSTIC, flight.diagnose)
    return BACKEND_NAME


def _create(opts, pg_options=None):
    """The creator torch calls for each new group (extended API: DistributedBackendOptions)."""
    from torch.distributed import PrefixStore, ProcessGroupGloo

    ext = native.load()
    rank, size, timeout = opts.group_rank, opts.group_size, opts.timeout
    gloo_options = ProcessGroupGloo._Options()
    gloo_options._devices = _gloo_devices()
    gloo_options._timeout = timeout
    # Each inner backend rendezvouses under its own prefix of the group's store.
    gloo = ProcessGroupGloo(PrefixStore("gloo/", opts.store), rank, size, gloo_options)
    gloo.options.global_ranks_in_group = opts.global_ranks_in_group
    gloo.options.group_name = opts.group_id
    gloo._set_sequence_number_for_group()
    nccl = _create_nccl(opts, pg_options) if torch.cuda.is_available() else None
    backend = ext.recording_backend(rank, size, gloo, nccl, opts.group_id)
    # Who is in the group, by global rank (the world has none listed), for whoever prices groups by their members.
    ranks = tuple(opts.global_ranks_in_group) or tuple(range(size))
    groups[opts.group_id] = (ranks, ranks[rank])
    for observe in _group_observers:
        observe(opts.group_id)
    return backend


_GLOO_DEVICES: list = []


def _gloo_devices() -> list:
    """The gloo transport devices every group of this process shares: one per interface in GLOO_SOCKET_IFNAME
    (the pool sets "lo"), else the default one, as torch chooses them.

    torch gives each gloo group a device of its own, and each device a thread that wakes every 10 ms (gloo's
    epoll loop) and a listening socket: a rank that has built a few hundred groups (meshes of many layouts) burns
    a sizeable part of a core doing nothing (benches/gloo_groups.py). A device is gloo's handle on a network
    interface, made to serve many contexts; sharing it leaves one loop and one listener per process.
    """
    if not _GLOO_DEVICES:
        from torch.distributed import ProcessGroupGloo

        interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
        _GLOO_DEVICES.extend([ProcessGroupGloo.create_device(interface=name) for name in interfaces]
                             or [ProcessGroupGloo.create_default_device()])
    return _GLOO_DEVICES


def _create_nccl(opts, pg_options):
    if not dist.is_nccl_available():
        return None
    from torch.distributed import PrefixStore, ProcessGroupNCCL

    from workbench.telemetry import cuda

    # CUDA collectives are timed by CUDA event marks on their streams; without
    # the marker they would go unrecorded, so this fails here if it cannot load.
    native.load().set_cuda_marker(*cuda.marker_addresses())
    options = pg_options if isinstance(pg_options, ProcessGroupNCCL.Options) else ProcessGroupNCCL.Options()
    options._timeout = opts.timeout
    options.global_ranks_in_group = opts.global_ranks_in_group
    options.group_name = opts.group_id
    nccl = ProcessGroupNCCL(PrefixStore("nccl/", opts.store), opts.group_rank, opts.group_size, options)
    nccl._set_sequence_number_for_group()
    return nccl


def recording_backend_of(group: dist.ProcessGroup | None = None, device: str = "cpu"):
    """The recording backend behind ``group`` (looking through DETAIL's wrapper), or None."""
    backend = (group or dist.group.WORLD)._get_backend(torch.device(device))
    wrapped = getattr(backend, "wrapped_pg", None)
    if wrapped is not None:
        backend = wrapped
    return backend if native.load().is_recording_backend(backend) else None
