"""Predicted memory, FLOPs, communication and step time of a `Config` on a hardware profile, from shapes alone.

Pure arithmetic with no torch import, so the notebook can re-run it on every
widget change. Figures are per rank; with pipeline parallelism every stage is
estimated and the most loaded one reported. The model is `engine/model.py`
run the way the engine runs it: fp32 parameters, gradients and AdamW moments,
bf16/fp16 through autocast. Everything else assumed is listed in
`ASSUMPTIONS` and printed with each estimate.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace
from typing import Literal

from workbench.config import Config, ModelConfig, checkpointed_blocks
from workbench.schedules import config_stages, rank_layers, rank_orders, stages_of_rank
from workbench.hardware import Hardware, profile, si
from workbench.telemetry.analysis import bus_factor

CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv", "all_to_all"]
Axis = Literal["dp", "tp", "pp", "ep", "edp", "cp"]

DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's default gradient bucket (bucket_cap_mb=25): one all-reduce per bucket."""
DDP_FIRST_BUCKET_BYTES = 2**20

ASSUMPTIONS = (
    "fp32 parameters and gradients (4 B each) and two fp32 AdamW moments (8 B) per parameter; bf16/fp16 run "
    "through autocast, so the fp32 parameters are the master copy and there is no other",
    "ZeRO 0 = DDP (its buckets a second copy of the gradients, as gradient_as_bucket_view is off; with tp > 1 "
    "FSDP2's replicate, one all-reduce per block), 1 = + ZeroRedundancyOptimizer, 2 = FSDP2 without resharding "
    "after forward, 3 = FSDP2; FSDP2 units are the blocks, and the rest of a stage is the root",
    "gradients are synchronised once per step (DDP no_sync, pipeline schedules); FSDP2 without a pipeline "
    "reduce-scatters after every micro-batch; within a pipeline it accumulates full gradients, and ZeRO-2 then "
    "gathers parameters once per step; ZeRO-3 gathers each unit for every forward and backward",
    "tensor parallel is Megatron-style with sequence parallel (DTensor plans): attention and MLP weights, the "
    "embedding (vocab-parallel) and the head split across tp, norms replicated; the logits are gathered for the "
    "loss (no loss parallel)",
    "activations are the tensors autograd saves for backward, term by term as torch's CPU kernels save them for "
    "this model (a fused GPU RMSNorm may save less), each storage once however many ops save it; under autocast "
    "each in-flight micro-batch also holds the 2-byte copies of the weights it used",
    "checkpointed blocks keep only their input; the one block backward rebuilds at a time is a transient, counted "
    "under other with the logits: activations are what forward leaves saved, as the telemetry measures them",
    "a pipeline rank holds the micro-batches its schedule has run forward and not yet backward, in the order torch "
    "runs that rank's actions, and peaks at the end of the forward that leaves most saved; each stage's input and "
    "its output's gradient arrive in receive buffers torch allocates once per micro-batch and keeps between steps, "
    "counted under buffers (the input its first block saves is not counted again); not counted: the stage output "
    "(on the last stage the logits) that torch keeps for each micro-batch until its backward",
    "peak memory is the sum of every category, with no credit for freeing before the peak",
    "model FLOPs count attention over the full seq² square (causal masking not halved), like PaLM's MFU and "
    "torch's FlopCounterMode; recomputation is executed but not model FLOPs",
    "every collective's bus bandwidth (as nccl-tests defines it) is the profile's link bandwidth, no latency term; "
    "ranks are in one NVLink domain",
    "gradient syncs hide behind the backward they follow, FSDP all-gathers behind the rest of the compute; "
    "tensor-parallel collectives, pipeline sends and ZeRO-1's parameter broadcast are exposed",
    "mixture of experts: the router balances perfectly (each expert and each ep rank gets its even share of the "
    "assignments, capped by capacity), so every figure that depends on routing is its mean over ranks; "
    "activations exact in fp32, the autocast copies of routed tokens and expert weights approximate; the "
    "expert-parallel all-to-alls block (exposed), expert gradients are all-reduced over edp per micro-batch "
    "under ZeRO-0 and sharded over edp by FSDP2 under ZeRO-2/3; with tp > 1 a MoE FFN is whole on every tp rank "
    "and computes the gathered sequence there (replicated), its output sliced back to the rank's shard",
)


def _matmul_params(m: ModelConfig) -> tuple[int, int]:
    """Elements of one block's weight matrices, and of the output head."""
    attn = 2 * m.dim * m.n_heads * m.head_dim + 2 * m.dim * m.kv_heads * m.head_dim
    return attn + 3 * m.dim * m.hidden_dim, m.dim * m.vocab_size


def _moe_matmul_delta(m: ModelConfig) -> int:
    """Weight elements one token multiplies in a MoE FFN beyond those of the dense FFN it replaces: the router,
    top_k experts and the shared expert instead of one SwiGLU."""
    mlp = 3 * m.dim * m.hidden_dim
    return m.dim * m.n_experts + (m.top_k + m.shared_expert - 1) * mlp


def flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of forward + backward for one token at sequence length `seq_len`.

    6 · (weight-matrix elements, output head included; the embedding is a lookup)
    + 12 · layers · seq_len · dim for attention's q·kᵀ and p·v, counted over the
    full square (not halved for causality), as FlopCounterMode counts them.
    """
    block, head = _matmul_params(model)
    moe = model.n_moe_layers * _moe_matmul_delta(model)  # a MoE FFN counts the experts a token goes through
    return 6 * (model.n_layers * block + moe + head) + 12 * model.n_layers * seq_len * model.n_heads * model.head_dim


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of the model states ZeRO shards: the parameters, their gradients, the optimizer's state."""

    parameters: int
    gradients: int
    optimizer: int


ENGINE_STATE_BYTES = StateBytes(parameters=4, gradients=4, optimizer=8)
"""How the engine holds them: fp32 parameters (the master copy; bf16/fp16 come from autocast), fp32 gradients,
AdamW's two fp32 moments."""
ZERO_PAPER_STATE_BYTES = StateBytes(parameters=2, gradients=2, optimizer=12)
"""Rajbhandari et al. 2020 (ZeRO), section 3.1: mixed-precision Adam keeps fp16 parameters and gradients (2+2 B)
and K = 12 B of optimizer state (fp32 master parameters, momentum, variance)."""

OPTIMIZER_STATE_BYTES = {"adamw": 8, "lion": 4, "sgd": 4}
"""fp32 optimizer state per parameter by Config.optimizer: AdamW's two moments, Lion's one, SGD's momentum buffer."""


def engine_state_bytes(optimizer: str) -> StateBytes:
    """What the engine keeps per parameter with `optimizer` (ENGINE_STATE_BYTES is AdamW's)."""
    return StateBytes(parameters=4, gradients=4, optimizer=OPTIMIZER_STATE_BYTES[optimizer])


def model_state_memory(params: int, dp: int, zero: int,
                       state: StateBytes = ENGINE_STATE_BYTES) -> tuple[int, int, int]:
    """Bytes of (parameters, gradients, optimizer state) on one rank for `params` parameter elements, with ZeRO
    stage `zero` across `dp` ranks: stage 1 shards the optimizer state, 2 also the gradients, 3 also the parameters.
    The estimator's own arithmetic for these categories, whatever the bytes per parameter."""
    return (_ceil_div(state.parameters * params, dp if zero == 3 else 1),
            _ceil_div(state.gradients * params, dp if zero >= 2 else 1),
            _ceil_div(state.optimizer * params, dp if zero >= 1 else 1))


def zero_paper_memory(params: int, dp: int) -> dict[int, int]:
    """Model-state bytes per rank at ZeRO stages 0-3 under the ZeRO paper's convention (2+2+12 B per parameter):
    what its Figure 1 tabulates as baseline, P_os, P_os+g and P_os+g+p."""
    return {zero: sum(model_state_memory(params, dp, zero, ZERO_PAPER_STATE_BYTES)) for zero in range(4)}


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

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.buffers + self.activations + self.other


@dataclass(frozen=True)
class Collective:
    """One kind of collective on one mesh axis, summed over a step, as one rank sees it."""

    axis: Axis
    kind: CollectiveKind
    what: str
    calls: int
    """Calls per step."""
    bytes: int
    """Payload per step: each call's size as nccl-tests counts it, summed; the figure the telemetry records for
    the same calls (`Interval.bytes` defines it: all-gather's output, reduce-scatter's input)."""
    wire_bytes: int
    """Bytes per step on this rank's busiest link: bytes times nccl-tests' bus factor (`analysis.bus_factor`:
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

    @property
    def exposed_comm_s(self) -> float:
        return sum(c.exposed_s for c in self.comm)


@dataclass(frozen=True)
class Estimate:
    """What a Config is predicted to need and do on a hardware profile; `table()` prints it."""

    config: Config
    hardware: Hardware
    efficiency: float
    """The stated MFU assumption: the fraction of peak FLOP/s that executed FLOPs reach."""
    stages: tuple[StageEstimate, ...]
    model_flops: float
    """Model FLOPs per step, all ranks together: flops_per_token · tokens per step."""
    compute_s: float
    """Compute per step on the slowest stage, pipeline bubble included."""
    assumptions: tuple[str, ...] = ASSUMPTIONS

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
    def comm(self) -> tuple[Collective, ...]:
        return self.critical_stage.comm

    @property
    def exposed_comm_s(self) -> float:
        return self.critical_stage.exposed_comm_s

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.exposed_comm_s

    @property
    def flops_per_token(self) -> float:
        return flops_per_token(self.config.model, self.config.seq_len)

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
        cfg, hw, mem = self.config, self.hardware, self.memory
        peak = self.peak_stage
        where = f" (stage {peak.stage} of {cfg.pp})" if cfg.pp > 1 else ""
        lines = [
            f"estimate  {cfg.layout} on {cfg.world_size} × {hw.name} ({'measured' if hw.measured else 'datasheet'})",
            f"model     {si(cfg.model.num_params, '').rstrip().replace('G', 'B')} parameters, "
            f"{si(self.flops_per_token, 'FLOP')}/token "
            f"at seq_len {cfg.seq_len}; {cfg.tokens_per_step:,} tokens/step",
            f"memory per rank{where}",
        ]
        for name in (f.name for f in fields(Memory)):
            lines.append(f"  {name:<12} {si(getattr(mem, name), 'B'):>10}")
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(f"  {'total':<12} {si(mem.total, 'B'):>10}  of {si(hw.memory_bytes, 'B')}: {verdict}")
        lines.append(f"compute   {si(self.model_flops, 'FLOP')}/step; {self.compute_s * 1e3:,.1f} ms at "
                     f"{self.efficiency:.0%} of {si(hw.peak(cfg.precision), 'FLOP/s')} {cfg.precision}"
                     + (" (with the pipeline bubble)" if cfg.pp > 1 else ""))
        if self.comm:
            crit = f" (stage {self.critical_stage.stage})" if cfg.pp > 1 else ""
            lines.append(f"comm per step per rank{crit}")
            lines.append(f"  {'':<3} {'collective':<15} {'what':<38} {'calls':>6} {'on wire':>10} {'time':>10} "
                         f"{'exposed':>10}")
            for c in self.comm:
                lines.append(f"  {c.axis:<3} {c.kind:<15} {c.what:<38} {c.calls:>6} {si(c.wire_bytes, 'B'):>10} "
                             f"{c.time_s * 1e3:>7.2f} ms {c.exposed_s * 1e3:>7.2f} ms")
        lines.append(f"step      {self.step_time_s * 1e3:,.1f} ms (exposed comm {self.exposed_comm_s * 1e3:,.1f} ms); "
                     f"MFU {self.mfu:.0%}; {self.tokens_per_s:,.0f} tokens/s")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        # IPython shows this instead of the dataclass repr when an estimate ends a cell.
        printer.text(self.table())


def estimate(cfg: Config, hardware: str | Hardware = "h100", *, efficiency: float = 0.4) -> Estimate:
    """Predict per-rank memory, FLOPs, communication and step time of `cfg` on `hardware`.

    `efficiency` is the stated MFU assumption: executed FLOPs run at that fraction of the device's peak.
    """
    hw = profile(hardware) if isinstance(hardware, str) else hardware
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must lie in (0, 1], got {efficiency}")
    peak = hw.peak(cfg.precision) * efficiency
    plans = [_StagePlan(cfg, rank, layers) for rank, layers in enumerate(rank_layers(cfg))]
    # Every stage advances in lockstep with the slowest one; the bubble adds (pp-1)/v idle micro-batch slots.
    slowest_mb_s = max(p.flops for p in plans) / peak / cfg.micro_batches
    compute_s = slowest_mb_s * (cfg.micro_batches + (cfg.pp - 1) / config_stages(cfg))
    stages = tuple(p.finish(hw, peak, compute_s) for p in plans)
    model_flops = flops_per_token(cfg.model, cfg.seq_len) * cfg.tokens_per_step
    return Estimate(config=cfg, hardware=hw, efficiency=efficiency, stages=stages, model_flops=model_flops,
                    compute_s=compute_s)


@functools.lru_cache(maxsize=128)
def _rank_orders(schedule: str, pp: int, micro_batches: int, chunks: int) -> tuple[tuple, ...]:
    """Every rank's actions in order, computed once per schedule shape: each stage of an estimate, and each of the
    many layouts `wb.plan` estimates, reads the same grid."""
    return tuple(tuple(order) for order in rank_orders(schedule, pp, micro_batches, chunks))


def _ceil_div(a: float, b: int) -> int:
    return math.ceil(a / b)


class _StagePlan:
    """The arithmetic for one pipeline rank, in the order a step runs: shapes, memory, FLOPs, then collectives."""

    def __init__(self, cfg: Config, rank: int, layers: tuple[int, ...]) -> None:
        m, tp = cfg.model, cfg.tp
        self.cfg, self.rank, self.layers = cfg, rank, layers
        self.first, self.last = self.rank == 0, self.rank == cfg.pp - 1
        self.chunks = config_stages(cfg)
        # Global indices of the pipeline stages this rank holds (loop placement), and of the model's last one.
        self.stages = tuple(stages_of_rank(rank, cfg.pp, self.chunks))
        self.last_stage = cfg.pp * self.chunks - 1
        # Stage boundaries this rank crosses per micro-batch: an input from the stage before (all but stage 0) and
        # a gradient from the stage after (all but the last), each received and, by the neighbour, sent.
        self.boundaries = sum(s > 0 for s in self.stages) + sum(s < self.last_stage for s in self.stages)
        self.autocast = cfg.precision in ("bf16", "fp16", "fp8_tensorwise", "fp8_rowwise")  # fp8: bf16 beside
        self.act_bytes = 2 if self.autocast else 4
        block_full, head_full = _matmul_params(m)
        # Tensor parallel splits every weight matrix (head and embedding vocab-parallel); norms stay whole.
        self.block_matmul = block_full // tp
        self.block_params = self.block_matmul + 2 * m.dim
        self.embedding = _ceil_div(m.vocab_size, tp) * m.dim
        self.head = _ceil_div(m.vocab_size, tp) * m.dim
        self.root = self.first * self.embedding + self.last * (self.head + m.dim)
        self.params = len(layers) * self.block_params + self.root
        # Parameter tensors: 7 matrices and 2 norm weights per block; embedding; final norm and head.
        self.tensors = 9 * len(layers) + self.first + 2 * self.last
        # Mixture of experts: router, this rank's 1/ep of the stacked experts, the shared expert, all whole on
        # every tp rank, in place of the dense SwiGLU's 1/tp.
        self.moe_layers = tuple(i for i in layers if m.is_moe_layer(i))
        mlp = 3 * m.dim * m.hidden_dim
        self.expert_params = len(self.moe_layers) * m.n_experts // cfg.ep * mlp
        """Expert elements on this rank: synchronised (and under ZeRO sharded) over edp = dp/ep, not dp."""
        self.params += len(self.moe_layers) * (m.dim * m.n_experts + m.shared_expert * mlp - mlp // tp) \
            + self.expert_params
        self.tensors += len(self.moe_layers) * (1 + 3 * m.shared_expert)
        # Context parallel: a cp rank holds seq_len/cp tokens of every sequence (its attention reads all of them).
        self.tokens = cfg.micro_batch_size * cfg.seq_len // cfg.cp
        self.sync = cfg.dp * cfg.cp
        """Ranks that hold the same weights and average their gradients: dp, times cp."""
        self.shard_ranks = self.sync // cfg.dp_replicate if cfg.hsdp else self.sync
        """Ranks ZeRO shards over: all of `sync`, or under HSDP one shard group (dp/dp_replicate, times cp)."""
        self.checkpointed = self._checkpointed(layers)
        attn_fwd = 4 * cfg.seq_len * m.n_heads * m.head_dim
        block_train = 3 * (2 * block_full + attn_fwd)
        recompute = 2 * block_full + attn_fwd
        per_token = len(layers) * block_train + self.checkpointed * recompute + self.last * 3 * 2 * head_full
        replicated = 0  # per token, computed whole on every tp rank
        if m.n_experts:
            # A MoE FFN runs the router, top_k experts and the shared expert, replicated over tp, instead of
            # the dense SwiGLU's 1/tp; its forward runs again where the block is checkpointed.
            runs = 3 * len(self.moe_layers) + sum(self._is_checkpointed(i) for i in self.moe_layers)
            per_token -= runs * 2 * mlp
            replicated = runs * 2 * (_moe_matmul_delta(m) + mlp)
        self.flops = (per_token / tp + replicated) * self.tokens * cfg.micro_batches

    # --- memory -----------------------------------------------------------------------------------------------

    def block_activations(self) -> int:
        """Bytes one block saves for backward for one micro-batch, measured term by term on this model.

        Per token, with a = 2 under autocast else 4, sequence-parallel parts ÷ tp:
          two RMSNorms: input, 1/rms and x/rms in fp32          (16·dim + 8) ÷ tp
          inputs of wq,wk,wv and w1,w3 (gathered, full length)  8·dim fp32; 10·dim under autocast (one cast each)
          attention: rotated q and k, v, output; logsumexp      (a·(2·dim + 2·kv_dim) + 4·heads) ÷ tp
          SwiGLU: w1 out, silu out, w3 out, product             4·a·hidden ÷ tp
        plus, under autocast, the 2-byte copy of the block's weights. Every norm saves its input twice (for the
        square and for the product with 1/rms), one storage; in the first block under tp that input is the
        embedding's reduce-scatter output, a wrapper around the collective's result, one sharded residual all the
        same.
        """
        m, tp, a = self.cfg.model, self.cfg.tp, self.act_bytes
        kv_dim = m.kv_heads * m.head_dim
        sharded = 16 * m.dim + 8 + a * (2 * m.dim + 2 * kv_dim) + 4 * m.n_heads + 4 * a * m.hidden_dim
        gathered = 10 * m.dim if self.autocast else 8 * m.dim
        casts = 2 * self.block_matmul if self.autocast else 0
        return round(self.tokens * (sharded / tp + gathered)) + casts

    def assignments(self) -> int:
        """(token, expert) assignments one micro-batch keeps in one MoE layer: top_k per token, at most the capacity
        of every expert in every sequence (the routing group)."""
        m, cfg = self.cfg.model, self.cfg
        return min(self.tokens * m.top_k, cfg.micro_batch_size * m.n_experts * m.expert_capacity(cfg.seq_len))

    def moe_activations(self) -> int:
        """Bytes a MoE FFN saves for one micro-batch beyond the SwiGLU it replaces (its input is counted as the
        block's), term by term as measured, with A kept assignments, R of them arriving here (R = A, balanced):
          routed tokens (fp32 input) R·D·4; their outputs and weighted outputs 2·A·D·a; SwiGLU per assignment
          4·A·H·a; router: fp32 probabilities T·E·4, top-k indices T·k·8, top-k weights and their sum T·(4k+4),
          the keep mask T·k bytes, per-sequence shares B·E·4; kept weights, token ids and sort order A·(4+8+8);
          with ep > 1 the regrouping order and its inverse 2·R·8. Under autocast, the 2-byte copies of each
          expert's tokens (twice) and of this rank's expert weights."""
        cfg, m, a = self.cfg, self.cfg.model, self.act_bytes
        t, k, n_e, d, h = self.tokens, m.top_k, m.n_experts, m.dim, m.hidden_dim
        kept = arrived = self.assignments()
        saved = (4 * arrived * d + 2 * a * kept * d + 4 * a * kept * h + t * (4 * n_e + 12 * k + 4 + k)
                 + cfg.micro_batch_size * n_e * 4 + 20 * kept + (16 * arrived if cfg.ep > 1 else 0))
        if m.shared_expert:
            saved += 4 * a * t * h
        if self.autocast:
            saved += 2 * 2 * arrived * d + 2 * 3 * d * h * n_e // cfg.ep
        return saved - round(4 * a * t * h / cfg.tp)  # the dense SwiGLU term, already in block_activations

    def layer_activations(self, layer: int) -> int:
        """Bytes block `layer` saves for one micro-batch (a MoE block differs from a dense one in its FFN)."""
        block = self.block_activations()
        return block + self.moe_activations() if self.cfg.model.is_moe_layer(layer) else block

    def edge_activations(self, first: bool, last: bool) -> int:
        """Bytes saved outside the blocks: token ids (first stage); final norm, head input, log-probs (last)."""
        m, tp = self.cfg.model, self.cfg.tp
        saved = 8 * self.tokens if first else 0
        if last:
            head_input = 2 * m.dim if self.autocast else 4 * m.dim
            # log_softmax keeps its fp32 output over the whole (gathered) vocabulary, plus the int64 targets.
            per_token = (8 * m.dim + 4) / tp + head_input + 4 * m.vocab_size + 8
            saved += round(self.tokens * per_token) + (2 * self.head if self.autocast else 0)
        return saved

    def stage_activations(self) -> dict[int, int]:
        """Bytes one micro-batch leaves saved in each pipeline stage this rank holds, by global stage index.

        A stage after the first saves its input where it arrived: torch's receive buffer for that micro-batch, which
        is held between steps whatever is in flight and counted under buffers, so the first block's figure is
        taken without it.
        """
        per_chunk = len(self.layers) // self.chunks
        saved = {}
        for c, stage in enumerate(self.stages):
            layers = self.layers[c * per_chunk:(c + 1) * per_chunk]
            checkpointed = self._checkpointed(layers)
            kept = sum(self.layer_activations(i) for i in layers if not self._is_checkpointed(i)) \
                + checkpointed * self._residual()
            received = self._residual() if stage > 0 else 0
            saved[stage] = kept + self.edge_activations(stage == 0, stage == self.last_stage) - received
        return saved

    def peak_activations(self) -> int:
        """The most bytes saved at once, walking this rank's actions in the schedule's order: a forward adds its
        stage's micro-batch, a backward frees one. Interleaved stages save different amounts, so which forward
        ends at the peak depends on the order, not only on how many micro-batches are in flight."""
        cfg, saved = self.cfg, self.stage_activations()
        if cfg.pp == 1:
            return saved[0]  # gradient accumulation backpropagates each micro-batch before the next forward
        live = peak = 0
        for action in _rank_orders(cfg.schedule, cfg.pp, cfg.micro_batches, self.chunks)[self.rank]:
            live += saved[action.stage] if action.kind == "F" else -saved[action.stage]
            peak = max(peak, live)
        return peak

    def memory(self) -> Memory:
        cfg, m = self.cfg, self.cfg.model
        dp, zero = cfg.dp, cfg.zero
        params = 4 * self.params
        experts, edp = 4 * self.expert_params, dp // cfg.ep
        # DDP copies every gradient into its flat buckets (FSDP2's replicate, used under tp, does not); with ep > 1
        # it ignores the expert slices, which are all-reduced over edp on their own.
        buffers = params - (experts if cfg.ep > 1 else 0) if zero <= 1 and self.sync > 1 and cfg.tp == 1 else 0
        if zero >= 2:
            largest_unit = max(self.root, self.block_params if self.layers else 0)
            # Within a pipeline, FSDP2 accumulates full gradients until the last micro-batch; alone, it
            # reduce-scatters each unit's gradient as backward finishes it.
            grads_before_sync = params if cfg.pp > 1 else 4 * largest_unit
            if zero == 2:
                gathered = params
            else:
                # The root stays gathered from forward to backward; blocks are gathered one ahead of use.
                gathered = 4 * (self.root + min(2, len(self.layers)) * self.block_params)
            buffers = gathered + grads_before_sync
        if cfg.pp > 1:
            # torch allocates, once, a receive buffer per micro-batch for each stage's input (but the first stage's)
            # and for the gradient of its output (but the last's), and keeps them between steps.
            buffers += self.boundaries * cfg.micro_batches * self._residual()
        # The loss reads the logits: bf16 logits plus their fp32 copy under autocast, fp32 logits otherwise.
        other = self.tokens * m.vocab_size * (6 if self.autocast else 4) if self.last else 0
        if self.checkpointed:
            other += max(self.layer_activations(i) for i in self.layers if self._is_checkpointed(i))
        # Expert slices are synchronised and sharded over edp = dp/ep, everything else over dp.
        split_experts = self.expert_params if cfg.ep > 1 else 0
        state = engine_state_bytes(cfg.optimizer)
        dense = model_state_memory(self.params - split_experts, self.shard_ranks, zero, state)
        sliced = model_state_memory(split_experts, edp, zero, state)
        parameters, gradients, optimizer = (a + b for a, b in zip(dense, sliced))
        memory = Memory(
            parameters=parameters,
            gradients=gradients,
            optimizer=optimizer,
            buffers=buffers,
            activations=self.peak_activations(),
            other=other,
        )
        return _offloaded(memory, cfg, params) if cfg.offload else memory

    def _is_checkpointed(self, layer: int) -> bool:
        return bool(checkpointed_blocks([layer], self.cfg.activation_checkpointing))

    def _checkpointed(self, layers: tuple[int, ...]) -> int:
        """How many of `layers` recompute their activations."""
        return len(checkpointed_blocks(list(layers), self.cfg.activation_checkpointing))

    def _residual(self) -> int:
        """One micro-batch's fp32 residual stream, sequence-sharded under tp: what a checkpointed block keeps, and
        what a pipeline stage receives and sends."""
        return _ceil_div(4 * self.tokens * self.cfg.model.dim, self.cfg.tp)

    # --- communication ----------------------------------------------------------------------------------------

    def finish(self, hw: Hardware, peak: float, step_compute_s: float) -> StageEstimate:
        """The stage's estimate, once the pipeline-wide compute time is known."""
        compute_s = self.flops / peak
        backward_mb_s = compute_s / self.cfg.micro_batches * 2 / 3
        comm = [*self._dp_comm(hw, step_compute_s, backward_mb_s), *self._tp_comm(hw), *self._pp_comm(hw),
                *self._ep_comm(hw), *self._cp_comm(hw, peak)]
        return StageEstimate(stage=self.rank, layers=self.layers, params=self.params, memory=self.memory(),
                             flops=self.flops, compute_s=compute_s, comm=tuple(c for c in comm if c.calls))

    def _collective(self, hw: Hardware, axis: Axis, kind: CollectiveKind, what: str, calls: int, payload: float,
                    group: int, hidden_by: float = 0.0) -> Collective:
        """One collective summed over a step; `payload` is each call's size: the whole gathered or reduced data."""
        nbytes = payload * calls
        # send_recv counts this rank's sends; links are full duplex, so what it receives takes nothing from them.
        wire = nbytes * bus_factor("send" if kind == "send_recv" else kind, group)
        time_s = wire / hw.link_bw
        return Collective(axis=axis, kind=kind, what=what, calls=calls, bytes=round(nbytes),
                          wire_bytes=round(wire), time_s=time_s, exposed_s=max(0.0, time_s - hidden_by))

    def _dp_comm(self, hw: Hardware, step_compute_s: float, backward_mb_s: float) -> list[Collective]:
        cfg = self.cfg
        n, shard = self.sync, self.shard_ranks  # the cp ranks average gradients with the dp ranks
        if n == 1:
            return []
        # With ep > 1 the expert slices are synchronised over edp (`_ep_comm`), the rest over dp.
        grads = 4 * (self.params - (self.expert_params if cfg.ep > 1 else 0))
        m, units = cfg.micro_batches, len(self.layers) + (self.root > 0)
        if cfg.zero <= 1:
            if cfg.tp > 1:
                calls, what = units, "gradients (replicate, per block)"
            else:
                # DDP's first bucket is small (1 MiB) so that communication starts early in backward.
                calls, what = 1 + math.ceil(max(0, grads - DDP_FIRST_BUCKET_BYTES) / DDP_BUCKET_BYTES), "gradients"
            if cfg.compression != "none":
                out = self._compressed_sync(hw, grads, backward_mb_s)
            else:
                out = [self._collective(hw, "dp", "all_reduce", what, calls, grads / calls, n,
                                        hidden_by=backward_mb_s)]
            if cfg.zero == 1:
                # ZeroRedundancyOptimizer broadcasts each updated parameter tensor from the rank that owns it.
                out.append(self._collective(hw, "dp", "broadcast", "updated parameters (ZeRO-1)", self.tensors,
                                            grads / self.tensors, n))
            return out
        sync_each_mb = cfg.pp == 1
        syncs = m if sync_each_mb else 1
        sync_window = backward_mb_s * syncs
        rest = max(0.0, step_compute_s - sync_window)
        half = cfg.compression in ("fp16", "bf16")  # FSDP2's reduce_dtype
        if cfg.zero == 2:
            gathers = m if sync_each_mb else 1
            gather_bytes, gather_calls = grads * gathers, units * gathers
        else:
            # Each micro-batch gathers every unit for forward and all but the root again for backward.
            gather_bytes = m * (2 * grads - 4 * self.root)
            gather_calls = m * (2 * units - (self.root > 0))
        out = [
            self._collective(hw, "dp", "all_gather", f"parameters (ZeRO-{cfg.zero})", gather_calls,
                             gather_bytes / gather_calls, shard, hidden_by=rest),
            self._collective(hw, "dp", "reduce_scatter", "gradients" + (f" ({cfg.compression})" if half else ""),
                             units * syncs, grads / units / (2 if half else 1), shard, hidden_by=sync_window),
        ]
        if cfg.hsdp:
            # HSDP: each reduce-scattered shard is then all-reduced across the dp_replicate groups.
            out.append(self._collective(hw, "dp", "all_reduce", "gradients (HSDP, across replica groups)",
                                        units * syncs, grads / units / shard / (2 if half else 1),
                                        cfg.dp_replicate, hidden_by=sync_window))
        return out

    def _compressed_sync(self, hw: Hardware, grads: int, hidden_by: float) -> list[Collective]:
        """DDP's gradient sync under a compression hook (zero 0/1, tp = 1; Config refuses the rest)."""
        cfg = self.cfg
        buckets = _ddp_buckets(grads)
        if cfg.compression in ("fp16", "bf16"):
            return [self._collective(hw, "dp", "all_reduce", f"gradients ({cfg.compression})", len(buckets),
                                     grads / 2 / len(buckets), self.sync, hidden_by=hidden_by)]
        if cfg.compression == "powersgd":
            sent = sum(_powersgd_elements(shape, cfg.powersgd_rank) for shape in self.shapes())
            return [self._collective(hw, "dp", "all_reduce", f"gradients (PowerSGD rank {cfg.powersgd_rank})",
                                     3 * len(buckets), 4 * sent / (3 * len(buckets)), self.sync, hidden_by=hidden_by)]
        payload = sum(quantized_bucket_bytes(b // 4, self.sync, cfg.compression) for b in buckets)
        # Two phases per bucket, each moving the whole quantised bucket: all_to_all, then all_gather.
        return [self._collective(hw, "dp", "all_to_all", f"gradients ({cfg.compression}, phase 1)", len(buckets),
                                 payload / len(buckets), self.sync, hidden_by=hidden_by),
                self._collective(hw, "dp", "all_gather", f"gradients ({cfg.compression}, phase 2)", len(buckets),
                                 payload / len(buckets), self.sync, hidden_by=hidden_by)]

    def shapes(self) -> list[tuple[int, ...]]:
        """Parameter shapes of this stage (tp = 1): what PowerSGD compresses, matrix by matrix."""
        m = self.cfg.model
        kv = m.kv_heads * m.head_dim
        block = [(m.dim, m.dim), (kv, m.dim), (kv, m.dim), (m.dim, m.dim), (m.hidden_dim, m.dim),
                 (m.dim, m.hidden_dim), (m.hidden_dim, m.dim), (m.dim,), (m.dim,)]
        shapes = block * len(self.layers)
        if self.first:
            shapes.append((m.vocab_size, m.dim))
        if self.last:
            shapes += [(m.dim,), (m.vocab_size, m.dim)]
        return shapes

    def _cp_comm(self, hw: Hardware, peak: float) -> list[Collective]:
        """Context parallel's ring (engine/parallel/context.py), per block and micro-batch: forward passes this rank's
        keys and values on cp-1 times, backward passes them again and their fp32 gradients cp times (the last hop
        brings them home); a recomputed block's forward passes them once more. Each pass is one send (and one
        recv) of (2, micro-batch, kv_heads/tp, seq/cp, head_dim), overlapped with the attention of the block held."""
        cfg, m = self.cfg, self.cfg.model
        if cfg.cp == 1:
            return []
        mb, layers, cp = cfg.micro_batches, len(self.layers), cfg.cp
        kv_elements = 2 * self.tokens * (m.kv_heads // cfg.tp) * m.head_dim
        # What attention computes per step on this rank (q·kᵀ and p·v over the whole sequence, fwd + bwd).
        hidden = 3 * 4 * self.tokens * cfg.seq_len * m.n_heads * m.head_dim / cfg.tp * layers * mb / peak
        kv_calls = mb * (2 * layers + self.checkpointed) * (cp - 1)
        return [self._collective(hw, "cp", "send_recv", "keys and values (ring)", kv_calls,
                                 self.act_bytes * kv_elements, cp, hidden_by=hidden),
                self._collective(hw, "cp", "send_recv", "key and value gradients (ring)", mb * layers * cp,
                                 4 * kv_elements, cp, hidden_by=hidden)]

    def _tp_comm(self, hw: Hardware) -> list[Collective]:
        cfg, m = self.cfg, self.cfg.model
        if cfg.tp == 1:
            return []
        mb, a, tp = cfg.micro_batches, self.act_bytes, cfg.tp
        act = self.tokens * m.dim
        # Per block and micro-batch, sequence parallel gathers the fp32 norm outputs before attention and MLP and
        # reduce-scatters their a-byte outputs; backward mirrors that; recomputation repeats the forward half.
        forwards = len(self.layers) + self.checkpointed
        gather_bytes = mb * 2 * (forwards * 4 + len(self.layers) * a) * act
        scatter_bytes = mb * 2 * (forwards * a + len(self.layers) * 4) * act
        gather_calls = scatter_calls = mb * 2 * (forwards + len(self.layers))
        # A MoE FFN, replicated over tp, slices its output back to the rank's shard (no reduce-scatter) and hands
        # back its input's gradient whole on every rank (a slice too): its gathers stay, its scatters go.
        moe_forwards = len(self.moe_layers) + sum(self._is_checkpointed(i) for i in self.moe_layers)
        scatter_bytes -= mb * (moe_forwards * a + len(self.moe_layers) * 4) * act
        scatter_calls -= mb * (moe_forwards + len(self.moe_layers))
        # The vocab-parallel embedding reduce-scatters its output; the head gathers its input (and backward
        # mirrors both).
        edges = self.first + self.last
        gather_bytes += mb * edges * 4 * act
        scatter_bytes += mb * edges * 4 * act
        out = [
            self._collective(hw, "tp", "all_gather", "sequence-parallel activations", gather_calls + mb * edges,
                             gather_bytes / (gather_calls + mb * edges), tp),
            self._collective(hw, "tp", "reduce_scatter", "sequence-parallel activations", scatter_calls + mb * edges,
                             scatter_bytes / (scatter_calls + mb * edges), tp),
            self._collective(hw, "tp", "all_reduce", "norm weight gradients", mb,
                             4 * m.dim * (2 * len(self.layers) + self.last), tp),
        ]
        if self.last:
            out.append(self._collective(hw, "tp", "all_gather", "logits for the loss", mb,
                                        self.tokens * m.vocab_size * a, tp))
        return out

    def _pp_comm(self, hw: Hardware) -> list[Collective]:
        cfg = self.cfg
        if cfg.pp == 1:
            return []
        # Forward sends the fp32 residual stream on (sequence-sharded under tp); backward sends its gradient back.
        # Each boundary is crossed both ways: this rank sends as many activations and gradients as it receives.
        return [self._collective(hw, "pp", "send_recv", "activations and their gradients",
                                 self.boundaries * cfg.micro_batches, self._residual(), 2)]

    def _ep_comm(self, hw: Hardware) -> list[Collective]:
        """Expert parallel: per MoE layer and micro-batch, the router counts go out by all-to-all, then the tokens
        and their outputs (forward), their gradients (backward), and the forward's again when recomputed; the
        expert slices' gradient sync over edp."""
        cfg, m = self.cfg, self.cfg.model
        if cfg.ep == 1 or not self.moe_layers:
            return []
        mb, a, kept = cfg.micro_batches, self.act_bytes, self.assignments()
        forwards = len(self.moe_layers) + sum(self._is_checkpointed(i) for i in self.moe_layers)
        # Tokens go out in fp32 (the normed residual), outputs come back in the compute precision; backward sends
        # the gradients of both the same way.
        calls = mb * (2 * forwards + 2 * len(self.moe_layers))
        payload = mb * (forwards * kept * m.dim * (4 + a) + len(self.moe_layers) * kept * m.dim * (4 + a))
        out = [self._collective(hw, "ep", "all_to_all", "routed tokens and their gradients", calls, payload / calls,
                                cfg.ep),
               self._collective(hw, "ep", "all_to_all", "router counts per expert", mb * forwards,
                                8 * m.n_experts, cfg.ep)]
        edp = cfg.dp // cfg.ep
        if edp > 1:
            per_layer = 4 * self.expert_params // len(self.moe_layers)
            if cfg.zero == 0:
                out.append(self._collective(hw, "edp", "all_reduce", "expert gradients (per micro-batch)",
                                            3 * len(self.moe_layers) * mb, per_layer / 3, edp))
            else:
                out.append(self._collective(hw, "edp", "reduce_scatter", "expert gradients",
                                            len(self.moe_layers) * mb, per_layer, edp))
        return out

# --- compression and offload (Config.compression, Config.offload) ---------------------------------------------

QUANT_BLOCK = {"int8": 256, "1bit": 2048}
"""Values per scale, as workbench.engine.parallel.quantize uses them (kept here: no torch import)."""


def _ddp_buckets(grad_bytes: int) -> list[int]:
    """DDP's bucket sizes in bytes: a first bucket of 1 MiB, then 25 MiB ones (parameter boundaries ignored)."""
    first = min(grad_bytes, DDP_FIRST_BUCKET_BYTES)
    rest = grad_bytes - first
    return [first] + [min(DDP_BUCKET_BYTES, rest - i) for i in range(0, rest, DDP_BUCKET_BYTES)]


def quantized_bucket_bytes(values: int, dp: int, scheme: str) -> int:
    """Bytes of one bucket of `values` fp32 gradients quantised whole: padded to dp·block values, 1 byte (int8)
    or 1 bit (1bit) per value plus a 4-byte scale per block."""
    block = QUANT_BLOCK[scheme]
    padded = -(-values // (dp * block)) * dp * block
    return (padded if scheme == "int8" else padded // 8) + 4 * (padded // block)


def _powersgd_elements(shape: tuple[int, ...], rank: int) -> int:
    """fp32 values PowerSGD all-reduces for one parameter: P (m·r) and Q (n·r) for a matrix worth compressing
    (torch's min_compression_rate 2: m·n ≥ 2·(m + n)·r), else the whole tensor."""
    if len(shape) == 2:
        rows, cols = shape
        r = min(rank, rows, cols)
        if rows * cols >= 2 * (rows + cols) * r:
            return (rows + cols) * r
    return math.prod(shape)


def _offloaded(memory: Memory, cfg: Config, params: int) -> Memory:
    """Memory with Config.offload: what leaves the device and what the host holds instead."""
    if cfg.zero >= 2:
        host = memory.parameters + memory.gradients + memory.optimizer
        return replace(memory, parameters=0, gradients=0, optimizer=0, host=host)
    share = _ceil_div(params, cfg.dp if cfg.zero == 1 else 1)
    return replace(memory, optimizer=0, host=memory.optimizer + 2 * share)


def grad_sync_bytes_per_step(cfg: Config, hardware: str | Hardware = "h100") -> int:
    """Bytes one rank sends per step for the data-parallel gradient sync: what `StepMetrics.grad_sync_bytes`
    measures (the dp collectives' wire bytes, parameter gathers and ZeRO-1's broadcast excluded)."""
    est = estimate(cfg, hardware)
    return sum(c.wire_bytes for c in est.comm if c.axis == "dp" and c.what.startswith("gradients"))
