"""Plan a layout for a large run: every valid layout on N GPUs, ranked by the estimator's predicted step time.

    print(wb.plan("8b", hardware="h100", gpus=64, global_batch=256, seq_len=4096))

Pure arithmetic (no torch import): each candidate is made with `Config(...)`, so every refusal is Config's own
(named field and fix), then `wb.estimate` predicts its per-rank memory and step time. A layout is ranked only
if its most loaded rank fits the device's memory; the rest are listed with why they were refused.

The search space is a list of axes, enumerated in order; each axis lists its values given the choices already
made. Adding an axis (expert parallel: `Axis("ep", lambda c, p: divisors(c["dp"]))`) is one entry in `AXES`.
Context parallel (cp) and HSDP (dp_replicate) are axes too, searched where they can pay: cp while each rank keeps
`min_cp_tokens` of a sequence, HSDP with one shard group per node.

`scale_layout` carries a planned layout onto the local pool (fewer ranks, the notebook's model): the degrees
shrink dp first, then pp, then cp, then tp (tp is what a layout is most about and costs the least to keep), and every
other change it needs is said.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from workbench.config import FP8, Config, ConfigError, ModelConfig, divisors
from workbench.estimate import Estimate, Memory
from workbench.estimate.predict import price, shaped
from workbench.estimate.options import NO_FEATURES, Features
from workbench.estimate.stage import traced_precision
from workbench.hardware import Hardware, profile, si
from workbench.model_profile import ModelProfile
from workbench.schedules import MULTI_STAGE, SPLIT_BACKWARD, virtual_stages


@dataclass(frozen=True)
class PlanInputs:
    """What is fixed while the layout varies."""

    model: ModelConfig
    gpus: int
    global_batch: int
    seq_len: int
    precision: str
    max_micro_batches: int
    gpus_per_node: int = 8
    """GPUs per machine: HSDP is searched with one shard group per node (NVLink), replicated across nodes."""
    min_cp_tokens: int = 2048
    """Context parallel is searched while each rank keeps at least this many tokens of a sequence."""


@dataclass(frozen=True)
class Axis:
    """One dimension of the search: a Config field and its values, given the earlier axes' choices."""

    name: str
    values: Callable[[dict[str, Any], PlanInputs], Iterable[Any]]


def _micro_batches(c: dict[str, Any], p: PlanInputs) -> list[int]:
    # Powers of two: gradient accumulation steps without a pipeline, pipeline micro-batches (≥ pp) with one.
    low = c["pp"] if c["pp"] > 1 else 1
    values = [low * 2**i for i in range(8) if low * 2**i <= max(low, p.max_micro_batches)]
    return [m for m in values if p.global_batch % (c["dp"] * m) == 0] or [low]


def _expert_parallel(c: dict[str, Any], p: PlanInputs) -> list[int]:
    # Experts split over a subset of the dp ranks (ep divides dp); a dense model has none to split.
    experts = p.model.n_experts
    return [d for d in divisors(c["dp"]) if experts % d == 0] if experts else [1]


def _context_parallel(c: dict[str, Any], p: PlanInputs) -> list[int]:
    # Divisors of the ranks left that keep at least min_cp_tokens per rank: below that the K/V exchange in every
    # attention costs more than the activations it saves. Config refuses the rest (the 2·cp·tp chunks, MoE).
    left = p.gpus // (c["tp"] * c["pp"])
    return [d for d in divisors(left) if d == 1 or p.seq_len // d >= p.min_cp_tokens]


def _hsdp(c: dict[str, Any], p: PlanInputs) -> list[int]:
    # FSDP2 over all dp ranks (1), or HSDP with one shard group per node: a node holds gpus_per_node / (cp·tp) dp
    # ranks (tp and cp are inside it, mesh order), whose gathers and reduce-scatters then stay on NVLink.
    if c["zero"] < 2:
        return [1]
    per_node, inner = p.gpus_per_node, c["cp"] * c["tp"]
    shard = per_node // inner if per_node % inner == 0 else 0
    return [1] + ([c["dp"] // shard] if shard > 1 and c["dp"] % shard == 0 and c["dp"] > shard else [])


AXES: tuple[Axis, ...] = (
    Axis("tp", lambda c, p: divisors(p.gpus)),
    Axis("pp", lambda c, p: divisors(p.gpus // c["tp"])),
    Axis("cp", _context_parallel),
    Axis("dp", lambda c, p: [p.gpus // (c["tp"] * c["pp"] * c["cp"])]),
    Axis("ep", _expert_parallel),
    Axis("schedule", lambda c, p: ["gpipe", "1f1b", "interleaved_1f1b"] if c["pp"] > 1 else ["1f1b"]),
    Axis("micro_batches", _micro_batches),
    # The cp ranks average gradients with the dp ranks: ZeRO shards over dp·cp.
    Axis("zero", lambda c, p: [0, 1, 2, 3] if c["dp"] * c["cp"] > 1 else [0]),
    Axis("dp_replicate", _hsdp),
    # FSDP2 mixed precision (torchtitan's bf16) where it applies: bf16 (or fp8 beside bf16) under ZeRO 2/3.
    Axis("mixed_precision", lambda c, p: ["autocast", "fsdp"] if c["zero"] >= 2 and p.precision in ("bf16", *FP8)
         else ["autocast"]),
    Axis("activation_checkpointing", lambda c, p: ["none", "selective", "op", "full"]),
)
"""The layout axes, in the order they are chosen; values of a later axis may depend on earlier choices."""


def layouts(inputs: PlanInputs, axes: tuple[Axis, ...] = AXES) -> Iterable[dict[str, Any]]:
    """Every combination of the axes' values, as Config keyword arguments."""
    def walk(i: int, chosen: dict[str, Any]) -> Iterable[dict[str, Any]]:
        if i == len(axes):
            yield dict(chosen)
            return
        for value in axes[i].values(chosen, inputs):
            chosen[axes[i].name] = value
            yield from walk(i + 1, chosen)
        chosen.pop(axes[i].name, None)

    return walk(0, {})


@dataclass(frozen=True)
class Candidate:
    """One layout: its Config and estimate when valid, else why Config refused it."""

    choice: dict[str, Any]
    config: Config | None
    estimate: Estimate | None
    """The whole estimate of a layout that fits; None for one refused (its time is never priced)."""
    refused: str = ""
    """"" when it fits; "invalid: <ConfigError>" or "does not fit: <memory>"."""
    memory: Memory | None = None
    """The most loaded rank's memory (the estimate's): why a layout that does not fit is refused; None: invalid."""

    @property
    def fits(self) -> bool:
        return not self.refused

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s if self.estimate else float("inf")


@dataclass(frozen=True)
class Plan:
    """Valid layouts that fit, fastest predicted first, and the refused ones with their reasons."""

    inputs: PlanInputs
    hardware: Hardware
    efficiency: float | None
    """The stated MFU assumption every estimate ran at; None: the profile's own model (GPU kernel by kernel)."""
    ranked: tuple[Candidate, ...]
    refused: tuple[Candidate, ...]
    features: Features = NO_FEATURES
    model_params: int = 0
    """Parameter elements of the whole model as the estimates count them (a foreign model's: its trace's); 0: no
    layout was valid."""

    @property
    def basis(self) -> str:
        """How the times were predicted, in words: the stated efficiency, or the profile's own model."""
        if self.efficiency is not None:
            return f"{self.efficiency:.0%} of {self.hardware.name} peak (a stated efficiency)"
        return f"the {self.hardware.kind} kernel model of {self.hardware.name}" + (
            f", modelling {self.features.describe()}" if self.features != NO_FEATURES else "")

    @property
    def best(self) -> Candidate:
        if not self.ranked:
            raise ValueError(f"no layout fits: {self.refusal_summary()}")
        return self.ranked[0]

    def top(self, n: int = 10) -> tuple[Candidate, ...]:
        return self.ranked[:n]

    def refusal_summary(self) -> dict[str, int]:
        """How many layouts were refused, by reason: "does not fit" or the Config field that refused them."""
        counts: Counter[str] = Counter()
        for c in self.refused:
            kind, _, detail = c.refused.partition(": ")
            counts["does not fit" if kind == "does not fit" else f"invalid ({detail.split(':')[0]})"] += 1
        return dict(counts.most_common())

    def rows(self, n: int = 10) -> list[dict[str, str]]:
        """The top `n` layouts as display strings (what the table and the dashboard show; they compute nothing)."""
        rows = []
        for i, c in enumerate(self.top(n), 1):
            e, cfg = c.estimate, c.config
            rows.append({"#": str(i), "layout": cfg.layout, "dp": str(cfg.dp), "cp": str(cfg.cp), "tp": str(cfg.tp),
                         "pp": str(cfg.pp), "zero": str(cfg.zero) + (f" hsdp{cfg.dp_replicate}" if cfg.hsdp else ""),
                         "schedule": cfg.schedule if cfg.pp > 1 else "-",
                         "micro": str(cfg.micro_batches), "recompute": cfg.activation_checkpointing,
                         "bf16": cfg.mixed_precision if cfg.precision in ("bf16", *FP8) else "-",
                         "step": f"{e.step_time_s * 1e3:,.0f} ms",
                         "tokens/s/GPU": f"{e.tokens_per_s / cfg.world_size:,.0f}", "MFU": f"{e.mfu:.0%}",
                         "memory/rank": si(e.memory.total, "B"),
                         "headroom": "tight" if e.tight else si(e.headroom, "B")})
        return rows

    def table(self, n: int = 10) -> str:
        p = self.inputs
        # A foreign model's count is its trace's (any estimate's), not its source's.
        params = self.model_params or getattr(p.model, "num_params", 0)
        head = (f"plan  {params / 1e9:.2f} B-parameter model on {p.gpus} × {self.hardware.name}, global "
                f"batch {p.global_batch} × {p.seq_len} tokens, {p.precision}; predicted by {self.basis}")
        rows = self.rows(n)
        lines = [head]
        if rows:
            widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in rows[0]}
            lines.append("  ".join(k.rjust(w) for k, w in widths.items()))
            lines += ["  ".join(r[k].rjust(w) for k, w in widths.items()) for r in rows]
        else:
            lines.append("no layout fits")
        total = len(self.ranked) + len(self.refused)
        tight = sum(c.estimate.tight for c in self.ranked)
        lines.append(f"{len(self.ranked)} of {total} layouts fit"
                     + (f" ({tight} tight: only as the allocator gives back its cache, ranked last)" if tight else "")
                     + "; refused: " + ", ".join(f"{k} {v}" for k, v in self.refusal_summary().items()))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(self.table())


def plan(model: ModelConfig | str, hardware: str | Hardware = "h100", gpus: int = 8, global_batch: int = 64, *,
         seq_len: int = 2048, precision: str = "bf16", efficiency: float | None = None, max_micro_batches: int = 32,
         gpus_per_node: int = 8, min_cp_tokens: int = 2048, base: Config | None = None,
         features: Features = NO_FEATURES,
         traced: ModelProfile | Callable[[str], ModelProfile] | None = None) -> Plan:
    """Rank every valid layout of `model` on `gpus` devices by predicted step time, with memory fit per rank.

    global_batch: sequences per optimizer step (Config.batch_size); seq_len, precision: fixed for every layout.
    efficiency: None for the profile's own model, or a stated MFU assumption (see `wb.estimate`).
    gpus_per_node: HSDP is tried with one shard group per node; min_cp_tokens: context parallel is tried while
    every rank keeps at least this many tokens of a sequence.
    base: other Config fields (lr, seed, stages_per_rank, ...) every candidate keeps.
    features: published-run settings the engine lacks, modelled for every layout (`wb.estimate`'s).
    traced: the model as traced at seq_len (`workbench.tracing`), read by every candidate's estimate: one profile,
    or a function from a traced precision (`estimate.stage.traced_precision`: candidates under FSDP2's mixed
    precision need their own) to the profile.
    A layout is refused only when it is invalid (Config's own refusal) or does not fit by the estimate's
    device total (the caching allocator's reserve at the step's peak, the CUDA context and NCCL).
    """
    model = ModelConfig.preset(model) if isinstance(model, str) else model
    hw = profile(hardware) if isinstance(hardware, str) else hardware
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus: must be a positive integer, got {gpus!r}")
    for name, value in (("gpus_per_node", gpus_per_node), ("min_cp_tokens", min_cp_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    inputs = PlanInputs(model, gpus, global_batch, seq_len, precision, max_micro_batches, gpus_per_node, min_cp_tokens)
    template = base or Config()
    fixed = {"model": model, "batch_size": global_batch, "seq_len": seq_len, "precision": precision}
    ranked, refused, model_params = [], [], 0
    for choice in layouts(inputs):
        try:
            cfg = dataclasses.replace(template, **fixed, **choice)  # Config's own validation decides
        except ConfigError as e:
            refused.append(Candidate(choice, None, None, f"invalid: {e}"))
            continue
        try:
            model_profile = traced(traced_precision(cfg)) if callable(traced) else traced
            # Memory first: most layouts of a large search do not fit, and are refused before their time is priced.
            fitted = shaped(cfg, hw, features=features, traced=model_profile)
            model_params = model_params or fitted.model_params
            if not fitted.fits:
                refused.append(Candidate(choice, cfg, None, f"does not fit: {si(fitted.memory.total, 'B')} per rank "
                                                            f"of {si(hw.memory_bytes, 'B')}", fitted.memory))
                continue
            est = price(fitted, efficiency)
        except ValueError as e:  # what only the trace knows: a module of one's own says its depth once built, and
            # one may fail in a precision (ConfigError, a ValueError), which refuses the layouts that train in it
            if isinstance(model, ModelConfig):
                raise  # the built-in model's Config knows its shape: an error here is the estimator's own
            refused.append(Candidate(choice, None, None, f"invalid: {e}"))
            continue
        ranked.append(Candidate(choice, cfg, est, est.memory))
    # A layout that fits only as the allocator gives back its cache (`Estimate.tight`) after every one with room.
    ranked.sort(key=lambda c: (c.estimate.tight, c.step_time_s, c.estimate.memory.total))
    return Plan(inputs, hw, efficiency, tuple(ranked), tuple(refused), features, model_params)


# -- onto the local pool --------------------------------------------------------------------------------------
LAYOUT_FIELDS = ("dp", "tp", "pp", "ep", "cp", "schedule", "micro_batches", "stages_per_rank", "zero", "dp_replicate",
                 "activation_checkpointing", "precision", "mixed_precision")
"""What a planned layout carries to the local pool; the model, batch, sequence and optimizer stay the local ones."""


@dataclass(frozen=True)
class Scaled:
    """A planned layout made to run on the local pool, and every change that took."""

    config: Config
    changes: tuple[str, ...]

    def describe(self) -> str:
        """One line for the UI, e.g. "dp 8→1, pp 4→2, tp 2 kept; zero 3→0 (no dp ranks to shard across)"."""
        return "; ".join(self.changes)


def scale_layout(layout: Config, world: int, onto: Config) -> Scaled:
    """`layout`'s parallel settings on `world` local ranks, for `onto`'s model, batch and training settings.

    Degrees: tp is kept as far as `world` and the local model allow, then cp (a dense model), then pp, and dp takes
    the ranks left (so dp shrinks first); ep as far as the new dp and the local model's experts allow, HSDP's
    replicas as far as the new dp does. Then whatever the new degrees need: ZeRO off without dp ranks, enough
    micro-batches for the schedule, a batch the dp·micro-batch split divides, a sequence tp (and cp's 2·cp
    chunks) divide. Refuses (ConfigError) only when no layout of those axes fits the local world.
    """
    model = onto.model
    chunks = lambda pp, sched, spr: pp * virtual_stages(sched, pp, spr)  # noqa: E731
    tp = max(d for d in divisors(world) if d <= layout.tp and model.n_heads % d == 0 and model.kv_heads % d == 0
             and model.hidden_dim % d == 0)
    # A mixture of experts routes whole sequences: it takes no context parallel.
    cp = max(d for d in divisors(world // tp) if d <= layout.cp and (d == 1 or not model.n_experts))
    schedule, spr = layout.schedule, layout.stages_per_rank
    pp = max(d for d in divisors(world // (tp * cp))
             if d <= layout.pp and model.n_layers % chunks(d, schedule, spr) == 0)
    dp = world // (tp * cp * pp)
    degrees = [("dp", layout.dp, dp), ("pp", layout.pp, pp), ("tp", layout.tp, tp)]
    if layout.cp > 1 or cp > 1:
        degrees.insert(1, ("cp", layout.cp, cp))
    changes = [f"{axis} {old}→{new}" if old != new else f"{axis} {old} kept" for axis, old, new in degrees]
    if cp < layout.cp and model.n_experts:
        changes[1] += " (a mixture of experts routes whole sequences)"
    experts = model.n_experts
    ep = max(d for d in divisors(dp) if d <= layout.ep and (experts % d == 0 if experts else d == 1))
    if ep != layout.ep:
        why = "the local model is dense" if not experts else f"ep divides dp={dp} and the {experts} experts"
        changes.append(f"ep {layout.ep}→{ep} ({why})")
    zero, micro = layout.zero, layout.micro_batches
    mixed = layout.mixed_precision
    if zero and dp * cp == 1:
        changes.append(f"zero {zero}→0 (no dp ranks to shard across)")
        zero = 0
    if zero == 1 and tp > 1:
        changes.append("zero 1→2 (ZeroRedundancyOptimizer cannot update tensor-parallel parameters)")
        zero = 2
    if zero == 1 and ep > 1:
        changes.append("zero 1→2 (ZeroRedundancyOptimizer cannot hold expert slices that differ across ep ranks)")
        zero = 2
    split = pp > 1 and schedule in SPLIT_BACKWARD and dp * cp > 1
    if split and zero in (1, 3):
        why = "its weight-gradient halves need the blocks gathered" if zero == 3 else "replicate() holds DTensors"
        changes.append(f"zero {zero}→2 ({schedule} with data parallel: {why})")
        zero = 2
    if split and zero == 0 and ep > 1:
        changes.append(f"zero 0→2 ({schedule}: replicate() cannot keep expert slices apart)")
        zero = 2
    replicate = 1
    if layout.hsdp:
        # Replica groups as far as the new dp keeps at least two ranks in each shard group (and zero stays 2/3).
        fits = [r for r in divisors(dp) if r <= layout.dp_replicate and r < dp] if zero >= 2 else [1]
        replicate = max(fits or [1])
        if replicate != layout.dp_replicate:
            why = (f"zero={zero} replicates everything" if zero < 2
                   else f"dp={dp}: every replica group needs ≥ 2 ranks to shard over")
            changes.append(f"dp_replicate {layout.dp_replicate}→{replicate} ({why})")
    least = 2 * pp if schedule == "dualpipev" else pp
    if pp > 1 and micro < least:
        changes.append(f"micro_batches {micro}→{least} (the schedule needs ≥ {'2·pp' if least > pp else 'pp'})")
        micro = least
    if pp > 1 and schedule in MULTI_STAGE and micro % pp:
        new = -(-micro // pp) * pp
        changes.append(f"micro_batches {micro}→{new} (a multiple of pp for {schedule})")
        micro = new
    batch = onto.batch_size
    if batch % (dp * micro):
        new = -(-batch // (dp * micro)) * dp * micro
        changes.append(f"batch_size {batch}→{new} (divisible by dp·micro_batches)")
        batch = new
    seq = onto.seq_len
    if tp > 1 and seq % tp and cp == 1:
        new = seq - seq % tp
        changes.append(f"seq_len {seq}→{new} (a multiple of tp)")
        seq = new
    if cp > 1 and seq % (2 * cp * tp):
        # cp cuts each sequence into 2·cp balanced chunks, each split further by tp's sequence parallel.
        step = 2 * cp * tp
        new = max(step, seq - seq % step)
        changes.append(f"seq_len {seq}→{new} (a multiple of 2·cp·tp = {step})")
        seq = new
    settings = {f: getattr(layout, f) for f in LAYOUT_FIELDS}
    if mixed == "fsdp" and zero < 2:
        changes.append("mixed_precision fsdp→autocast (FSDP2's mixed precision needs zero 2 or 3)")
        mixed = "autocast"
    settings.update(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, zero=zero, dp_replicate=replicate, micro_batches=micro,
                    mixed_precision=mixed)
    cfg = dataclasses.replace(onto, batch_size=batch, seq_len=seq, **settings)
    return Scaled(cfg, tuple(changes))
