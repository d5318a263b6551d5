"""What the estimator predicts for an emulated cluster, beside what the emulated ranks measured, undilated.

The prediction is the estimator's own traffic and overlap accounting (`wb.estimate(cfg, topology.gpu)`: which
collectives, how many calls and bytes, what each hides behind) with every collective priced by the link model on
the emulated topology: time = calls × links.collective_time(kind, bytes per call, the axis's ranks, topology),
exposed = max(0, time − what the estimator hides it behind). A bridge: the estimator on main prices a collective
as bytes over the NVLink bandwidth with no latency; once it prices them with `workbench.links` itself (issue 18),
its own figures replace `predicted`.

The trainer's one world all-reduce per step (the loss and the ranks' votes) is added: the estimator does not count
it, and on a small step its latency is a large share.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from workbench import hardware, links
from workbench.config import Config
from workbench.emulation.cluster import step_compute_s

VOTE_BYTES = 4 * 6
"""The trainer's per-step all-reduce: loss, weight, found_inf, stop, skip, oom as fp32 (MoE adds its counts)."""


@dataclass(frozen=True)
class StepFigures:
    """Compute and exposed communication of one step in seconds on the target, and the collectives it ran."""

    compute_s: float
    exposed_s: float
    collectives: int


def _mesh(cfg: Config) -> list[tuple[str, int]]:
    return [("pp", cfg.pp), ("edp", cfg.dp // cfg.ep), ("ep", cfg.ep), ("tp", cfg.tp)]


def axis_ranks(cfg: Config, axis: str) -> tuple[int, ...]:
    """Global ranks of rank 0's group along the estimator's `axis` ("dp" is edp × ep; "pp": the next stage)."""
    mesh = _mesh(cfg)
    if axis == "dp":
        return links.mesh_group(mesh, ("edp", "ep"))
    group = links.mesh_group(mesh, axis)
    return group[:2] if axis == "pp" else group


def predicted(cfg: Config, topology: links.Topology) -> StepFigures:
    """The prediction on the topology's GPUs for the stage with the most exposed communication (its compute
    without the bubble)."""
    from workbench.estimate import estimate

    gpu = topology.gpu
    est = estimate(cfg, gpu)
    # With a link of 1 B/s every collective's exposed time is its time less what hides it: that is the hiding.
    slow = estimate(cfg, replace(hardware.profile(gpu), link_bw=1.0))
    vote = links.collective_time("all_reduce", VOTE_BYTES, tuple(range(cfg.world_size)), topology)
    best = StepFigures(0.0, -1.0, 0)
    for stage, slow_stage in zip(est.stages, slow.stages):
        exposed, calls = vote, 1
        for c, s in zip(stage.comm, slow_stage.comm):
            kind = "send" if c.kind == "send_recv" else c.kind
            seconds = c.calls * links.collective_time(kind, c.bytes / c.calls, axis_ranks(cfg, c.axis), topology)
            exposed += max(0.0, seconds - (s.time_s - s.exposed_s))
            calls += c.calls
        if exposed > best.exposed_s:
            best = StepFigures(stage.compute_s, exposed, calls)
    return best


def undilated(histories: list) -> list[list[StepFigures]]:
    """Each paced step of every rank (`StepMetrics`, one list a rank), divided by the dilation it was paced with
    (`StepMetrics.dilation`): what it took on the cluster. Steps run unpaced (the dilation was being measured)
    are left out."""
    return [[StepFigures(step_compute_s(m.intervals) / m.dilation, m.exposed_comm_s / m.dilation,
                         sum(iv.kind == "comm" for iv in m.intervals)) for m in h if m.dilation] for h in histories]
