"""What the estimator predicts for an emulated cluster, beside what the emulated ranks measured, undilated.

The prediction is the estimator's own traffic and overlap accounting (`wb.estimate(cfg, topology.gpu)`: which
collectives, how many calls and bytes, what each hides behind) with every collective priced by the link model on
the emulated topology: time = calls × links.collective_time(kind, bytes per call, the axis's ranks, topology),
exposed = max(0, time − what the estimator hides it behind). The estimator itself places ranks on its hardware
profile's own cluster; here they stand on the emulated one (nodes of one GPU across a network, say).

Two things the estimator folds into its step are laid out here as the ranks measure them:
- a pipeline's span comes from its schedule run in time (`workbench.schedules.simulate`), each stage's forward and
  backward of a micro-batch from the estimate and each hop between stages priced by the link model, so the
  bubble and the sends on its critical path are what a rank waits for, as the measured bubble counts them. A hop
  starts only when the receiving stage is free too: torch's schedules post a receive after the stage's previous
  action, batched with its send, and NCCL launches that group after the action's kernels (on a CPU rank, after
  it returns), so the transfer never hides behind that action;
- `fsdp_overlaps=False` prices a run whose FSDP2 gathers and reduce-scatters hide nothing: FSDP2 overlaps them
  with compute through CUDA streams, issued synchronously from the CPU; on a CPU rank there are no streams and
  each one blocks the training thread (`torch.distributed.fsdp`'s unshard and reduce paths). That is where the
  emulation on this machine stops standing for a GPU, and the bench prints both.

The trainer's one world all-reduce per step (the loss and the ranks' votes) is added: the estimator does not count
it, and on a small step its latency is a large share.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from workbench import hardware, links
from workbench.config import Config
from workbench.emulation.cluster import Cluster, stage_target_s, step_compute_s
from workbench.estimate.records import Estimate, Role, StageEstimate
from workbench.schedules import Durations, Timeline, config_stages, placement, rank_orders, simulate, stage_rank

VOTE_BYTES = 4 * 6
"""The trainer's per-step all-reduce: loss, weight, found_inf, stop, skip, oom as fp32 (MoE adds its counts)."""


def stage_compute_s(cfg: Config, cluster: Cluster) -> tuple[float, ...]:
    """Seconds the cluster's GPU computes one step of each pipeline stage of `cfg`: the estimator's compute of the
    stage (bubble excluded, as a rank's own compute spans exclude it), by its kernel model or at
    `cluster.efficiency` of the peak when that is stated. What a measured time dilation divides by: the notebook
    sends it to the ranks when a layout is applied (`workbench.emulation.rank.set_targets`)."""
    return _stage_compute(cfg, cluster._base().gpu, cluster.efficiency)


@functools.lru_cache(maxsize=32)
def _stage_compute(cfg: Config, gpu: str, efficiency: float | None) -> tuple[float, ...]:
    # Asked when the layout is checked and again when it is applied: cached; the estimator is pure Python.
    from workbench.estimate import estimate

    return tuple(stage.compute_s for stage in estimate(cfg, gpu, efficiency=efficiency).stages)


def target_compute_s(cfg: Config, cluster: Cluster, rank: int) -> float:
    """Seconds the cluster's GPU computes one step of global `rank` in `cfg` (its pipeline stage's)."""
    return stage_target_s(stage_compute_s(cfg, cluster), cfg, rank)


@dataclass(frozen=True)
class StepFigures:
    """Compute and exposed communication of one step in seconds on the target, the collectives it ran, and under
    pipeline parallelism its bubble (the pipeline's idle fraction; None without one)."""

    compute_s: float
    exposed_s: float
    collectives: int
    bubble: float | None = None


def axis_ranks(cfg: Config, axis: str) -> tuple[int, ...]:
    """Global ranks of rank 0's group along the estimator's `axis`, on the mesh the ranks build ("pp": rank 0 and
    the next stage's rank)."""
    group = tuple(cfg.degrees.mesh_layout().group(0, axis))
    return group[:2] if axis == "pp" else group


FSDP_ROLES = (Role.PARAMETER_GATHER, Role.GRADIENT_SYNC)


def predicted(cfg: Config, topology: links.Topology, fsdp_overlaps: bool = True) -> StepFigures:
    """The prediction on the topology's GPUs: the busiest stage's compute (without the bubble), the largest exposed
    communication of any stage (under pp: all of a stage's step that is not its own compute, the bubble and the
    sends it waits for included), and the pipeline's bubble."""
    from workbench.estimate import estimate

    gpu = topology.gpu
    est = estimate(cfg, gpu)
    # With a link of 1 B/s every collective's exposed time is its time less what hides it: that is the hiding.
    slow = estimate(cfg, replace(hardware.profile(gpu), link_bw=1.0))
    vote = links.collective_time("all_reduce", VOTE_BYTES, tuple(range(cfg.world_size)), topology)
    span, bubble = _pipeline(cfg, est, topology) if cfg.pp > 1 else (0.0, None)
    exposed_most, calls_most = -1.0, 0
    for stage, slow_stage in zip(est.stages, slow.stages):
        exposed, calls = vote, 1
        for c, s in zip(stage.comm, slow_stage.comm):
            calls += c.calls
            if c.role is Role.PIPELINE:
                calls += c.calls  # a stage receives as many as it sends; the ranks record both
                continue  # their time is in the pipeline's span
            kind = "send" if c.kind == "send_recv" else c.kind
            seconds = c.calls * links.collective_time(kind, c.bytes / c.calls, axis_ranks(cfg, c.axis), topology)
            blocking = not fsdp_overlaps and cfg.zero >= 2 and c.axis == "dp" and c.role in FSDP_ROLES
            exposed += seconds if blocking else max(0.0, seconds - (s.time_s - s.exposed_s))
        if cfg.pp > 1:
            exposed += span + max(map(_optimizer_s, est.stages)) - stage.compute_s
        if exposed > exposed_most:
            exposed_most, calls_most = exposed, calls
    return StepFigures(max(s.compute_s for s in est.stages), exposed_most, calls_most, bubble)


def _optimizer_s(stage: StageEstimate) -> float:
    return dict(stage.compute_split).get("optimizer", 0.0)


def _pipeline(cfg: Config, est: Estimate, topology: links.Topology) -> tuple[float, float]:
    """The pipeline's span (its forwards and backwards; the optimizer step after it is not in it) and its bubble,
    by the schedule run in time: a stage's micro-batch takes its estimated compute, a third forward and two thirds
    backward (a split backward: half each), and every hop takes a send of the stage's boundary on the link model."""
    chunks = config_stages(cfg)
    per_rank = [(s.compute_s - _optimizer_s(s)) / cfg.micro_batches / chunks for s in est.stages]
    durations = [Durations.split(t / 3, t / 3, t / 3) for t in per_rank]
    style = placement(cfg.schedule)
    timeline = _in_time(cfg, est, topology, lambda a: durations[stage_rank(a.stage, cfg.pp, style)].of(a))
    return timeline.makespan, _bubble(cfg, timeline)


def bubble_at_measured_compute(cfg: Config, actions, topology: links.Topology, dilation: float) -> float:
    """The bubble the schedule has when run in time with each action as long as it measured (undilated) and each
    hop priced by the link model: the prediction's pipeline with the ranks' own compute put in the estimate's
    place. Beside the measured bubble it tells the two gaps apart: a measured bubble that matches this one is
    paced as the links say, and differs from the prediction only by how the stages computed.

    actions: the step's `workbench.schedules.ActionInterval`s of every rank (one clock)."""
    from workbench.schedules import ActionInterval

    took = {(a.stage, a.kind, a.microbatch): (a.end_ns - a.start_ns) * 1e-9 / dilation
            for a in map(lambda a: ActionInterval(*a), actions)}
    timeline = _in_time(cfg, _estimate(cfg, topology), topology, lambda a: took[a.stage, a.kind, a.microbatch])
    return _bubble(cfg, timeline)


def _in_time(cfg: Config, est: Estimate, topology: links.Topology, duration) -> Timeline:
    """`cfg`'s schedule run in time with each action `duration(action)` long and every hop a send of the stage's
    boundary (`est`'s pipeline send) on the link model, started once the receiving stage is free."""
    chunks = config_stages(cfg)
    send = next(c for c in est.stages[0].comm if c.role is Role.PIPELINE)
    hop = links.collective_time("send", send.bytes / send.calls, axis_ranks(cfg, "pp"), topology)
    return simulate(rank_orders(cfg.schedule, cfg.pp, cfg.micro_batches, chunks), duration, chunks, hop,
                    receive_when_free=True)


def _bubble(cfg: Config, timeline: Timeline) -> float:
    return sum(timeline.idle_per_rank) / cfg.pp / timeline.makespan


def _estimate(cfg: Config, topology: links.Topology) -> Estimate:
    from workbench.estimate import estimate

    return estimate(cfg, topology.gpu)


def undilated(histories: list) -> list[list[StepFigures]]:
    """Each paced step of every rank (`StepMetrics`, one list a rank), divided by the dilation it was paced with
    (`StepMetrics.dilation`): what it took on the cluster. Steps run unpaced (the dilation was being measured)
    are left out."""
    return [[StepFigures(step_compute_s(m.intervals) / m.dilation, m.exposed_comm_s / m.dilation,
                         sum(iv.kind == "comm" for iv in m.intervals)) for m in h if m.dilation] for h in histories]
