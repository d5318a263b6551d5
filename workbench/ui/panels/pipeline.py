"""The pipeline schedule as the ranks ran it, beside the ideal grid, with its bubble measured and by formula."""

from __future__ import annotations

import plotly.graph_objects as go

from workbench.schedules import KINDS, Action, config_grid, config_stages, placement
from workbench.telemetry.pipeline import PipelineBubble, pipeline_bubble, pipeline_intervals
from workbench.telemetry.runs import Snapshot
from workbench.ui.panels.style import COMPUTE_COLORS, axes_visible, base_layout, note

KIND_NAMES = {"F": "forward", "B": "backward", "I": "input-gradient backward", "W": "weight-gradient backward"}


def setup_pipeline(fig: go.Figure, world_size: int) -> None:
    base_layout(fig, "Pipeline schedule")
    for axis in ("", "2"):
        for kind in KINDS:
            fig.add_bar(name=f"{kind} {'ideal' if axis == '' else 'measured'}", orientation="h", showlegend=False,
                        marker_color=COMPUTE_COLORS[kind], marker_line=dict(width=1, color="white"),
                        textposition="inside", insidetextanchor="middle", textfont=dict(size=10),
                        xaxis=f"x{axis}", yaxis=f"y{axis}")
    fig.update_layout(barmode="overlay", bargap=0.15,
                      xaxis=dict(domain=[0, 1], anchor="y", title=dict(text="time step (each action one unit)",
                                                                       standoff=2)),
                      yaxis=dict(domain=[0.6, 1], autorange="reversed", type="category", title="ideal"),
                      xaxis2=dict(domain=[0, 1], anchor="y2", title=dict(text="ms (measured)", standoff=2)),
                      yaxis2=dict(domain=[0, 0.4], autorange="reversed", type="category", title="measured"))


def action_label(action: Action, stages_per_rank: int) -> str:
    """"F0" for micro-batch 0's forward; with several stages per rank "1F0", the stage (chunk) first, as torch
    prints its actions, so that an interleaved (or V-placed) rank's two F0s read apart."""
    return str(action) if stages_per_rank > 1 else f"{action.kind}{action.microbatch}"


def _grid_bars(traces, cells: list[tuple[int, Action, float, float]], stages_per_rank: int = 1) -> None:
    for trace, kind in zip(traces, KINDS):
        mine = [c for c in cells if c[1].kind == kind]
        trace.y = [f"pp {r}" for r, *_ in mine]
        trace.base = [start for *_, start, _ in mine]
        trace.x = [width for *_, width in mine]
        trace.text = [action_label(a, stages_per_rank) for _, a, *_ in mine]
        trace.customdata = [str(a) for _, a, *_ in mine]
        trace.hovertemplate = f"%{{customdata}} (stage·{KIND_NAMES[kind]}·micro-batch)<extra>%{{y}}</extra>"


def _subtitle(bubble: PipelineBubble) -> str:
    ideal = (f"ideal {bubble.ideal_formula} = {bubble.ideal_fraction:.0%}" if bubble.ideal_formula
             else f"ideal grid {bubble.ideal_fraction:.0%}")
    if bubble.measured is None:
        return f"bubble measured: no actions yet · {ideal}"
    return (f"bubble measured {bubble.measured.fraction:.0%} ({bubble.measured.idle_ns / 1e6:.1f} ms/rank) · "
            f"{bubble.formula} = {bubble.formula_ns / 1e6:.1f} ms · {ideal}")


def draw_pipeline(fig: go.Figure, snap: Snapshot) -> None:
    cfg = snap.config
    axes_visible(fig, cfg is not None and cfg.pp > 1)
    n = len(KINDS)
    if cfg is None or cfg.pp == 1:
        _grid_bars(fig.data[:n], [])
        _grid_bars(fig.data[n:], [])
        fig.layout.title.text = "Pipeline schedule"
        fig.layout.annotations = note("this layout has no pipeline (pp = 1): choose pp ≥ 2")
        return
    grid = config_grid(cfg)
    v = config_stages(cfg)
    _grid_bars(fig.data[:n], [(r, a, t, 1.0) for r in range(grid.pp) for t in range(grid.steps)
                              if (a := grid.at(r, t)) is not None], v)
    measured = pipeline_intervals(snap.common_latest(), cfg.pp, placement(cfg.schedule))
    origin = min((iv.start_ns for iv in measured), default=0)
    _grid_bars(fig.data[n:], [(iv.rank, Action(iv.stage, iv.kind, iv.microbatch), (iv.start_ns - origin) / 1e6,
                               (iv.end_ns - iv.start_ns) / 1e6) for iv in measured], v)
    fig.layout.title.text = (f"Pipeline schedule: {cfg.schedule}, pp={cfg.pp}, m={cfg.micro_batches}<br>"
                             f"<sup>{_subtitle(pipeline_bubble(cfg, measured))}</sup>")
    fig.layout.annotations = note(None if measured else "measured schedule: actions not reported yet", y=0.2)
