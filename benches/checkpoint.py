"""What checkpoints cost, and what the background save and the chunk store save of it.

Three parts, each measured against a baseline in the same run, on 2 CPU ranks:

  costs        for "tiny" and "small" (dp=2): the checkpoint's size, save and load wall times as the notebook
               sees them (load includes checking every chunk's SHA-256), MB/s, each as a multiple of one
               training step; and training with a save every N steps as a ratio to training without saves.
  async        "small" (dp=2, telemetry on): training with a blocking save every N steps, with a background
               save (async_save=True) and with none. Prints the step time of steps that ran while a
               background save was in flight against steps with none in flight, the time a save holds the
               training thread (blocking: all of it; background: the copy to host memory) and its
               time-to-durable, from the ranks' own CheckpointSave spans.
  incremental  "small" (pp=2): the bytes a save adds to the chunk store (measured on disk, independently of
               the writer's own count, which is printed beside it) as a fraction of the checkpoint's size, in
               three cases: after training on (everything changes), after training with a frozen embedding
               and with the embedding and the first third of the blocks frozen (their chunks are shared), and a
               second save of the same step (all shared); and that save's time against the first, full one.

    .venv/bin/python benches/checkpoint.py [costs|async|incremental ...]
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import workbench as wb  # noqa: E402
from workbench.engine import session  # noqa: E402
from workbench.telemetry.events import CheckpointSave  # noqa: E402

REPEATS = 3
CASES = {"tiny": dict(steps=40, every=10), "small": dict(steps=12, every=4)}


def timed(fn, *args, **kwargs) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def store_bytes(root: Path) -> int:
    """Bytes of every chunk under `root` (the store), read off the disk."""
    return sum(p.stat().st_size for p in (root / "chunks").glob("*/*")) if (root / "chunks").exists() else 0


def checkpoint_mb(path: Path) -> float:
    """The checkpoint's own files plus every chunk its manifest names: what loading it reads."""
    manifest = wb.checkpoints.verify(path)
    return (sum(p.stat().st_size for p in path.iterdir()) + sum(manifest["chunks"].values())) / 1e6


def fresh(bench: wb.Workbench, cfg: wb.Config) -> None:
    bench.pool.run(session.drop)
    bench.apply(cfg)


# -- costs --------------------------------------------------------------------------------------------------
def costs(scratch: Path) -> None:
    rows = {}
    with wb.Workbench(2, telemetry=False) as bench:
        for preset, case in CASES.items():
            rows[preset] = _costs(bench, preset, scratch=scratch / preset, **case)
    print(f"checkpoints, 2 CPU ranks (dp=2), medians of {REPEATS}:")
    print(f"{'preset':8} {'params':>8} {'size':>9} {'step':>8} {'save':>16} {'load':>16} {'save MB/s':>10} "
          f"{'load MB/s':>10}  periodic saves")
    for preset, r in rows.items():
        print(f"{preset:8} {r['params_m']:7.1f}M {r['mb']:7.1f}MB {r['step_s'] * 1e3:6.0f}ms "
              f"{r['save_s']:6.2f}s ({r['save_s'] / r['step_s']:4.1f} steps) "
              f"{r['load_s']:6.2f}s ({r['load_s'] / r['step_s']:4.1f} steps) {r['save_mbps']:10.0f} "
              f"{r['load_mbps']:10.0f}  every {r['every']} of {r['steps']} steps: ×{r['periodic']:.2f} wall time "
              f"(one save per {r['every']} steps predicts ×{1 + r['save_s'] / (r['every'] * r['step_s']):.2f})")


def _costs(bench: wb.Workbench, preset: str, steps: int, every: int, scratch: Path) -> dict[str, float]:
    cfg = wb.Config(model=wb.ModelConfig.preset(preset), dp=2, batch_size=8, seq_len=128)
    fresh(bench, cfg)
    bench.train(2).wait()  # the optimizer state exists from here on: every save holds it
    plain, with_saves = [], []
    for _ in range(REPEATS):  # interleaved, so drifting machine load hits both alike
        plain.append(timed(lambda: bench.train(steps).wait()))
        with_saves.append(timed(lambda: bench.train(steps, save_every=every, save_to=scratch / "periodic",
                                                    keep=1).wait()))
    step_s = statistics.median(plain) / steps
    saves = []
    for _ in range(REPEATS):
        bench.train(1).wait()  # a new step each time: a save of an unchanged step would write nothing
        saves.append(timed(bench.save, scratch / "one", keep=1))
    path = wb.checkpoints.resolve(scratch / "one")
    loads = [timed(bench.load, path) for _ in range(REPEATS)]
    mb = checkpoint_mb(path)
    save_s, load_s = statistics.median(saves), statistics.median(loads)
    return {"params_m": cfg.model.num_params / 1e6, "mb": mb, "step_s": step_s, "save_s": save_s,
            "load_s": load_s, "save_mbps": mb / save_s, "load_mbps": mb / load_s,
            "periodic": statistics.median(with_saves) / statistics.median(plain), "every": every, "steps": steps}


# -- async ----------------------------------------------------------------------------------------------------
def background(scratch: Path, steps: int = 18, every: int = 6) -> None:
    cfg = wb.Config(model=wb.ModelConfig.preset("small"), dp=2, batch_size=8, seq_len=128)
    saves: list[CheckpointSave] = []
    with wb.Workbench(2) as bench:
        unsubscribe = bench.pool.subscribe(lambda r, e: saves.append(e) if isinstance(e, CheckpointSave) and r == 0
                                           else None)
        fresh(bench, cfg)
        bench.train(2).wait()
        walls: dict[str, list[float]] = {"none": [], "blocking": [], "background": []}
        during, between = [], []
        blocking_hold, background_hold, durable = [], [], []
        for repeat in range(REPEATS):
            for mode in walls:
                options = {} if mode == "none" else dict(save_every=every, save_to=scratch / mode, keep=1,
                                                          async_save=mode == "background")
                saves.clear()
                t0 = time.perf_counter()
                metrics = bench.train(steps, **options).wait()
                walls[mode].append(time.perf_counter() - t0)
                time.sleep(0.2)  # the last events cross after the result
                if mode == "blocking":
                    blocking_hold += [(s.durable_ns - s.start_ns) / 1e9 for s in saves]
                print(f"  ({mode} run {repeat + 1}: {walls[mode][-1]:.1f} s)", flush=True)
                if mode == "background":
                    background_hold += [(s.staged_ns - s.start_ns) / 1e9 for s in saves]
                    durable += [(s.durable_ns - s.start_ns) / 1e9 for s in saves]
                    spans = [(s.staged_ns, s.durable_ns) for s in saves]
                    for m in metrics:
                        if not m.intervals:
                            continue
                        start = min(i.start_ns for i in m.intervals)
                        end = start + int(m.step_time_s * 1e9)
                        overlaps = any(start < b and end > a for a, b in spans)
                        (during if overlaps else between).append(m.step_time_s)
        unsubscribe()
    med = statistics.median
    print(f"\nbackground saves, small (dp=2, {steps} steps, a save every {every}), medians over {REPEATS} runs:")
    print(f"  step time while a background save is in flight {med(during) * 1e3:.0f} ms vs with none in flight "
          f"{med(between) * 1e3:.0f} ms: ×{med(during) / med(between):.2f} ({len(during)} vs {len(between)} steps)")
    print(f"  the training thread is held {med(background_hold):.3f} s per background save (the copy to host "
          f"memory) vs {med(blocking_hold):.3f} s per blocking save: ×{med(background_hold) / med(blocking_hold):.2f}; "
          f"time-to-durable of a background save {med(durable):.3f} s (×{med(durable) / med(blocking_hold):.2f} "
          "of a blocking one)")
    none = med(walls["none"])
    print(f"  wall time of the run: blocking saves ×{med(walls['blocking']) / none:.2f}, background saves "
          f"×{med(walls['background']) / none:.2f} of no saves ({none:.2f} s)")


# -- incremental --------------------------------------------------------------------------------------------
def freeze(prefixes: tuple[str, ...]) -> int:
    """On the ranks: stop training the parameters whose names start with one of `prefixes` (requires_grad off:
    no gradient, so the optimizer leaves them and their state as they are). pp=2 has no data-parallel wrapper
    holding gradient hooks, so this is a frozen layer as fine-tuning has it. Returns the parameters frozen."""
    from workbench.engine.reshard import bare_name

    frozen = 0
    for module in session.current().trainer.modules:
        for name, param in module.named_parameters():
            if bare_name(name).startswith(prefixes):
                param.requires_grad_(False)
                frozen += param.numel()
    return frozen


def incremental(scratch: Path, steps: int = 4) -> None:
    cfg = wb.Config(model=wb.ModelConfig.preset("small"), pp=2, micro_batches=2, batch_size=8, seq_len=128)
    # Not all of the first stage: its backward would then have nothing to differentiate (the pipeline refuses).
    lower = tuple(f"layers.{i}." for i in range(cfg.model.n_layers // 3)) + ("tok_embeddings",)
    cases = {
        "training on (nothing frozen)": (),
        "frozen embedding": ("tok_embeddings",),
        f"embedding and layers 0-{len(lower) - 2} frozen": lower,
        "the same step saved again": None,
    }
    written: list[int] = []
    rows = []
    with wb.Workbench(2, telemetry=False) as bench:
        bench.pool.subscribe(lambda r, e: written.append(e.bytes_written) if isinstance(e, CheckpointSave) else None)
        for name, prefixes in cases.items():
            root = scratch / f"case{len(rows)}"
            fresh(bench, cfg)
            frozen = sum(bench.pool.run(freeze, prefixes)) if prefixes else 0
            bench.train(steps).wait()  # the optimizer state exists (and frozen parameters have none)
            written.clear()
            full_s = timed(bench.save, root)
            if prefixes is not None:
                bench.train(steps).wait()
            before = store_bytes(root)
            time.sleep(0.1)
            written.clear()
            again_s = timed(bench.save, root)
            time.sleep(0.2)
            added = store_bytes(root) - before
            size = checkpoint_mb(wb.checkpoints.resolve(root)) * 1e6
            rows.append((name, frozen, size, added, sum(written), full_s, again_s))
    print(f"\nincremental saves, small (pp=2, {cfg.model.num_params / 1e6:.1f} M parameters + AdamW state), a save, "
          f"{steps} more steps, a save:")
    print(f"  {'case':46} {'frozen':>8} {'checkpoint':>10} {'written to the store':>22} {'(writer says)':>14} "
          f"{'save time vs the first':>24}")
    for name, frozen, size, added, said, full_s, again_s in rows:
        print(f"  {name:46} {frozen / 1e6:7.2f}M {size / 1e6:8.1f}MB {added / 1e6:9.2f}MB = {added / size:6.1%} "
              f"{said / 1e6:12.2f}MB {again_s:8.2f}s / {full_s:.2f}s = ×{again_s / full_s:.2f}")


PARTS = {"costs": costs, "async": background, "incremental": incremental}


def main() -> None:
    chosen = sys.argv[1:] or list(PARTS)
    scratch = Path(tempfile.mkdtemp(prefix="workbench-ckpt-bench-"))
    try:
        for name in chosen:
            PARTS[name](scratch / name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
