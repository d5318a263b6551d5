"""What an estimate says: frozen records of memory, collectives and stages, and the whole `Estimate`."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from workbench.estimate.allocator import with_fragments
from workbench.estimate.options import NO_FEATURES, Features
from workbench.hardware import si

if TYPE_CHECKING:
    from workbench.config import Config
    from workbench.hardware import Hardware

CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv", "all_to_all"]
Axis = Literal["dp", "tp", "pp", "ep", "edp", "cp"]


class Role(enum.Enum):
    """What a collective is for: code selects collectives by role, never by their display text."""

    GRADIENT_SYNC = "gradient sync"
    """The data-parallel gradient sync (all-reduce, reduce-scatter, or a compression hook's phases): what
    `StepMetrics.grad_sync_bytes` measures."""
    PARAMETER_GATHER = "parameter gather"
    """FSDP2's all-gather of sharded parameters (ZeRO-2/3)."""
    PARAMETER_BROADCAST = "parameter broadcast"
    """ZeroRedundancyOptimizer's broadcast of each updated parameter from its owner (ZeRO-1)."""
    SEQUENCE_PARALLEL = "sequence parallel"
    """Tensor parallel's all-gathers and reduce-scatters of activations over the sequence dim."""
    NORM_GRADIENTS = "norm gradients"
    """Tensor parallel's all-reduce of the replicated norm weights' gradients."""
    LOGITS = "logits"
    """Tensor parallel's all-gather of the vocabulary-split logits for the loss."""
    PIPELINE = "pipeline"
    """A stage's sends of activations (forward) and of their gradients (backward)."""
    TOKEN_DISPATCH = "token dispatch"
    """Expert parallel's all-to-alls of routed tokens, their outputs and gradients."""
    ROUTER_COUNTS = "router counts"
    """Expert parallel's all-to-all of how many tokens each expert gets."""
    EXPERT_GRADIENT_SYNC = "expert gradient sync"
    """The expert slices' gradient sync over edp = dp/ep."""
    CONTEXT_RING = "context ring"
    """Context parallel's sends of keys and values (and of their gradients) round the cp ring."""


@dataclass(frozen=True)
class Memory:
    """Bytes on one rank, in the categories the telemetry measures (plus communication copies, kept apart)."""

    parameters: int
    """fp32 parameters held between steps (÷dp under ZeRO-3)."""
    gradients: int
    """fp32 gradients (÷dp under ZeRO-2 and 3)."""
    optimizer: int
    """AdamW's two fp32 moments (÷dp under ZeRO-1, 2 and 3)."""
    buffers: int
    """Copies made for communication: DDP's gradient buckets; FSDP2's gathered parameters (all of them under ZeRO-2,
    the units in flight under ZeRO-3) and full gradients before their reduce-scatter; a pipeline stage's receive
    buffers, one per micro-batch for its input and one for its output's gradient."""
    activations: int
    """Tensors the forward graph saves for backward, for the micro-batches in flight: the telemetry's activations,
    whose peak is the end of a forward (parameters, and views of them, are counted as parameters; a pipeline stage's
    input as the buffer it was received into)."""
    other: int
    """Transient working sets: the loss's logits (and their fp32 copy under autocast); under checkpointing, the
    one block that backward rebuilds at a time (saved by the recomputation, not by forward)."""

    host: int = 0
    """Bytes kept in host memory instead (Config.offload), not in `total`: zero 0/1, AdamW's moments, the fp32
    master copy and (on CUDA) a pinned gradient buffer of this rank's optimizer share; zero 2/3, FSDP2's
    CPUOffloadPolicy: the parameter and gradient shards and the moments."""
    allocated: int = 0
    """GPU: the most bytes tensors hold at once, following the order the step allocates and frees them (each
    category above is its own peak, and they do not all peak together). 0 on the CPU model, whose peak is the
    sum of the categories."""
    reserved: int = 0
    """GPU: what torch's caching allocator reserves at that peak (`allocated` and its free fragments): the
    figure torch.cuda.max_memory_reserved and torchtitan's published memory read. 0 on the CPU model."""
    runtime: int = 0
    """GPU: device memory outside torch's allocator, the CUDA context and NCCL's buffers."""
    peak_at: str = ""
    """GPU: the moment of the step that holds `allocated` (e.g. "loss backward")."""

    @property
    def categories(self) -> int:
        """The sum of the categories, each at its own peak."""
        return self.parameters + self.gradients + self.optimizer + self.buffers + self.activations + self.other

    @property
    def total(self) -> int:
        """What the device must hold: on GPU the allocator's reserve and the memory outside it; on the CPU model
        the sum of the categories."""
        return (self.reserved or self.categories) + self.runtime


@dataclass(frozen=True)
class Collective:
    """One kind of collective on one mesh axis, summed over a step, as one rank sees it."""

    axis: Axis
    kind: CollectiveKind
    role: Role
    what: str
    """For people: what travels (the role says it for code)."""
    calls: int
    """Calls per step."""
    bytes: int
    """Payload per step: each call's size as nccl-tests counts it, summed; the figure the telemetry records for
    the same calls (`Interval.bytes` defines it: all-gather's output, reduce-scatter's input)."""
    wire_bytes: int
    """Bytes per step on this rank's busiest link: bytes times nccl-tests' bus factor (`links.bus_factor`:
    2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter, 1 for broadcast and a send)."""
    time_s: float
    """wire_bytes at the link bandwidth: the time of a collective whose measured busbw is the link's."""
    exposed_s: float
    """The part of time_s no computation hides."""


@dataclass(frozen=True)
class StageEstimate:
    """One pipeline stage; every rank of the stage (across dp and tp) looks the same."""

    stage: int
    layers: tuple[int, ...]
    """Global indices of the blocks this stage holds."""
    params: int
    """Parameter elements of the stage's shard after the tensor-parallel split, before ZeRO sharding."""
    memory: Memory
    flops: float
    """FLOPs one rank of this stage executes per step, recomputation included."""
    compute_s: float
    """This rank's own compute per step, without pipeline bubbles."""
    comm: tuple[Collective, ...]
    compute_split: tuple[tuple[str, float], ...] = ()
    """GPU: compute_s by kind of kernel ("gemm", "attention", "memory-bound", "optimizer"); () on CPU."""
    contention_s: float = 0.0
    """What the collectives this stage hides add to its compute by running beside it (GPU: `contention`); 0 on the
    CPU model."""

    @property
    def exposed_comm_s(self) -> float:
        return sum(c.exposed_s for c in self.comm)


@dataclass(frozen=True)
class Estimate:
    """What a Config is predicted to need and do on a hardware profile; `table()` prints it."""

    config: Config
    hardware: Hardware
    efficiency: float
    """The fraction of peak FLOP/s that executed FLOPs reach: the stated assumption (CPU model, or an explicit
    `efficiency=`), or what the GPU kernel model achieves."""
    stages: tuple[StageEstimate, ...]
    model_flops: float
    """Model FLOPs per step, all ranks together: flops_per_token · tokens per step."""
    compute_s: float
    """Compute per step on the slowest stage, pipeline bubble included."""
    assumptions: tuple[str, ...] = ()
    features: Features = NO_FEATURES
    """Published-run settings beyond the engine that this estimate modelled (`options.Features`)."""
    model_params: int = 0
    """Parameter elements of the whole model: the built-in shape's count, or a traced model's own (a foreign
    model's Config does not know it)."""

    @property
    def peak_stage(self) -> StageEstimate:
        """The stage with the most memory: the one that decides whether the configuration fits."""
        return max(self.stages, key=lambda s: s.memory.total)

    @property
    def critical_stage(self) -> StageEstimate:
        """The stage whose exposed communication is longest: the one that sets the step time."""
        return max(self.stages, key=lambda s: s.exposed_comm_s)

    @property
    def memory(self) -> Memory:
        return self.peak_stage.memory

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.hardware.memory_bytes

    @property
    def tight(self) -> bool:
        """Whether it fits only as the caching allocator gives back its cache: its tensors fit the device, but not
        beside the free fragments the model prices (`allocator.FRAGMENTATION`). It runs, each cudaMalloc that fails
        first freeing the allocator's unused blocks and trying again (a device-wide synchronisation: memory_stats'
        num_alloc_retries), unless expandable segments keep the fragments smaller."""
        m = self.memory
        return self.fits and bool(m.allocated) and with_fragments(m.allocated) + m.runtime > self.hardware.memory_bytes

    @property
    def headroom(self) -> int:
        """Device bytes left at the peak (negative: how much is missing)."""
        return round(self.hardware.memory_bytes - self.memory.total)

    @property
    def comm(self) -> tuple[Collective, ...]:
        return self.critical_stage.comm

    @property
    def exposed_comm_s(self) -> float:
        return self.critical_stage.exposed_comm_s

    @property
    def contention_s(self) -> float:
        """The critical stage's compute lost to the collectives it hides (`StageEstimate.contention_s`)."""
        return self.critical_stage.contention_s

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.contention_s

    @property
    def flops_per_token(self) -> float:
        """Model FLOPs per token (forward and backward once): the formula's, or a traced model's."""
        return self.model_flops / self.config.tokens_per_step

    @property
    def tokens_per_s(self) -> float:
        return self.config.tokens_per_step / self.step_time_s

    @property
    def mfu(self) -> float:
        """Model FLOPs over step time and the peak of every rank: what the telemetry would report."""
        peak = self.hardware.peak(self.config.precision) * self.config.world_size
        return self.model_flops / self.step_time_s / peak

    def comm_bytes(self) -> dict[str, int]:
        """wire_bytes per step on the critical stage, by collective kind."""
        totals: dict[str, int] = {}
        for c in self.comm:
            totals[c.kind] = totals.get(c.kind, 0) + c.wire_bytes
        return totals

    def table(self) -> str:
        """A plain-text summary that reads well in a notebook cell."""
        return render(self)

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        # IPython shows this instead of the dataclass repr when an estimate ends a cell.
        printer.text(self.table())


CATEGORIES = ("parameters", "gradients", "optimizer", "buffers", "activations", "other", "host")


def render(est: Estimate) -> str:
    """An estimate as plain text that reads well in a notebook cell (nothing is computed here)."""
    cfg, hw, mem = est.config, est.hardware, est.memory
    peak = est.peak_stage
    where = f" (stage {peak.stage} of {cfg.pp})" if cfg.pp > 1 else ""
    features = f"; modelled: {est.features.describe()}" if est.features.describe() != "none" else ""
    lines = [
        f"estimate  {cfg.layout} on {cfg.world_size} × {hw.name} ({'measured' if hw.measured else 'datasheet'}, "
        f"{hw.kind} kernels{features})",
        f"model     {si(est.model_params, '').rstrip().replace('G', 'B')} parameters, "
        f"{si(est.flops_per_token, 'FLOP')}/token "
        f"at seq_len {cfg.seq_len}; {cfg.tokens_per_step:,} tokens/step",
        f"memory per rank{where}" + (", each category at its own peak" if mem.allocated else ""),
    ]
    for name in CATEGORIES:
        lines.append(f"  {name:<12} {si(getattr(mem, name), 'B'):>10}")
    verdict = ("fits, tight (the caching allocator must give back its cache)" if est.tight
               else "fits" if est.fits else "DOES NOT FIT")
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
    beside = f", compute slowed beside hidden comm {est.contention_s * 1e3:,.1f} ms" if est.contention_s else ""
    lines.append(f"step      {est.step_time_s * 1e3:,.1f} ms (exposed comm {est.exposed_comm_s * 1e3:,.1f} ms{beside}); "
                 f"MFU {est.mfu:.0%}; {est.tokens_per_s:,.0f} tokens/s")
    return "\n".join(lines)
