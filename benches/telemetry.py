"""What full telemetry costs: step time with it on vs off, in one run.

Alternates off/on several times (the machine is shared and noisy) and prints
the ratio of medians, then where the probe's own time goes on a rank. On CPU
(the default) the tiny model at dp=2; on a GPU (``--device cuda``) one rank per
GPU at the 125m preset, where telemetry is CUDA event marks on the streams
(target: on/off <= 1.02).

    .venv/bin/python benches/telemetry.py
    .venv/bin/python benches/telemetry.py --device cuda            # world size = GPUs, 125m, bf16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import workbench as wb  # noqa: E402

CFG = wb.Config(dp=2)
WARMUP, STEPS, ROUNDS = 3, 15, 3


def step_times(bench: wb.Workbench) -> list[float]:
    bench.train(WARMUP).wait()
    return [m.step_time_s for m in bench.train(STEPS).wait()]


def probe_costs() -> dict[str, float]:
    """Time each probe piece on a rank, on the trained model (microseconds per call)."""
    from workbench.telemetry import memory, native

    from workbench.engine.session import current

    trainer = current().trainer
    modules, optimizers = trainer.modules, trainer.optimizers

    def per_call(fn, n=200):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e6

    ivs = [wb.Interval("compute", "x", i * 10, i * 10 + 5) for i in range(50)]
    return {
        "parameter_bytes": per_call(lambda: memory.parameter_bytes(modules)),
        "gradient_bytes": per_call(lambda: memory.gradient_bytes(modules)),
        "optimizer_bytes": per_call(lambda: memory.optimizer_bytes(optimizers, trainer.device)),
        "process_bytes": per_call(lambda: memory.process_bytes(trainer.device)),
        "span open+close": per_call(lambda: native.span("compute", "x").__enter__() or None),
        "drain (empty)": per_call(native.drain),
        "step_summary(50 spans)": per_call(lambda: native.step_summary(ivs)),
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="telemetry on/off step time")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: 2 on cpu, every GPU on cuda)")
    parser.add_argument("--preset", default=None, help="model preset (default: tiny on cpu, 125m on cuda)")
    parser.add_argument("--precision", default=None, help="default: fp32 on cpu, bf16 on cuda")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    return parser.parse_args(argv)


def config_for(args: argparse.Namespace, world: int) -> wb.Config:
    if args.device == "cpu" and args.preset is None and world == 2:
        return CFG
    gpu = args.device == "cuda"
    return wb.Config(dp=world, model=wb.ModelConfig.preset(args.preset or ("125m" if gpu else "tiny")),
                     precision=args.precision or ("bf16" if gpu else "fp32"),
                     batch_size=args.batch_size or (8 * world if gpu else 16),
                     seq_len=args.seq_len or (1024 if gpu else 128))


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.world_size is not None:
        world = args.world_size
    elif args.device == "cuda":
        import torch

        world = max(1, torch.cuda.device_count())
    else:
        world = 2
    cfg = config_for(args, world)
    benches = {flag: wb.Workbench(world, device=args.device, telemetry=flag) for flag in (False, True)}
    try:
        for bench in benches.values():
            bench.apply(cfg)
        times = {False: [], True: []}
        for _ in range(ROUNDS):
            for flag, bench in benches.items():
                times[flag] += step_times(bench)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"{args.device}: {cfg.layout}, "
              f"model dim {cfg.model.dim} x {cfg.model.n_layers} layers, {cfg.precision}, "
              f"{ROUNDS}×{STEPS} steps each, alternating")
        print(f"step time, telemetry off: median {off * 1e3:.1f} ms")
        print(f"step time, telemetry on:  median {on * 1e3:.1f} ms")
        print(f"ratio on/off: {on / off:.3f}")
        print(f"TELEMETRY_RATIO={on / off:.4f}")  # one machine-readable line for benches/gpu_check.sh
        last = benches[True].train(1).wait()[-1]
        kinds = sorted({(iv.kind, iv.stream) for iv in last.intervals})
        print(f"a step with telemetry on: {len(last.intervals)} intervals {kinds}, "
              f"comm {last.comm_time_s * 1e3:.2f} ms, exposed {last.exposed_comm_s * 1e3:.2f} ms, "
              f"overlap {last.overlap}, device memory {getattr(last, 'device_memory', {})}")
        costs = benches[True].pool.run(probe_costs)[0]
        print("probe pieces on rank 0 (µs per call):")
        for name, us in costs.items():
            print(f"  {name:24s} {us:8.1f}")
    finally:
        for bench in benches.values():
            bench.close()


if __name__ == "__main__":
    main(sys.argv[1:])
