"""An estimate as plain text that reads well in a notebook cell (the notebook shows it; nothing is computed here)."""

from __future__ import annotations

from workbench.estimate.records import Estimate
from workbench.hardware import si

CATEGORIES = ("parameters", "gradients", "optimizer", "buffers", "activations", "other", "host")


def render(est: Estimate) -> str:
    cfg, hw, mem = est.config, est.hardware, est.memory
    peak = est.peak_stage
    where = f" (stage {peak.stage} of {cfg.pp})" if cfg.pp > 1 else ""
    features = f"; modelled: {est.features.describe()}" if est.features.describe() != "none" else ""
    lines = [
        f"estimate  {cfg.layout} on {cfg.world_size} × {hw.name} ({'measured' if hw.measured else 'datasheet'}, "
        f"{hw.kind} kernels{features})",
        f"model     {si(cfg.model.num_params, '').rstrip().replace('G', 'B')} parameters, "
        f"{si(est.flops_per_token, 'FLOP')}/token "
        f"at seq_len {cfg.seq_len}; {cfg.tokens_per_step:,} tokens/step",
        f"memory per rank{where}" + (", each category at its own peak" if mem.allocated else ""),
    ]
    for name in CATEGORIES:
        lines.append(f"  {name:<12} {si(getattr(mem, name), 'B'):>10}")
    verdict = "fits" if est.fits else "DOES NOT FIT"
    if mem.allocated:
        lines.append(f"  {'allocated':<12} {si(mem.allocated, 'B'):>10}  at its peak ({mem.peak_at})")
        lines.append(f"  {'reserved':<12} {si(mem.reserved, 'B'):>10}  by the caching allocator, "
                     f"+ {si(mem.runtime, 'B')} CUDA context and NCCL")
    lines.append(f"  {'total':<12} {si(mem.total, 'B'):>10}  of {si(hw.memory_bytes, 'B')}: {verdict} "
                 f"({si(abs(est.headroom), 'B')} {'left' if est.headroom >= 0 else 'short'})")
    bubble = " (with the pipeline bubble)" if cfg.pp > 1 else ""
    if peak.compute_split:
        split = ", ".join(f"{kind} {t * 1e3:,.1f} ms" for kind, t in est.critical_stage.compute_split)
        lines.append(f"compute   {si(est.model_flops, 'FLOP')}/step; {est.compute_s * 1e3:,.1f} ms{bubble}: {split}")
    else:
        lines.append(f"compute   {si(est.model_flops, 'FLOP')}/step; {est.compute_s * 1e3:,.1f} ms at "
                     f"{est.efficiency:.0%} of {si(hw.peak(cfg.precision), 'FLOP/s')} {cfg.precision}{bubble}")
    if est.comm:
        crit = f" (stage {est.critical_stage.stage})" if cfg.pp > 1 else ""
        lines.append(f"comm per step per rank{crit}")
        lines.append(f"  {'':<3} {'collective':<15} {'what':<38} {'calls':>6} {'on wire':>10} {'time':>10} "
                     f"{'exposed':>10}")
        for c in est.comm:
            lines.append(f"  {c.axis:<3} {c.kind:<15} {c.what:<38} {c.calls:>6} {si(c.wire_bytes, 'B'):>10} "
                         f"{c.time_s * 1e3:>7.2f} ms {c.exposed_s * 1e3:>7.2f} ms")
    lines.append(f"step      {est.step_time_s * 1e3:,.1f} ms (exposed comm {est.exposed_comm_s * 1e3:,.1f} ms); "
                 f"MFU {est.mfu:.0%}; {est.tokens_per_s:,.0f} tokens/s")
    return "\n".join(lines)
