"""Gradient compression on the workbench's dp=2 training, in one run: bytes sent per step and step time of
each `Config.compression`, as ratios against compression="none" measured in the same run.

Bytes are StepMetrics.grad_sync_bytes (the recording backend's collectives on the dp group, times their
bus factors), exact per step; step times are medians of the steps after a warm-up. On 2 CPU cores with
gloo, quantising costs compute that the saved bytes (loopback, ~1 GB/s) barely pay for: the step-time
ratio is what this machine says, not what a network-bound cluster would. powersgd is CUDA/NCCL only.

    .venv/bin/python benches/compression.py
"""

from __future__ import annotations

import os
import statistics

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import workbench as wb  # noqa: E402

KINDS = ("none", "fp16", "bf16", "int8", "1bit")
STEPS, WARMUP = 30, 5
MODEL = "small"  # ~10 M parameters: 40 MB of fp32 gradients per step, so communication is visible


def measure(bench: wb.Workbench, kind: str) -> tuple[float, float]:
    bench.apply(wb.Config(dp=2, model=wb.ModelConfig.preset(MODEL), batch_size=8, seq_len=64, compression=kind),
                fresh=True)
    steps = bench.train(STEPS).wait()
    kept = [m for m in steps if m.step >= WARMUP]
    return statistics.median(m.grad_sync_bytes for m in kept), statistics.median(m.step_time_s for m in kept)


def main() -> None:
    with wb.Workbench(world_size=2) as bench:
        results = {kind: measure(bench, kind) for kind in KINDS}
    base_bytes, base_time = results["none"]
    print(f"compression bench: dp=2, {MODEL} model, {STEPS - WARMUP} steps after {WARMUP} warm-up, medians")
    print(f"{'compression':<12} {'bytes/step':>12} {'ratio':>7} {'step ms':>9} {'ratio':>7}")
    for kind, (sent, seconds) in results.items():
        print(f"{kind:<12} {sent:>12,.0f} {sent / base_bytes:>7.3f} {seconds * 1e3:>9.1f} {seconds / base_time:>7.2f}")


if __name__ == "__main__":
    main()
