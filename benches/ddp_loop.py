"""The small DDP training loop every launcher in benches/pool.py runs: same model, same steps."""

from __future__ import annotations

import os
import time

STEPS = 10


def build():
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    return model, opt, gen


def steps(model, opt, gen, n: int = STEPS) -> float:
    import torch

    for _ in range(n):
        x = torch.randn(64, 256, generator=gen)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return loss.item()


# -- (a) the persistent pool: the model lives on the ranks between calls --------------------------
def pool_build():
    from workbench.pool import rank

    rank.state["bench"] = build()


def pool_steps():
    from workbench.pool import rank

    return steps(*rank.state["bench"])


# -- (b) accelerate's notebook_launcher: everything is rebuilt at every call ----------------------
def launcher_fn():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    steps(*build())


# -- (c) a whole torchrun job ---------------------------------------------------------------------
if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t0 = time.perf_counter()
    steps(*build())
    if dist.get_rank() == 0:
        print(f"in-job 10 steps: {time.perf_counter() - t0:.3f} s", flush=True)
    dist.destroy_process_group()
    os._exit(0)
