"""Functions the pool tests run on ranks (importable, so ranks can load them)."""

from __future__ import annotations

import os
import time

from workbench.pool import rank


def whoami():
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size(), rank.info.rank, os.getpid())


def remember(key, value):
    rank.state[key] = (value, rank.get_rank())


def recall(key):
    return rank.state.get(key)


def all_reduce_sum(x):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(x)])
    dist.all_reduce(t)
    return t.item()


def shout(text):
    print(f"{text} from {rank.get_rank()}")
    import sys

    print("to stderr", file=sys.stderr)


def fail_on(bad_rank):
    if rank.get_rank() == bad_rank:
        raise KeyError("the rank that fails")
    return "fine"


def fail_before_collective(bad_rank):
    """One rank raises; the others enter an all_reduce it never joins."""
    if rank.get_rank() == bad_rank:
        raise ValueError("failed before the collective")
    return all_reduce_sum(1)


def collectives_forever():
    """A training-like loop: collectives and a bit of work until the rank is killed."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1000)
    for _ in range(100000):
        dist.all_reduce(t)
        rank.progress()
        time.sleep(0.005)


def crash_in_native_code_on_rank_1():
    """Rank 1 reads address 0 from C (a segmentation fault, as a bug in a native library would make); rank 0 waits
    for it in a collective."""
    import ctypes

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        ctypes.string_at(0)
    dist.all_reduce(torch.ones(1))


def crash_in_a_native_thread_on_rank_1():
    """Rank 1 starts a thread that runs no Python and reads address 0 (strlen(NULL) as its start routine), as a
    bug in gloo's worker or a completion callback would crash; both ranks' main threads wait in a collective."""
    import ctypes

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        libc = ctypes.CDLL(None)
        thread = ctypes.c_ulong()
        libc.pthread_create(ctypes.byref(thread), None, ctypes.cast(libc.strlen, ctypes.c_void_p), None)
        libc.pthread_join(thread, None)  # never returns: the thread takes the process with it
    dist.all_reduce(torch.ones(1))


def mismatched_shapes():
    import torch
    import torch.distributed as dist

    t = torch.ones(4 if rank.get_rank() == 0 else 8)
    dist.all_reduce(t)
    return t.tolist()


def listening_sockets():
    import psutil

    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def emit_events(n):
    for i in range(n):
        rank.emit({"i": i, "rank": rank.get_rank()})
    return n


def wait_for_flag(name, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if rank.flag(name):
            return rank.flag(name)
        time.sleep(0.01)
    return None


def mismatched_ops():
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    if rank.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)


def ddp_step():
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 4))
    loss = model(torch.ones(2, 4)).sum()
    loss.backward()
    return loss.item()


def scatter_from_zero():
    import torch
    import torch.distributed as dist

    out = torch.zeros(2)
    chunks = [torch.full((2,), float(r)) for r in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.scatter(out, chunks, src=0)
    return out.tolist()


def echo_with_rank(payload):
    import torch.distributed as dist

    return dist.get_rank(), payload


def hold_the_gil(at_least_s):
    """C code that holds the GIL (sum over a range never yields it): the heartbeat thread cannot run meanwhile.
    Calibrated on this machine so it lasts at least `at_least_s`; returns how long it held the GIL."""
    n = 10**6
    while True:
        t = time.perf_counter()
        sum(range(n))
        took = time.perf_counter() - t
        if took >= at_least_s:
            return took
        n = int(n * min(8.0, 1.5 * at_least_s / max(took, 1e-4)))


def busy_for(seconds, kind):
    """Long compute that leaves the GIL to other threads: torch matmuls (released in the kernel) or a Python
    loop (the interpreter hands the GIL over every 5 ms)."""
    import torch

    deadline = time.monotonic() + seconds
    a = torch.randn(256, 256)
    n = 0
    while time.monotonic() < deadline:
        if kind == "matmul":
            a = torch.tanh(a @ a)
        else:
            n = (n * 31 + 7) % 1000003
    return kind


def sleep_or_wait(sleeper, seconds):
    """Rank `sleeper` sleeps in Python (alive, idle, beating); the others wait for it in an all_reduce."""
    if rank.get_rank() == sleeper:
        time.sleep(seconds)
    return all_reduce_sum(1)


def sleep_or_wait_unchecked(sleeper, seconds):
    """`sleep_or_wait` outside the pool's collective check (as the engine's own collectives run): the waiting ranks
    sit in the all_reduce itself, which the recording backend's flight ring shows."""
    with rank.unchecked():
        return sleep_or_wait(sleeper, seconds)


def add_fake_provider():
    """A diagnostic provider like the telemetry's flight recorder: what this rank last did, in a sentence."""
    rank.add_diagnostic("last collective", lambda: f"rank {rank.get_rank()}: all_reduce #41 of world, waiting")


def remove_fake_provider():
    rank.remove_diagnostic("last collective")
