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
