"""Model FLOPs utilisation of the workbench engine on one device: tokens/s and MFU against the datasheet peak.

Trains a preset on one rank through the workbench (the same engine a notebook
drives, telemetry off so the figure is the engine's own), takes the median
step time after a warm-up, and prints tokens/s, achieved FLOP/s and their ratio
to the peak of `workbench/hardware.py`: the datasheet figure of the GPU (H100,
H200, A100) for the precision, or on CPU the matmul peak measured on this
machine (labelled as such). FLOPs per token are the estimator's formula
(`workbench.estimate.flops_per_token`, attention counted over the full square).

    .venv/bin/python benches/mfu.py --device cuda --preset 1b --precision bf16   # GPU: target >= 50%
    .venv/bin/python benches/mfu.py --preset tiny                                 # CPU check of the bench itself
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")


def peak_for(device: str, precision: str) -> tuple[float, str]:
    """The peak FLOP/s MFU divides by, and where it comes from (run inside the rank, on its device)."""
    import torch

    from workbench import hardware

    if device == "cuda":
        name = torch.cuda.get_device_name().lower()
        for key in ("h200", "h100", "a100"):
            if key in name:
                return hardware.profile(key).peak(precision), f"{key.upper()} datasheet, {precision} dense"
        raise SystemExit(f"no datasheet peak for GPU {name!r} in workbench/hardware.py")
    return hardware.measure_cpu().peak(precision), f"matmul peak measured on this CPU rank, {precision}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--preset", default=None, help="model preset (default: 1b on cuda, tiny on cpu)")
    parser.add_argument("--precision", default=None, help="fp32 | bf16 | fp16 (default: bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 8 cuda, 8 cpu)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048 cuda, 128 cpu)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.5, help="MFU the run is held to (printed, not enforced)")
    args = parser.parse_args(argv)

    import torch

    import workbench as wb
    from workbench.estimate import flops_per_token

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device == "cuda"
    preset = args.preset or ("1b" if on_gpu else "tiny")
    precision = args.precision or ("bf16" if on_gpu else "fp32")
    cfg = wb.Config(model=wb.ModelConfig.preset(preset), precision=precision,
                    batch_size=args.batch_size or 8, seq_len=args.seq_len or (2048 if on_gpu else 128))
    per_token = flops_per_token(cfg.model, cfg.seq_len)

    with wb.Workbench(1, device=device, telemetry=False) as bench:
        bench.apply(cfg)
        bench.train(args.warmup).wait()
        metrics = bench.train(args.steps).wait()
        peak, basis = bench.pool.run(peak_for, device, precision)[0]
        gpu = bench.pool.run(lambda: torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")[0]

    step_s = statistics.median(m.step_time_s for m in metrics)
    tokens_per_s = cfg.tokens_per_step / step_s
    achieved = per_token * tokens_per_s
    mfu = achieved / peak
    print(f"device: {gpu} ({device}); model {preset} ({cfg.model.n_layers} layers, dim {cfg.model.dim}), "
          f"{precision}, batch {cfg.batch_size} x seq {cfg.seq_len} = {cfg.tokens_per_step} tokens/step")
    print(f"steps: {args.warmup} warm-up + {args.steps} measured; median step {step_s * 1e3:.1f} ms "
          f"(min {min(m.step_time_s for m in metrics) * 1e3:.1f}, max {max(m.step_time_s for m in metrics) * 1e3:.1f})")
    print(f"tokens/s: {tokens_per_s:,.0f}")
    print(f"model FLOPs/token: {per_token:.4g}; achieved {achieved / 1e12:.2f} TFLOP/s")
    print(f"peak: {peak / 1e12:.2f} TFLOP/s ({basis})")
    print(f"MFU (achieved / peak): {mfu:.3f}  target >= {args.target:.2f}: {'met' if mfu >= args.target else 'NOT met'}")
    print(f"MFU_RATIO={mfu:.4f}")  # one machine-readable line for benches/gpu_check.sh
    return 0


if __name__ == "__main__":
    sys.exit(main())
