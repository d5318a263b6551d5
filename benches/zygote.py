"""Would a zygote start ranks faster? Fork from a process already prepared like a rank, against spawning.

A zygote is spawned once and prepares as a rank does (torch, the recording backend, the preload, the
torch._dynamo warm-up; one intra-op thread), then waits, using no CPU. Asked for ranks, it forks them: each child
joins a gloo world (FileStore) and all_reduces once. The baseline, in the same run: the same ranks spawned as
fresh interpreters that prepare first, as the pool's cold start does. Printed: each round's wall time until
every rank's all_reduce is done, the ratio, the zygote's threads when it forks (a fork is safe only while the
process has just the one: OpenMP's or gloo's threads would not exist in the child), and its memory.

    .venv/bin/python benches/zygote.py [--ranks 2] [--repeats 3]

A measurement of the idea for issue 22, not what the pool does: the pool spawns its ranks (workbench/pool).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from bytecode import require_compiled  # benches/bytecode.py

ROOT = Path(__file__).resolve().parents[1]

PREPARE = '''
import gc, importlib, os, time
import torch
torch.set_num_threads(1)
from workbench.telemetry import comm
BACKEND = comm.register()
importlib.import_module("workbench.engine.session")
torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
gc.freeze()
'''

RANK = '''
def rank_main(rank, world, store_path, t_asked):
    import torch, torch.distributed as dist
    store = dist.FileStore(store_path, world)
    dist.init_process_group(BACKEND, store=store, rank=rank, world_size=world)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world
    dist.destroy_process_group()
    return time.monotonic() - t_asked
'''

ZYGOTE = PREPARE + RANK + '''
import json, sys
threads = len(os.listdir("/proc/self/task"))
pss = next(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("Pss:")) * 1024
print(json.dumps({"threads": threads, "pss": pss}), flush=True)
for line in sys.stdin:
    world, store_path, t_asked = line.split()
    world, t_asked = int(world), float(t_asked)
    children = []
    for r in range(world):
        pid = os.fork()
        if pid == 0:  # the child: join, all_reduce, exit (its exit code says how it went; no shared stdout)
            try:
                rank_main(r, world, store_path, t_asked)
            except BaseException:
                os._exit(1)
            os._exit(0)
        children.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in children]
    print(json.dumps({"done": time.monotonic() - t_asked, "codes": codes}), flush=True)
'''

SPAWNED = PREPARE + RANK + '''
import json, sys
print(json.dumps({"took": rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))}))
'''


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def spawned_round(world: int, folder: str) -> float:
    store = os.path.join(folder, f"spawn-{time.monotonic_ns()}")
    t = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", SPAWNED, str(r), str(world), store, repr(t)], env=_env(),
                              stdout=subprocess.PIPE, text=True) for r in range(world)]
    for p in procs:
        p.communicate(timeout=300)
        assert p.returncode == 0
    return time.monotonic() - t


def zygote_round(zygote: subprocess.Popen, world: int, folder: str) -> float:
    store = os.path.join(folder, f"fork-{time.monotonic_ns()}")
    zygote.stdin.write(f"{world} {store} {time.monotonic()!r}\n")
    zygote.stdin.flush()
    while True:
        msg = json.loads(zygote.stdout.readline())
        if "done" in msg:
            assert msg["codes"] == [0] * world, msg
            return msg["done"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    require_compiled("benches/zygote.py")
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="wb-zygote-") as folder:
        t = time.monotonic()
        zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE], env=_env(), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        state = json.loads(zygote.stdout.readline())
        prepared_s = time.monotonic() - t
        forked, spawned = [], []
        try:
            for _ in range(a.repeats):  # alternated, so a drift of the machine falls on both alike
                forked.append(zygote_round(zygote, a.ranks, folder))
                spawned.append(spawned_round(a.ranks, folder))
        finally:
            zygote.stdin.close()
            zygote.wait(30)
    f, s = statistics.median(forked), statistics.median(spawned)
    print(f"zygote prepared in {prepared_s:.2f} s; when it forks: {state['threads']} thread(s), "
          f"{state['pss'] / 2**20:.0f} MB (proportional set size)")
    print(f"{a.ranks} ranks until each has joined a gloo world and all_reduced once (median of {a.repeats}):")
    print(f"  forked from the prepared zygote  {f:.3f} s   ({', '.join(f'{x:.3f}' for x in forked)})")
    print(f"  spawned and prepared (baseline)  {s:.3f} s   ({', '.join(f'{x:.3f}' for x in spawned)})")
    print(f"  spawned / forked: {s / f:.1f}×")


if __name__ == "__main__":
    main()
