"""The pipeline schedule as the ranks ran it, beside the ideal grid, with its bubble."""

from __future__ import annotations

import plotly.graph_objects as go

from workbench.schedules import (
    Action,
    ActionInterval,
    config_grid,
    config_stages,
    ideal_bubble_fraction,
    measured_bubble,
)
from workbench.telemetry.events import StepMetrics
from workbench.telemetry.store import Snapshot
from workbench.ui.panels.style import COMPUTE_COLORS, axes_visible, base_layout, note


def setup_pipeline(fig: go.Figure, world_size: int) -> None:
    base_layout(fig, "Pipeline schedule")
    for axis in ("", "2"):
        for kind in ("F", "B"):
            fig.add_bar(name=f"{kind} {'ideal' if axis == '' else 'measured'}", orientation="h", showlegend=False,
                        marker_color=COMPUTE_COLORS[kind], marker_line=dict(width=1, color="white"),
                        textposition="inside", insidetextanchor="middle", textfont=dict(size=10),
                        xaxis=f"x{axis}", yaxis=f"y{axis}")
    fig.update_layout(barmode="overlay", bargap=0.15,
                      xaxis=dict(domain=[0, 1], anchor="y", title=dict(text="time step (each F/B one unit)",
                                                                       standoff=2)),
                      yaxis=dict(domain=[0.6, 1], autorange="reversed", type="category", title="ideal"),
                      xaxis2=dict(domain=[0, 1], anchor="y2", title=dict(text="ms (measured)", standoff=2)),
                      yaxis2=dict(domain=[0, 0.4], autorange="reversed", type="category", title="measured"))


def pipeline_intervals(latest: dict[int, StepMetrics], pp: int) -> list[ActionInterval]:
    """The F/B actions the ranks reported for one replica of the pipeline, each on its pipeline rank (stage % pp)."""
    out: dict[int, list[ActionInterval]] = {}
    for r in sorted(latest):
        found = latest[r].pipeline_actions
        if not found:
            continue
        pp_rank = found[0][0] % pp
        # With dp or tp > 1 several ranks run the same stages; the lowest rank stands for them.
        out.setdefault(pp_rank, [ActionInterval(pp_rank, stage, mb, kind, start, end)
                                 for stage, mb, kind, start, end in found])
    return [iv for r in sorted(out) for iv in out[r]]


def action_label(action: Action, stages_per_rank: int) -> str:
    """"F0" for micro-batch 0's forward; with several stages per rank "1F0", the stage (chunk) first, as torch
    prints its actions, so that an interleaved rank's two F0s read apart."""
    return str(action) if stages_per_rank > 1 else f"{action.kind}{action.microbatch}"


def _grid_bars(traces, cells: list[tuple[int, Action, float, float]], stages_per_rank: int = 1) -> None:
    for trace, kind in zip(traces, ("F", "B")):
        mine = [c for c in cells if c[1].kind == kind]
        trace.y = [f"pp {r}" for r, *_ in mine]
        trace.base = [start for *_, start, _ in mine]
        trace.x = [width for *_, width in mine]
        trace.text = [action_label(a, stages_per_rank) for _, a, *_ in mine]
        trace.customdata = [str(a) for _, a, *_ in mine]
        trace.hovertemplate = "%{customdata} (stage·kind·micro-batch)<extra>%{y}</extra>"


def draw_pipeline(fig: go.Figure, snap: Snapshot) -> None:
    cfg = snap.config
    axes_visible(fig, cfg is not None and cfg.pp > 1)
    if cfg is None or cfg.pp == 1:
        _grid_bars(fig.data, [])
        fig.layout.title.text = "Pipeline schedule"
        fig.layout.annotations = note("this layout has no pipeline (pp = 1): choose pp ≥ 2")
        return
    v = config_stages(cfg)
    grid = config_grid(cfg)
    _grid_bars(fig.data[:2], [(r, a, t, 1.0) for r in range(grid.pp) for t in range(grid.steps)
                              if (a := grid.at(r, t)) is not None], v)
    measured = pipeline_intervals(snap.common_latest(), cfg.pp)
    origin = min((iv.start_ns for iv in measured), default=0)
    _grid_bars(fig.data[2:], [(iv.rank, Action(iv.stage, iv.kind, iv.microbatch), (iv.start_ns - origin) / 1e6,
                               (iv.end_ns - iv.start_ns) / 1e6) for iv in measured], v)
    ideal = ideal_bubble_fraction(cfg.pp, cfg.micro_batches, v)
    formula = "(p−1)/(v·m+p−1)" if v > 1 else "(p−1)/(m+p−1)"
    measured_text = (f"measured {measured_bubble(measured).fraction:.0%}" if measured
                     else "measured: no F/B intervals yet")
    fig.layout.title.text = (f"Pipeline schedule: {cfg.schedule}, pp={cfg.pp}, m={cfg.micro_batches}<br>"
                             f"<sup>bubble {measured_text} · ideal {formula} = {ideal:.0%}</sup>")
    fig.layout.annotations = note(None if measured else "measured schedule: F/B intervals not reported yet", y=0.2)
