"""What checkpoints cost: save and load times and throughput, and what periodic saving adds to training.

For the "tiny" and "small" presets on 2 CPU ranks (dp=2), from one run on
this machine: the checkpoint's size, save and load wall times as the notebook
sees them (load includes checking every file's SHA-256), their MB/s, each as
a multiple of one training step; and the wall time of training with a save
every N steps as a ratio to the same training without saves.

    .venv/bin/python benches/checkpoint.py
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import workbench as wb  # noqa: E402

REPEATS = 3
CASES = {"tiny": dict(steps=40, every=10), "small": dict(steps=12, every=4)}


def timed(fn, *args, **kwargs) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.iterdir()) / 1e6


def measure(bench: wb.Workbench, preset: str, steps: int, every: int, scratch: Path) -> dict[str, float]:
    cfg = wb.Config(model=wb.ModelConfig.preset(preset), dp=2, batch_size=8, seq_len=128)
    from workbench.engine import session

    bench.pool.run(session.drop)
    bench.apply(cfg)
    bench.train(2).wait()  # the optimizer state exists from here on: every save holds it
    plain, with_saves = [], []
    for _ in range(REPEATS):  # interleaved, so drifting machine load hits both alike
        plain.append(timed(lambda: bench.train(steps).wait()))
        with_saves.append(timed(lambda: bench.train(steps, save_every=every, save_to=scratch / "periodic",
                                                    keep=1).wait()))
    step_s = statistics.median(plain) / steps
    saves = [timed(bench.save, scratch / "one") for _ in range(REPEATS)]
    path = max((scratch / "one").iterdir())
    loads = [timed(bench.load, path) for _ in range(REPEATS)]
    mb = size_mb(path)
    save_s, load_s = statistics.median(saves), statistics.median(loads)
    return {"params_m": cfg.model.num_params / 1e6, "mb": mb, "step_s": step_s, "save_s": save_s,
            "load_s": load_s, "save_mbps": mb / save_s, "load_mbps": mb / load_s,
            "periodic": statistics.median(with_saves) / statistics.median(plain), "every": every, "steps": steps}


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="workbench-ckpt-bench-"))
    try:
        with wb.Workbench(2, telemetry=False) as bench:
            rows = {preset: measure(bench, preset, scratch=scratch / preset, **case) for preset, case in CASES.items()}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"checkpoints, 2 CPU ranks (dp=2), medians of {REPEATS}:")
    print(f"{'preset':8} {'params':>8} {'size':>9} {'step':>8} {'save':>16} {'load':>16} {'save MB/s':>10} "
          f"{'load MB/s':>10}  periodic saves")
    for preset, r in rows.items():
        print(f"{preset:8} {r['params_m']:7.1f}M {r['mb']:7.1f}MB {r['step_s'] * 1e3:6.0f}ms "
              f"{r['save_s']:6.2f}s ({r['save_s'] / r['step_s']:4.1f} steps) "
              f"{r['load_s']:6.2f}s ({r['load_s'] / r['step_s']:4.1f} steps) {r['save_mbps']:10.0f} "
              f"{r['load_mbps']:10.0f}  every {r['every']} of {r['steps']} steps: ×{r['periodic']:.2f} wall time "
              f"(one save per {r['every']} steps predicts ×{1 + r['save_s'] / (r['every'] * r['step_s']):.2f})")


if __name__ == "__main__":
    main()
