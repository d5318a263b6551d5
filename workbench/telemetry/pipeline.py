"""The pipeline's bubble from one step's measured actions: what it was, and what its schedule's formula says.

Pure functions over the step records the ranks send (`StepMetrics.pipeline_actions`),
so the pipeline panel only draws and the notebooks and tests read the same figures.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from workbench.config import Config
from workbench.schedules import (
    FORMULAS,
    ActionInterval,
    Durations,
    MeasuredBubble,
    Placement,
    bubble_formula,
    config_grid,
    config_stages,
    measured_bubble,
    measured_durations,
    rank_orders,
    simulate,
    stage_rank,
)
from workbench.telemetry.events import StepMetrics


def pipeline_intervals(latest: dict[int, StepMetrics], pp: int, style: Placement = "loop") -> list[ActionInterval]:
    """The actions the ranks reported for one replica of the pipeline, each on its pipeline rank.

    With dp or tp > 1 several ranks run the same stages; the lowest rank stands for them. `style` is the
    schedule's placement, which says which pipeline rank holds a stage.
    """
    out: dict[int, list[ActionInterval]] = {}
    for r in sorted(latest):
        found = latest[r].pipeline_actions
        if not found:
            continue
        pp_rank = stage_rank(found[0][0], pp, style)
        out.setdefault(pp_rank, [ActionInterval(pp_rank, stage, mb, kind, start, end)
                                 for stage, mb, kind, start, end in found])
    return [iv for r in sorted(out) for iv in out[r]]


@dataclass(frozen=True)
class PipelineBubble:
    """One step's bubble beside its predictions, for a Config's pipeline."""

    ideal_fraction: float
    """Idle share of the ideal grid (every action one time step)."""
    ideal_formula: str | None
    """The closed form of `ideal_fraction` where one is known (the 1F1B family, `ideal_bubble_fraction`), else None."""
    formula: str
    """The schedule's bubble per rank in action durations (`workbench.schedules.FORMULAS`)."""
    pp: int
    """Pipeline ranks."""
    measured: MeasuredBubble | None = None
    """Idle time per rank over the step's window; None before any step was measured."""
    durations: Durations | None = None
    """Mean measured time of each kind of action (ns)."""
    formula_ns: float | None = None
    """`formula` evaluated with the measured durations: the bubble per rank it predicts (ns)."""
    schedule_ns: float | None = None
    """Mean idle time per rank of the schedule's own order run with the measured mean durations and no
    communication time (`workbench.schedules.simulate`): what the order costs at these durations (ns)."""
    replay_ns: float | None = None
    """The same with each action's own measured time: the bubble the dependencies alone explain; what the
    measured bubble has beyond it is sends and per-action overhead (ns)."""

    @property
    def unit_ns(self) -> float | None:
        """(p-1)(F+B) at the measured times: 1F1B's bubble at these chunk times, one scale for every schedule."""
        return None if self.durations is None else (self.pp - 1) * (self.durations.F + self.durations.B)


def pipeline_bubble(cfg: Config, intervals: list[ActionInterval]) -> PipelineBubble:
    """The bubble of `cfg`'s pipeline: ideal, and, given one replica's measured `intervals`, measured and predicted."""
    v = config_stages(cfg)
    one_f_one_b = cfg.schedule in ("gpipe", "1f1b", "interleaved_1f1b")
    ideal = PipelineBubble(
        ideal_fraction=config_grid(cfg).bubble_fraction,
        ideal_formula=("(p−1)/(v·m+p−1)" if v > 1 else "(p−1)/(m+p−1)") if one_f_one_b else None,
        formula=FORMULAS[cfg.schedule], pp=cfg.pp)
    if not intervals:
        return ideal
    d = measured_durations(intervals)
    order = rank_orders(cfg.schedule, cfg.pp, cfg.micro_batches, v)
    own = {(iv.stage, iv.kind, iv.microbatch): iv.end_ns - iv.start_ns for iv in intervals}
    replay = simulate(order, lambda a: own.get((a.stage, a.kind, a.microbatch), d.of(a)), v)
    return replace(ideal, measured=measured_bubble(intervals), durations=d,
                   formula_ns=bubble_formula(cfg.schedule, cfg.pp, d),
                   schedule_ns=sum(simulate(order, d, v).idle_per_rank) / cfg.pp,
                   replay_ns=sum(replay.idle_per_rank) / cfg.pp)
