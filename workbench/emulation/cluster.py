"""What cluster a Workbench stands for, and the arithmetic that turns it into paced collectives. Pure, no torch.

    bench = wb.Workbench(2, cluster=wb.Cluster("h100-25gbe", nodes=2))   # 2 emulated nodes of 1 H100, 25 GbE

A `Cluster` names a topology (a `workbench.links` preset or a `Topology`) and how its time relates to this
machine's: the **time dilation** d. A GPU computes a step far faster than a CPU core; emulated communication is
stretched by the same factor, so that it keeps the target's ratio to computation:

    d = a rank's measured compute time of a step / the target GPU's compute time of the same step

the largest over the ranks, measured on every step by default (the session's first two steps run unpaced, to
measure it), or fixed. The target's compute time is the estimator's (`workbench.emulation.predict.target_compute_s`):
its kernel model of the GPU, the same figure its prediction for the cluster uses, so an emulated step and a
predicted one rest on one model of compute. The notebook computes it per pipeline stage when a layout is applied
and sends the figures to the ranks (`workbench.emulation.rank.set_targets`). Every collective then completes no earlier than d × its time on the target
(`links.collective_time`); each step records the dilation it was paced with (`StepMetrics.dilation`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from workbench import hardware, links
from workbench.links import Line, Topology

if TYPE_CHECKING:
    from workbench.config import Config

REAL_LATENCY_S = 1e-3
REAL_BUS_BANDWIDTH = 0.25e9
"""Before it is measured (`fit_real`), an upper bound of this machine's own transfer time, subtracted from a
collective's real end to find when its last peer arrived: gloo between two ranks on one 2-core machine reaches
0.28-0.9 GB/s of bus bandwidth by kind and 0.9 ms for a 1 KiB all-reduce (docs FACTS, measured for this project).
Too high an estimate only forgets up to the difference when a peer is late; too low adds the shortfall to every
collective."""

REAL_MARGIN = 1.5
"""The measured real times are taken this much higher: a loaded machine is slower than its calibration."""

RealLinks = dict[str, tuple[float, float]]
"""kind -> (latency s, seconds per byte of bus traffic) of this machine's own transport."""

DEFAULT_REAL: RealLinks = {kind: (REAL_LATENCY_S, 1 / REAL_BUS_BANDWIDTH) for kind in links.KINDS}


def fit_real(times: dict[tuple[str, int], float], small: int, large: int, n: int,
             margin: float = REAL_MARGIN) -> RealLinks:
    """This machine's own transport per kind, from each kind timed unpaced at two sizes on `n` ranks
    (`collectives.time_kinds`): the line through the two points, in bus bytes so it scales to other group sizes,
    taken `margin` higher. Kinds not timed keep the default."""
    real = dict(DEFAULT_REAL)
    for kind in links.KINDS:
        timed = "send" if kind == "recv" else kind
        if (timed, small) not in times or (timed, large) not in times:
            continue
        t_small, t_large = times[timed, small], times[timed, large]
        factor = links.bus_factor(timed, n)
        per_byte = max(0.0, (t_large - t_small) / (large - small))
        latency = max(0.0, t_small - per_byte * small)
        real[kind] = (margin * latency, margin * per_byte / factor if factor else 0.0)
    return real


@dataclass(frozen=True)
class Cluster:
    """A cluster to emulate: `target` (a preset name of `workbench.links`, or a Topology), its shape, and the
    time dilation (None: measured every step; a number: fixed).

    nodes / gpus_per_node: how the Workbench's ranks split into nodes (ranks fill nodes in mesh order); give
    one, the other follows from the world size; neither: the preset's GPUs per node, or fewer if the world is
    smaller. efficiency: None to time the target's compute by the estimator's kernel model of its GPU (GEMM
    tiles and waves, attention, memory-bound kernels at HBM rate, the optimizer); a number to state an MFU
    instead (the step's FLOPs at that fraction of the GPU's peak), as `wb.estimate(efficiency=...)` does.
    """

    target: str | Topology = "h100-ib"
    nodes: int | None = None
    gpus_per_node: int | None = None
    dilation: float | None = None
    efficiency: float | None = None
    topology: Topology | None = field(default=None, compare=False)
    """Filled by `for_world`: the concrete topology the ranks stand for."""

    def __post_init__(self) -> None:
        if isinstance(self.target, str):
            links.preset(self.target)  # unknown names fail now, with the list
        elif not isinstance(self.target, Topology):
            raise ValueError(f"Cluster target: a preset name ({', '.join(links.presets())}) or a links.Topology, "
                             f"got {type(self.target).__name__}")
        if self.dilation is not None and not self.dilation > 0:
            raise ValueError(f"Cluster dilation: must be positive (or None to measure it), got {self.dilation}")
        if self.efficiency is not None and not 0 < self.efficiency <= 1:
            raise ValueError(f"Cluster efficiency: the target's MFU, in (0, 1], got {self.efficiency}")
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"Cluster {name}: a positive integer, got {value!r}")

    @property
    def gpu(self) -> hardware.Hardware:
        return hardware.profile(self._base().gpu)

    def _base(self) -> Topology:
        return self.target if isinstance(self.target, Topology) else links.preset(self.target)

    def for_world(self, world_size: int) -> "Cluster":
        """This cluster shaped for `world_size` ranks; refuses a shape that does not hold them exactly."""
        base = self._base()
        nodes, per_node = self.nodes, self.gpus_per_node
        if isinstance(self.target, Topology) and nodes is None and per_node is None:
            nodes, per_node = base.nodes, base.gpus_per_node
        elif nodes is None and per_node is None:
            per_node = min(base.gpus_per_node, world_size)
        if per_node is None:
            per_node = world_size // nodes if world_size % nodes == 0 else 0
        if nodes is None:
            nodes = world_size // per_node if world_size % per_node == 0 else 0
        if nodes * per_node != world_size:
            raise ValueError(f"Cluster: {world_size} ranks do not fill {self.nodes or '?'} node(s) of "
                             f"{self.gpus_per_node or '?'} GPU(s). Fix: choose nodes or gpus_per_node dividing "
                             f"{world_size}")
        return replace(self, nodes=nodes, gpus_per_node=per_node, topology=base.with_nodes(nodes, per_node))

    def describe(self) -> str:
        topo = self.topology or self._base()
        return f"{topo.name}: {topo.describe()}"

    # -- crossing to the ranks ----------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> "Cluster":
        raw = json.loads(text)

        def topology(d: dict[str, Any] | None) -> Topology | None:
            if d is None:
                return None
            return Topology(**{**d, "intra": links.Link(**d["intra"]), "network": links.Link(**d["network"])})

        target = raw["target"] if isinstance(raw["target"], str) else topology(raw["target"])
        return Cluster(**{**raw, "target": target, "topology": topology(raw["topology"])})


def emulation_for(cluster: "Cluster | str | None", world_size: int, telemetry: bool) -> "Cluster | None":
    """A Workbench's `cluster=` argument checked and shaped for its ranks (None stays None)."""
    if cluster is None:
        return None
    if isinstance(cluster, str):
        cluster = Cluster(cluster)
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster: a wb.Cluster(...) or a preset name ({', '.join(links.presets())}), "
                         f"got {type(cluster).__name__}")
    if cluster.dilation is None and not telemetry:
        raise ValueError("cluster: a measured time dilation needs telemetry=True (it is read from each step's "
                         "compute spans). Fix: telemetry=True, or wb.Cluster(..., dilation=<a number>)")
    return cluster.for_world(world_size)


def status_line(cluster: Cluster | None, dilation: float | None = None) -> str:
    """What a person needs to know about the links, in one line: off, or what is emulated and at what dilation."""
    if cluster is None:
        return "links: this machine's own (loopback); no cluster emulated"
    if dilation is None:
        how = ("time dilation: measured from the first steps" if cluster.dilation is None
               else f"time dilated ×{cluster.dilation:.3g}")
    else:
        how = f"time dilated ×{dilation:.3g}"
    if cluster.dilation is not None:
        basis = " (fixed)"
    elif cluster.efficiency is None:
        basis = f" (this rank's compute ÷ the estimate of its stage's on the {cluster.gpu.name})"
    else:
        basis = f" (this rank's compute ÷ the {cluster.gpu.name}'s at {cluster.efficiency:.0%} MFU)"
    return f"EMULATED cluster {cluster.describe()}; {how}{basis}"


# --- what the native backend is told per group ------------------------------------------------------------


@dataclass(frozen=True)
class GroupLines:
    """One process group's lines (`links.Line`) as the native backend reads them: the target cluster's per
    kind ("p2p": a coalesced send/recv batch, priced at the group's slowest pair), per peer for send/recv, and
    this machine's own transfer time per kind."""

    target: dict[str, tuple[Line, ...]]
    peers: tuple[tuple[Line, ...], ...]
    real: dict[str, tuple[Line, ...]]

    def as_native(self) -> tuple[dict, list, dict]:
        def pairs(lines: tuple[Line, ...]) -> list[tuple[float, float]]:
            return [(line.latency, line.seconds_per_byte) for line in lines]

        return ({k: pairs(v) for k, v in self.target.items()}, [pairs(p) for p in self.peers],
                {k: pairs(v) for k, v in self.real.items()})


def group_lines(ranks: tuple[int, ...], me: int, topology: Topology, real: RealLinks = DEFAULT_REAL) -> GroupLines:
    """The lines of the group of global `ranks` as seen by global rank `me`; `real`: this machine's transport."""
    target = {kind: links.coefficients(kind, ranks, topology) for kind in links.KINDS if kind not in ("send", "recv")}
    peers = tuple(links.coefficients("send", (me, peer), topology) if peer != me else (Line("local", 0.0, 0.0),)
                  for peer in ranks)
    target["p2p"] = (max((p[0] for p in peers), key=lambda line: line.seconds_per_byte),)
    n = len(ranks)
    own = {kind: (Line("real", latency, links.bus_factor(kind, n) * per_bus_byte),)
           for kind, (latency, per_bus_byte) in real.items()}
    return GroupLines(target, peers, own)


def step_compute_s(intervals) -> float:
    """Seconds a step computed: the union of its compute spans, less the time a thread waited on a collective."""
    from workbench.telemetry.analysis import covered_ns, split_kinds

    return covered_ns(split_kinds(intervals)[0]) * 1e-9


WARMUP_STEPS = 2
"""Steps measured before the dilation is trusted: a first step carries its warm-up (allocations, the first
optimizer step), which would inflate it."""


def stage_target_s(stages: tuple[float, ...], cfg: "Config", rank: int) -> float:
    """Of the target's compute per pipeline stage (`workbench.emulation.predict.stage_compute_s`), global `rank`'s."""
    return stages[cfg.degrees.mesh_layout().coordinate(rank)["pp"]]


def dilation_from_steps(steps, target_s: float, last: int = 3) -> float | None:
    """The measured dilation after `steps` (one rank's `StepMetrics`, oldest first, all of one layout) whose
    compute takes `target_s` on the target GPU: the lowest ratio over the `last` steps that carry telemetry
    (noise only ever adds compute time); None before WARMUP_STEPS of them."""
    ratios = [measured_dilation(step_compute_s(m.intervals), target_s) for m in steps[-last:] if m.intervals]
    ratios = [r for r in ratios if r is not None]
    return min(ratios) if len(ratios) >= min(WARMUP_STEPS, last) else None


def measured_dilation(compute_s: float, target_s: float) -> float | None:
    """this rank's compute time / the target GPU's time for the same step; None without a measure."""
    if compute_s <= 0 or target_s <= 0:
        return None
    return compute_s / target_s
