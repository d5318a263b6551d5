"""`estimate`: a Config on a hardware profile, stage by stage, then the step they make together."""

from __future__ import annotations

from workbench.config import Config
from workbench.engine.parallel.schedule_grid import config_stages
from workbench.estimate.assumptions import ASSUMPTIONS
from workbench.estimate.compute import executed_flops
from workbench.estimate.data_parallel import dp_comm
from workbench.estimate.expert import ep_comm
from workbench.estimate.memory import stage_memory
from workbench.estimate.pipeline import pp_comm
from workbench.estimate.records import Estimate, Role, StageEstimate
from workbench.estimate.stage import Stage, stage_shapes
from workbench.estimate.tensor import tp_comm
from workbench.flops import flops_per_token
from workbench.hardware import Hardware, profile


def estimate(cfg: Config, hardware: str | Hardware = "h100", *, efficiency: float = 0.4) -> Estimate:
    """Predict per-rank memory, FLOPs, communication and step time of `cfg` on `hardware`.

    `efficiency` is the stated MFU assumption: executed FLOPs run at that fraction of the device's peak.
    """
    hw = profile(hardware) if isinstance(hardware, str) else hardware
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must lie in (0, 1], got {efficiency}")
    peak = hw.peak(cfg.precision) * efficiency
    shapes = stage_shapes(cfg)
    flops = [executed_flops(st) for st in shapes]
    # Every stage advances in lockstep with the slowest one; the bubble adds (pp-1)/v idle micro-batch slots.
    slowest_mb_s = max(flops) / peak / cfg.micro_batches
    compute_s = slowest_mb_s * (cfg.micro_batches + (cfg.pp - 1) / config_stages(cfg))
    stages = tuple(_finish(st, f, hw, peak, compute_s) for st, f in zip(shapes, flops))
    model_flops = flops_per_token(cfg.model, cfg.seq_len) * cfg.tokens_per_step
    return Estimate(config=cfg, hardware=hw, efficiency=efficiency, stages=stages, model_flops=model_flops,
                    compute_s=compute_s, assumptions=ASSUMPTIONS)


def _finish(st: Stage, flops: float, hw: Hardware, peak: float, step_compute_s: float) -> StageEstimate:
    """The stage's estimate, once the pipeline-wide compute time is known."""
    compute_s = flops / peak
    backward_mb_s = compute_s / st.cfg.micro_batches * 2 / 3
    comm = [*dp_comm(st, hw, step_compute_s, backward_mb_s), *tp_comm(st, hw), *pp_comm(st, hw), *ep_comm(st, hw)]
    return StageEstimate(stage=st.rank, layers=st.layers, params=st.params, memory=stage_memory(st), flops=flops,
                         compute_s=compute_s, comm=tuple(c for c in comm if c.calls))


def grad_sync_bytes_per_step(cfg: Config, hardware: str | Hardware = "h100") -> int:
    """Bytes one rank sends per step for the data-parallel gradient sync: what `StepMetrics.grad_sync_bytes`
    measures (the dp collectives' wire bytes, parameter gathers and ZeRO-1's broadcast excluded)."""
    est = estimate(cfg, hardware)
    return sum(c.wire_bytes for c in est.comm if c.role is Role.GRADIENT_SYNC)
