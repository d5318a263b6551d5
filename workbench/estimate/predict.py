"""`estimate`: a Config on a hardware profile, stage by stage, then the step they make together.

Two models, chosen by the profile's `kind`: "gpu" models the run as CUDA kernels make it (flash attention and
fused norms, FSDP2's mixed precision, the caching allocator, NCCL over the links, a peak that follows the step);
"cpu" models this engine on CPU kernels, term by term as the CPU runs measure it.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.config import FP8, Config
from workbench.schedules import Durations, bubble_formula, config_stages
from workbench.estimate.allocator import reserved, runtime_bytes
from workbench.estimate.assumptions import ASSUMPTIONS, GPU_ASSUMPTIONS
from workbench.estimate.collectives import Network, contention, network
from workbench.estimate.compute import executed_flops
from workbench.estimate.context import attention_flops, cp_comm
from workbench.estimate.data_parallel import dp_comm, fsdp_unit_count
from workbench.estimate.expert import ep_comm
from workbench.estimate.memory import stage_memory
from workbench.estimate.options import NO_FEATURES, Dtypes, Features, dtypes
from workbench.estimate.pipeline import hop_time, pipeline_span, pp_comm
from workbench.estimate.records import Estimate, Memory, Role, StageEstimate
from workbench.estimate.stage import Stage, chunk_shapes, stage_shapes
from workbench.estimate.step_gpu import MicroBatchCompute, micro_batch_compute, optimizer_time
from workbench.estimate.tensor import tp_comm
from workbench.estimate.timeline import gpu_memory
from workbench.flops import flops_per_token
from workbench.model_profile import ModelProfile
from workbench.hardware import Hardware, profile

CPU_EFFICIENCY = 0.4
"""The CPU model's stated MFU assumption: executed FLOPs at this fraction of the measured matmul peak."""


def estimate(cfg: Config, hardware: str | Hardware = "h100", *, efficiency: float | None = None,
             features: Features = NO_FEATURES, traced: ModelProfile | None = None) -> Estimate:
    """Predict per-rank memory, FLOPs, communication and step time of `cfg` on `hardware`.

    efficiency: None for the profile's own model (GPU: kernel by kernel; CPU: 0.4 of the measured peak), or a
    stated MFU assumption: executed FLOPs run at that fraction of the device's peak.
    features: published-run settings the engine lacks (torch.compile, Float8, loss parallel) to model as well.
    traced: the model as traced (`workbench.tracing`, at cfg.seq_len and precision): its parameters, FLOPs and
    (on the CPU model) saved activations stand where the built-in model's formulas would.
    """
    if efficiency is not None and not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must lie in (0, 1], got {efficiency}")
    return price(shaped(cfg, hardware, features=features, traced=traced), efficiency)


@dataclass(frozen=True)
class Shaped:
    """A Config on a profile as far as its memory: every pipeline rank's shape and what each must hold. Whether a
    layout fits is known here, before any time is priced (`wb.plan` refuses most layouts of a large search so, at
    a third of an estimate's cost); `price` finishes the estimate from it."""

    cfg: Config
    hardware: Hardware
    features: Features
    shapes: tuple[Stage, ...]
    memories: tuple[Memory, ...]
    """Each pipeline rank's memory, in rank order: what `Estimate.stages` carry."""

    @property
    def memory(self) -> Memory:
        """The most loaded rank's (`Estimate.memory`)."""
        return max(self.memories, key=lambda m: m.total)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.hardware.memory_bytes

    @property
    def model_params(self) -> int:
        """`Estimate.model_params`: the built-in shape's count, or what the trace counted."""
        return _model_params(self.cfg, self.shapes[0].profile)


def shaped(cfg: Config, hardware: str | Hardware = "h100", *, features: Features = NO_FEATURES,
           traced: ModelProfile | None = None) -> Shaped:
    """`cfg`'s stage shapes and memory on `hardware` (the first half of `estimate`)."""
    hw = profile(hardware, ranks=cfg.world_size) if isinstance(hardware, str) else hardware
    if features != NO_FEATURES and hw.kind == "cpu":
        raise ValueError(f"features {features.describe()} are modelled for GPU profiles only; the CPU model is "
                         "this engine on CPU kernels, which runs none of them")
    if cfg.precision in FP8:
        hw.peak(cfg.precision)  # refuses a device without that rate: fp8 before Hopper/Ada, MX before Blackwell
    if features.nvfp4 and "nvfp4" not in hw.peak_flops:
        raise ValueError(f"Features.nvfp4 models NVFP4 linears, which only Blackwell multiplies; {hw.name} has no "
                         f"nvfp4 rate (it has {sorted(hw.peak_flops)})")
    if features.low_precision_head and cfg.precision not in FP8:
        raise ValueError(f"Features.low_precision_head runs the head in the Config's 8-bit format, and precision "
                         f"{cfg.precision!r} has none: set precision to one of {sorted(FP8)}, or leave the head "
                         "in bf16 (low_precision_head=False)")
    if features.fused_qkv and traced is not None:
        raise ValueError("Features.fused_qkv fuses the built-in block's q, k and v projections; a traced model's "
                         "linears are those it ran (trace the model with its projections fused instead)")
    shapes = tuple(stage_shapes(cfg, traced))
    if hw.kind == "cpu":
        memories = tuple(stage_memory(st) for st in shapes)
    else:
        dt = dtypes(cfg, features)
        memories = tuple(_gpu_stage_memory(st, dt, features, hw) for st in shapes)
    return Shaped(cfg, hw, features, shapes, memories)


def price(s: Shaped, efficiency: float | None = None) -> Estimate:
    """The estimate `s` is the first half of: FLOPs, collectives and the step's time (the second half)."""
    cfg, hw, shapes = s.cfg, s.hardware, list(s.shapes)
    net = network(cfg, hw)
    flops = [executed_flops(st, s.features) for st in shapes]
    if hw.kind == "cpu":
        return _cpu(cfg, hw, net, shapes, flops, efficiency or CPU_EFFICIENCY, s.memories)
    return _gpu(cfg, hw, net, shapes, flops, efficiency, s.features, s.memories)


def _cpu(cfg: Config, hw: Hardware, net: Network, shapes: list[Stage], flops: list[float],
         efficiency: float, memories: tuple[Memory, ...]) -> Estimate:
    peak = hw.peak(cfg.precision) * efficiency
    dt = dtypes(cfg)
    # Every stage advances in lockstep with the slowest one; the bubble adds `bubble_slots` idle micro-batch slots.
    slowest_mb_s = max(flops) / peak / cfg.micro_batches
    compute_s = slowest_mb_s * (cfg.micro_batches + bubble_slots(cfg))
    stages = []
    for st, f, memory in zip(shapes, flops, memories):
        own_s = f / peak
        backward_mb_s = own_s / cfg.micro_batches * 2 / 3
        comm = [*dp_comm(st, net, dt, compute_s, backward_mb_s), *tp_comm(st, net, dt), *pp_comm(st, net),
                *ep_comm(st, net), *cp_comm(st, net, attention_flops(st) / peak)]
        stages.append(StageEstimate(stage=st.rank, layers=st.layers, params=st.params, memory=memory,
                                    flops=f, compute_s=own_s, comm=tuple(c for c in comm if c.calls)))
    return Estimate(config=cfg, hardware=hw, efficiency=efficiency, stages=tuple(stages),
                    model_flops=_model_flops(cfg, shapes[0].profile), compute_s=compute_s, assumptions=ASSUMPTIONS,
                    model_params=_model_params(cfg, shapes[0].profile))


def _gpu(cfg: Config, hw: Hardware, net: Network, shapes: list[Stage], flops: list[float],
         efficiency: float | None, features: Features, memories: tuple[Memory, ...]) -> Estimate:
    dt = dtypes(cfg, features)
    m, slots = cfg.micro_batches, cfg.micro_batches + bubble_slots(cfg)
    priced = [_stated(st, f, hw, cfg, efficiency) if efficiency else micro_batch_compute(st, dt, features, hw)
              for st, f in zip(shapes, flops)]
    # A stated efficiency covers everything (the FLOPs model); the kernel model adds the optimizer's step.
    optimizer = [0.0 if efficiency else optimizer_time(st, hw) for st in shapes]
    in_time = cfg.pp > 1 and not efficiency
    # The collectives inside each micro-batch's forward and backward (tp, cp, ep): they lengthen its actions.
    inner = [[*tp_comm(st, net, dt, features, (mb.tp_gather_gemm, mb.tp_scatter_gemm)), *ep_comm(st, net),
              *cp_comm(st, net, m * mb.attention)] for st, mb in zip(shapes, priced)]
    if in_time:
        # The schedule run in time, each stage with its own compute and exposed collectives, each hop a send.
        times = _action_times(shapes, dt, features, hw, priced, inner)
        span = pipeline_span(shapes[0], times, hop_time(shapes[0], net))
        critical = max(range(len(shapes)), key=lambda i: sum(c.exposed_s for c in inner[i]))
        compute_s = span - sum(c.exposed_s for c in inner[critical]) + max(optimizer)
    else:
        # Every stage advances in lockstep with the slowest one; the bubble adds `bubble_slots` idle slots.
        compute_s = max(p.total for p in priced) * slots + max(optimizer)
    stages = []
    for st, f, mb, opt_s, own, memory in zip(shapes, flops, priced, optimizer, inner, memories):
        units = fsdp_unit_count(st, features.fsdp_edge_units)
        gathers_per_unit = 2 if cfg.zero == 3 else 1
        per_unit = ((mb.forward + (mb.backward if cfg.zero == 3 else 0)) / (gathers_per_unit * units),
                    mb.backward / units)
        comm = [*dp_comm(st, net, dt, compute_s, mb.backward, per_unit=per_unit,
                         edge_units=features.fsdp_edge_units), *own,
                *pp_comm(st, net, in_time)]
        split = (("gemm", m * mb.gemm), ("attention", m * mb.attention), ("memory-bound", m * mb.memory_bound),
                 ("optimizer", opt_s))
        comm = [c for c in comm if c.calls]
        stages.append(StageEstimate(stage=st.rank, layers=st.layers, params=st.params,
                                    memory=memory, flops=f,
                                    compute_s=m * mb.total + opt_s, comm=tuple(comm),
                                    compute_split=split, contention_s=contention(comm)))
    executed = max(flops)
    achieved = efficiency or executed / compute_s / hw.peak(cfg.precision)
    return Estimate(config=cfg, hardware=hw, efficiency=achieved, stages=tuple(stages),
                    model_flops=_model_flops(cfg, shapes[0].profile), compute_s=compute_s, assumptions=GPU_ASSUMPTIONS,
                    features=features, model_params=_model_params(cfg, shapes[0].profile))


def _action_times(shapes: list[Stage], dt: Dtypes, features: Features, hw: Hardware,
                  priced: list[MicroBatchCompute], inner: list[list]) -> dict[int, tuple[float, float]]:
    """(forward, backward) seconds of one micro-batch through each pipeline stage: its chunk's own kernels
    (`chunk_shapes`: uneven blocks, the embedding's, the head's and the loss's), and its share (by blocks) of its
    rank's exposed collectives per micro-batch, a third in forward and two in backward."""
    m = shapes[0].cfg.micro_batches
    times = {}
    for st, mb, comm in zip(shapes, priced, inner):
        exposed = sum(c.exposed_s for c in comm) / m
        for chunk in chunk_shapes(st):
            own = micro_batch_compute(chunk, dt, features, hw) if len(st.stages) > 1 else mb
            share = exposed * len(chunk.layers) / max(1, len(st.layers))
            times[chunk.stages[0]] = (own.forward + share / 3, own.backward + 2 * share / 3)
    return times


def _stated(st: Stage, flops: float, hw: Hardware, cfg: Config, efficiency: float) -> MicroBatchCompute:
    """A micro-batch's compute under a stated MFU assumption: executed FLOPs at that fraction of the peak."""
    per_mb = flops / (hw.peak(cfg.precision) * efficiency) / cfg.micro_batches
    return MicroBatchCompute(gemm=per_mb, attention=0.0, memory_bound=0.0, forward=per_mb / 3,
                             backward=per_mb * 2 / 3)


def _gpu_stage_memory(st: Stage, dt: Dtypes, features: Features, hw: Hardware) -> Memory:
    g = gpu_memory(st, dt, features)
    allocated, runtime = g.moments.peak, runtime_bytes(st.cfg)
    return Memory(parameters=g.parameters, gradients=g.gradients, optimizer=g.optimizer, buffers=g.buffers,
                  activations=g.activations, other=g.other, host=g.host, allocated=allocated,
                  reserved=reserved(allocated, hw.memory_bytes - runtime), runtime=runtime,
                  peak_at=g.moments.where)


def _model_flops(cfg: Config, profile: ModelProfile | None = None) -> float:
    """The step's model FLOPs (what MFU divides by): forward and backward once, no recompute."""
    if profile is None:
        return flops_per_token(cfg.model, cfg.seq_len) * cfg.tokens_per_step
    return profile.per_token(profile.model_flops) * cfg.tokens_per_step


def _model_params(cfg: Config, profile: ModelProfile | None = None) -> int:
    """The whole model's parameter elements: the built-in shape's count, or what the trace counted."""
    return cfg.model.num_params if profile is None else profile.params


def grad_sync_bytes_per_step(cfg: Config, hardware: str | Hardware = "h100") -> int:
    """Bytes one rank sends per step for the data-parallel gradient sync: what `StepMetrics.grad_sync_bytes`
    measures (the dp collectives' wire bytes, parameter gathers and ZeRO-1's broadcast excluded)."""
    est = estimate(cfg, hardware)
    return sum(c.wire_bytes for c in est.comm if c.role is Role.GRADIENT_SYNC)


def bubble_slots(cfg: Config) -> float:
    """The schedule's bubble in micro-batch slots of one rank (a slot: a micro-batch through the rank's v stages,
    v(F+B) in chunk times): its formula (`workbench.schedules.bubble_formula`) at F = I = W, B = I + W, the
    zero-bubble papers' assumption. 1F1B gives pp-1, interleaving (pp-1)/v, ZB-V (pp-1)/6, DualPipeV (pp-1)/3."""
    if cfg.pp == 1:
        return 0.0
    d = Durations.split(1.0, 1.0, 1.0)
    return bubble_formula(cfg.schedule, cfg.pp, d) / (config_stages(cfg) * (d.F + d.B))
