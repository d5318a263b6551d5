"""The workbench's training against plain scripts, in one run.

1. Steady-state step time of the workbench's dp=2 training (telemetry off) vs
   the identical loop in a plain torchrun script (same model, data, DDP, AdamW).
2. Time to apply() a new layout to a trained model vs relaunching with
   accelerate's notebook_launcher (which rebuilds everything, state lost).

    .venv/bin/python benches/engine.py
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import workbench as wb  # noqa: E402

CFG = wb.Config(dp=2)
STEPS = 20

PLAIN_LOOP = textwrap.dedent('''
    import statistics, sys, time, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from workbench.config import Config
    from workbench.engine.data import TokenData
    from workbench.models.transformer import build_model, loss_fn
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cfg, steps = Config(dp=2), int(sys.argv[1])
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(build_model(cfg.model, cfg.seed), forward_sync_buffers=False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = TokenData.for_config(cfg)
    times = []
    for step in range(steps):
        t = time.perf_counter()
        tokens = data.local_batch(step, rank, world)
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        reported = loss.detach().clone(); dist.all_reduce(reported)  # the mean loss the workbench reports
        reported.item()
        times.append(time.perf_counter() - t)
    if rank == 0:
        print("STEP_MEDIAN", statistics.median(times[3:]))
''')


def plain_torchrun(steps: int) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".py") as script:
        script.write(PLAIN_LOOP)
        script.flush()
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                              "--master-addr=127.0.0.1", "--master-port=29519", script.name, str(steps)],
                             capture_output=True, text=True, check=True).stdout
    return float(re.search(r"STEP_MEDIAN ([0-9.e-]+)", out).group(1))


def launcher_fn():
    import torch.distributed as dist

    from workbench.engine.data import TokenData
    from workbench.engine.mesh import build_mesh
    from workbench.engine.trainer import Trainer

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    cfg = wb.Config(tp=2)
    Trainer(cfg, build_mesh(cfg, "cpu"), "cpu", TokenData.for_config(cfg)).step(0)


def main() -> None:
    with wb.Workbench(2, device="cpu", telemetry=False) as bench:
        bench.apply(CFG)
        bench.train(3).wait()
        ours = []
        plain = []
        for _ in range(2):  # alternate: the machine is shared
            ours += [m.step_time_s for m in bench.train(STEPS).wait()]
            plain.append(plain_torchrun(STEPS))
        t = time.perf_counter()
        bench.apply(wb.Config(tp=2))
        apply_s = time.perf_counter() - t
        bench.train(1).wait()
    from accelerate import notebook_launcher

    relaunch = []
    for _ in range(2):
        t = time.perf_counter()
        notebook_launcher(launcher_fn, num_processes=2)
        relaunch.append(time.perf_counter() - t)
    a, b = statistics.median(ours), statistics.median(plain)
    print(f"steady-state step, workbench dp=2:      {a * 1e3:.1f} ms")
    print(f"steady-state step, plain torchrun loop: {b * 1e3:.1f} ms")
    print(f"ratio workbench/plain: {a / b:.3f}")
    r = statistics.median(relaunch)
    print(f"apply(tp=2) on the trained model (state kept): {apply_s:.2f} s")
    print(f"notebook_launcher relaunch at tp=2 (state lost): {r:.2f} s")
    print(f"ratio relaunch/apply: {r / apply_s:.1f}×")


if __name__ == "__main__":
    main()
