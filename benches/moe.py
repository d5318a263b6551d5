"""Mixture of experts: what expert parallel costs on this machine, in one run.

The same MoE model (tiny-moe: 4 experts, top-2, in every block) at dp=2 with its
experts replicated (ep=1: DDP all-reduces every expert's gradient) and split
(ep=2: each rank holds 2 experts; tokens go to them by all-to-all, four
exchanges per MoE layer per step). Prints both steady-state step times and their
ratio, and the share of the ep=2 step the all-to-alls take (union of the
recorded all_to_all intervals on each rank over its step time; the recording
backend stamps them in native code).

    .venv/bin/python benches/moe.py
"""

from __future__ import annotations

import os
import statistics

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import workbench as wb  # noqa: E402
from workbench.telemetry.analysis import covered_ns  # noqa: E402

MOE = wb.Config(model=wb.ModelConfig.preset("tiny-moe"), dp=2, batch_size=16, seq_len=128)
STEPS = 15
WARMUP = 3


def measure(bench: wb.Workbench, cfg: wb.Config) -> tuple[list[float], list[float], list[int]]:
    """Step times (rank 0), all-to-all share of each rank's step, and all-to-all bytes per rank-step."""
    bench.apply(cfg)
    bench.train(WARMUP).wait()
    bench.train(STEPS).wait()
    metrics = [m for r in range(2) for m in bench.store.steps(r)[-STEPS:]]
    times = [m.step_time_s for m in metrics if m.rank == 0]
    shares, volumes = [], []
    dropped = [sum(m.tokens_dropped) / (cfg.tokens_per_step * cfg.model.top_k * cfg.model.n_moe_layers)
               for m in metrics if m.rank == 0]
    print(f"  ep={cfg.ep}: assignments dropped (capacity factor {cfg.model.capacity_factor}): "
          f"{statistics.mean(dropped):.1%}")
    for m in metrics:
        a2a = [(iv.start_ns, iv.end_ns) for iv in m.intervals if iv.kind == "comm" and iv.name == "all_to_all"]
        shares.append(covered_ns(a2a) * 1e-9 / m.step_time_s)
        volumes.append(sum(iv.bytes for iv in m.intervals if iv.name == "all_to_all" and iv.kind == "comm"))
    return times, shares, volumes


def main() -> None:
    results: dict[int, tuple[list[float], list[float], list[int]]] = {1: ([], [], []), 2: ([], [], [])}
    with wb.Workbench(2, device="cpu", telemetry=True) as bench:
        for _ in range(2):  # alternate: the machine is shared
            for ep in (1, 2):
                for acc, new in zip(results[ep], measure(bench, MOE.replace(ep=ep))):
                    acc.extend(new)
    t1, t2 = (statistics.median(results[ep][0]) for ep in (1, 2))
    share = statistics.median(results[2][1])
    volume = statistics.median(results[2][2])
    print(f"model: tiny-moe ({MOE.model.num_params / 1e6:.2f} M parameters, {MOE.model.n_experts} experts, "
          f"top-{MOE.model.top_k}), {MOE.tokens_per_step} tokens/step, dp=2, zero=0, fp32, gloo on CPU")
    print(f"steady-state step, ep=1 (experts replicated): {t1 * 1e3:.1f} ms")
    print(f"steady-state step, ep=2 (experts split):      {t2 * 1e3:.1f} ms")
    print(f"ratio ep=2 / ep=1: {t2 / t1:.3f}")
    print(f"all-to-all share of the ep=2 step: {share:.1%} (median over ranks and steps); "
          f"{volume / 2**20:.2f} MiB sent per rank per step; estimate says "
          f"{sum(c.bytes for c in wb.estimate(MOE.replace(ep=2)).comm if c.kind == 'all_to_all') / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
