"""Live plots of what the ranks reported: they draw telemetry, they compute nothing.

Each panel is a pair of functions: `setup(fig, world_size)` makes the traces
once, `draw(fig, snapshot)` sets their data from a `Snapshot` of the store.
The same pairs fill the notebook's FigureWidgets (`LivePlots`, redrawn by a
`Ticker` at most a few times a second, one `batch_update` per figure per tick)
and the static figures of an HTML report (`static_figures`).

A field the telemetry has not delivered yet (memory, intervals, MFU, overlap)
is shown as a note saying so, never as a made-up number.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import ipywidgets as widgets
import plotly.graph_objects as go

from workbench.engine.parallel.schedule_grid import (
    Action,
    ActionInterval,
    config_grid,
    config_stages,
    ideal_bubble_fraction,
    measured_bubble,
)
from workbench.telemetry.events import MEMORY_CATEGORIES, Interval, StepMetrics
from workbench.telemetry.store import Snapshot, TelemetryStore

MEMORY_COLORS = dict(zip(MEMORY_CATEGORIES, ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#BAB0AC")))
COMPUTE_COLORS = {"forward": "#4C78A8", "backward": "#72B7B2", "optimizer": "#54A24B", "F": "#4C78A8", "B": "#72B7B2"}
COMM_COLORS = {"all_reduce": "#E45756", "all_gather": "#F58518", "reduce_scatter": "#B279A2", "all_to_all": "#FF9DA6",
               "broadcast": "#9D755D", "send": "#EECA3B", "recv": "#EECA3B"}
RANK_COLORS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#EECA3B", "#9D755D")
HEIGHT = 300
WIDTH = 560
"""Fixed: a FigureWidget sizes itself once, when first drawn, and a container that was hidden or narrower
then (a collapsed output, a cell scrolled out of view) would leave it at plotly's default 700 px."""

log = logging.getLogger("workbench.ui")


def _base_layout(fig: go.Figure, title: str) -> None:
    fig.update_layout(template="plotly_white", height=HEIGHT, width=WIDTH,
                      title=dict(text=title, font=dict(size=14), x=0.01), margin=dict(l=60, r=20, t=58, b=40),
                      legend=dict(orientation="h", y=-0.2, font=dict(size=11)), uirevision="keep")  # keep the user's zoom across redraws


def _note(text: str | None, y: float = 0.5) -> list[dict]:
    """A grey centred line saying what is missing; [] when nothing is."""
    if not text:
        return []
    return [dict(text=text, xref="paper", yref="paper", x=0.5, y=y, showarrow=False,
                 font=dict(color="#888", size=13))]


def _axes_visible(fig: go.Figure, visible: bool) -> None:
    """Empty axes only show made-up ranges (e.g. -1 B to 4 B): hide them while a panel has no data."""
    fig.update_xaxes(visible=visible)
    fig.update_yaxes(visible=visible)


def _rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def _name_color(name: str, palette: dict[str, str], fallback: tuple[str, ...]) -> str:
    base = name.split(":")[-1]
    if base in palette:
        return palette[base]
    return fallback[sum(map(ord, base)) % len(fallback)]  # stable across runs, unlike hash()


# -- loss -------------------------------------------------------------------------------------------
def setup_loss(fig: go.Figure, world_size: int) -> None:
    _base_layout(fig, "Loss per step")
    fig.add_scatter(name="loss (global batch)", mode="lines+markers", marker=dict(size=4), line=dict(color="#4C78A8"))
    fig.add_scatter(name="skipped step", mode="markers", marker=dict(symbol="x", size=9, color="#E45756"))
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="loss")


def draw_loss(fig: go.Figure, snap: Snapshot) -> None:
    steps = snap.steps(0)
    loss, skipped = fig.data[0], fig.data[1]
    loss.x, loss.y = [m.step for m in steps], [m.loss for m in steps]
    loss.customdata = [m.layout for m in steps]
    loss.hovertemplate = "step %{x}<br>loss %{y:.4f}<br>%{customdata}<extra></extra>"
    skipped.x = [m.step for m in steps if m.skipped]
    skipped.y = [m.loss for m in steps if m.skipped]
    skipped.customdata = [m.skip_reason for m in steps if m.skipped]
    skipped.hovertemplate = "step %{x} skipped: %{customdata}<extra></extra>"
    # A layout change takes effect at its step: the marker sits just before it.
    fig.layout.shapes = [dict(type="line", x0=c.step - 0.5, x1=c.step - 0.5, y0=0, y1=1, yref="paper",
                              line=dict(color="#888", dash="dot", width=1)) for c in snap.layout_changes]
    labels = [dict(text=c.layout, x=c.step - 0.5, y=1, xref="x", yref="paper", showarrow=False, textangle=-90,
                   xanchor="left", yanchor="top", font=dict(size=11, color="#555")) for c in snap.layout_changes]
    fig.layout.annotations = labels + _note(None if steps else "no steps yet: Apply a layout, then Train")
    _axes_visible(fig, bool(steps))


# -- throughput and MFU ------------------------------------------------------------------------------
def setup_throughput(fig: go.Figure, world_size: int) -> None:
    _base_layout(fig, "Throughput and MFU")
    fig.add_scatter(name="tokens/s (all ranks)", mode="lines", line=dict(color="#4C78A8"))
    for r in range(world_size):
        fig.add_scatter(name=f"MFU rank {r}", mode="lines", yaxis="y2", line=dict(color=_rank_color(r + 1)))
    # Two rows on one step axis: with a fixed model MFU follows tokens/s, and on twin axes the lines would
    # lie on top of each other.
    fig.update_layout(yaxis=dict(title="tokens/s", rangemode="tozero", domain=[0.55, 1]),
                      yaxis2=dict(title="MFU", tickformat=".1%", rangemode="tozero", domain=[0, 0.42], anchor="x"),
                      xaxis=dict(title=dict(text="step", standoff=4), anchor="y2"))


def draw_throughput(fig: go.Figure, snap: Snapshot) -> None:
    steps = snap.steps(0)
    fig.data[0].x, fig.data[0].y = [m.step for m in steps], [m.tokens_per_s for m in steps]
    any_mfu = False
    for r, trace in enumerate(fig.data[1:]):
        with_mfu = [m for m in snap.steps(r) if m.mfu is not None]
        any_mfu |= bool(with_mfu)
        trace.x, trace.y = [m.step for m in with_mfu], [m.mfu for m in with_mfu]
    _axes_visible(fig, bool(steps))
    if not steps:
        fig.layout.annotations = _note("no steps yet")
    else:  # tokens/s is drawn; the note sits above it
        fig.layout.annotations = _note(None if any_mfu else "MFU: not reported yet (needs FLOP counts and the "
                                       "device's peak)", y=0.2)


# -- memory -----------------------------------------------------------------------------------------
def setup_memory(fig: go.Figure, world_size: int) -> None:
    _base_layout(fig, "Memory per rank by category")
    for cat in MEMORY_CATEGORIES:
        # "other" is the rest of the process (on CPU the Python and torch runtime, hundreds of MB) and would
        # flatten the categories a layout changes; it starts hidden, one click on its legend entry away.
        fig.add_bar(name=cat, marker_color=MEMORY_COLORS[cat], visible="legendonly" if cat == "other" else True)
    fig.update_layout(barmode="stack", yaxis=dict(title="bytes", tickformat=".2s", ticksuffix="B"))


def draw_memory(fig: go.Figure, snap: Snapshot) -> None:
    latest = snap.common_latest()
    ranks = [r for r in sorted(latest) if latest[r].memory or latest[r].peak_memory]
    # Two bars per rank: the bytes held at the end of the step, and each category's peak during it.
    x = [[f"rank {r}" for r in ranks for _ in (0, 1)], ["end of step", "peak"] * len(ranks)]
    for cat, trace in zip(MEMORY_CATEGORIES, fig.data):
        trace.x = x
        trace.y = [d.get(cat) for r in ranks for d in (latest[r].memory, latest[r].peak_memory)]
        trace.hovertemplate = f"{cat}: %{{y:.3s}}B<extra>%{{x}}</extra>"
    step = next(iter(latest.values())).step if latest else None
    fig.layout.title.text = (f"Memory per rank by category, step {step}<br><sup>'other' (the runtime) starts hidden: "
                             "click it in the legend</sup>" if ranks else "Memory per rank by category")
    note = None if ranks else ("no steps yet" if not latest else "memory by category: not reported yet")
    fig.layout.annotations = _note(note)
    _axes_visible(fig, bool(ranks))


# -- timeline of one step ----------------------------------------------------------------------------
TIMELINE_KINDS = ("compute", "wait", "comm")
WAIT_COLOR = "#BAB0AC"


def setup_timeline(fig: go.Figure, world_size: int) -> None:
    _base_layout(fig, "Timeline of the latest step")
    for kind in TIMELINE_KINDS:
        fig.add_bar(name=kind, orientation="h", showlegend=False, textposition="inside", insidetextanchor="middle",
                    textangle=0, marker_line=dict(width=1, color="white"))
    # Labels that do not fit a short bar are hidden rather than shrunk to nothing (hover still names it).
    fig.update_layout(barmode="overlay", bargap=0.25, uniformtext=dict(minsize=9, mode="hide"),
                      xaxis=dict(title="ms from the step's first interval"),
                      yaxis=dict(autorange="reversed", type="category"))


def _bars(trace, items: list[tuple[int, Interval, Action | None]], origin: int) -> None:
    # Ranks on one host share CLOCK_MONOTONIC, so one origin lines their bars up in real time.
    trace.y = [f"rank {r} {iv.kind}" for r, iv, _ in items]
    trace.base = [(iv.start_ns - origin) / 1e6 for _, iv, _ in items]
    trace.x = [(iv.end_ns - iv.start_ns) / 1e6 for _, iv, _ in items]
    trace.marker.color = [_interval_color(iv, a) for _, iv, a in items]
    trace.text = [_label(iv, a) for _, iv, a in items]
    trace.customdata = [[iv.name, iv.bytes, iv.group] for _, iv, _ in items]
    trace.hovertemplate = ("%{customdata[0]}<br>%{base:.3f} ms + %{x:.3f} ms<br>%{customdata[1]:.3s}B "
                           "%{customdata[2]}<extra>%{y}</extra>")


def _label(iv: Interval, action: Action | None) -> str:
    return f"{action.kind}{action.microbatch}" if action is not None else iv.name


def _interval_color(iv: Interval, action: Action | None) -> str:
    if iv.kind == "wait":
        return WAIT_COLOR
    if action is not None:
        return COMPUTE_COLORS[action.kind]
    return _name_color(iv.name, COMM_COLORS if iv.kind == "comm" else COMPUTE_COLORS, RANK_COLORS)


def draw_timeline(fig: go.Figure, snap: Snapshot) -> None:
    latest = snap.common_latest()
    origin = min((iv.start_ns for m in latest.values() for iv in m.intervals), default=0)
    items = []
    for r in sorted(latest):
        actions = _actions(latest[r])
        items += [(r, iv, actions.get((iv.start_ns, iv.end_ns)) if iv.kind == "compute" else None)
                  for iv in latest[r].intervals]
    for kind, trace in zip(TIMELINE_KINDS, fig.data):
        _bars(trace, [item for item in items if item[1].kind == kind], origin)
    present = {iv.kind for _, iv, _ in items}
    fig.layout.yaxis.categoryarray = [f"rank {r} {kind}" for r in sorted(latest) for kind in TIMELINE_KINDS
                                      if kind in present]
    _axes_visible(fig, bool(items))
    if not items:
        fig.layout.title.text = "Timeline of the latest step"
        fig.layout.annotations = _note("no steps yet" if not latest else "timeline: intervals not reported yet")
        return
    step = next(iter(latest.values())).step
    parts = [f"rank {r}: " + (f"{m.overlap:.0%} of comm overlapped, {m.exposed_comm_s * 1e3:.1f} ms exposed"
                              if m.overlap is not None else "no comm") for r, m in sorted(latest.items())]
    fig.layout.title.text = f"Timeline of step {step}<br><sup>{' · '.join(parts)}</sup>"
    fig.layout.annotations = []


# -- overlap over steps ------------------------------------------------------------------------------
def setup_overlap(fig: go.Figure, world_size: int) -> None:
    _base_layout(fig, "Communication hidden behind computation")
    for r in range(world_size):
        fig.add_scatter(name=f"rank {r}", mode="lines", line=dict(color=_rank_color(r)))
    fig.update_layout(xaxis=dict(title="step"), yaxis=dict(title="overlap", tickformat=".0%", range=[0, 1.05]))


def draw_overlap(fig: go.Figure, snap: Snapshot) -> None:
    seen = False
    for r, trace in enumerate(fig.data):
        points = [m for m in snap.steps(r) if m.overlap is not None]
        seen |= bool(points)
        trace.x, trace.y = [m.step for m in points], [m.overlap for m in points]
        trace.customdata = [m.exposed_comm_s * 1e3 for m in points]
        trace.hovertemplate = ("step %{x}: %{y:.0%} overlapped, %{customdata:.2f} ms exposed"
                               "<extra>%{fullData.name}</extra>")
    note = None if seen else ("no steps yet" if not snap.by_rank else "overlap: not reported yet")
    fig.layout.annotations = _note(note)
    _axes_visible(fig, seen)


# -- pipeline schedule -------------------------------------------------------------------------------
def setup_pipeline(fig: go.Figure, world_size: int) -> None:
    _base_layout(fig, "Pipeline schedule")
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


def _actions(metrics: StepMetrics) -> dict[tuple[int, int], Action]:
    """The pipeline actions a rank reported, by their (start_ns, end_ns): the compute spans they timed."""
    return {(start, end): Action(stage, kind, mb) for stage, mb, kind, start, end in metrics.pipeline_actions}


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


def _grid_bars(traces, cells: list[tuple[int, Action, float, float]]) -> None:
    for trace, kind in zip(traces, ("F", "B")):
        mine = [c for c in cells if c[1].kind == kind]
        trace.y = [f"pp {r}" for r, *_ in mine]
        trace.base = [start for *_, start, _ in mine]
        trace.x = [width for *_, width in mine]
        trace.text = [f"{a.kind}{a.microbatch}" for _, a, *_ in mine]
        trace.customdata = [str(a) for _, a, *_ in mine]
        trace.hovertemplate = "%{customdata} (stage·kind·micro-batch)<extra>%{y}</extra>"


def draw_pipeline(fig: go.Figure, snap: Snapshot) -> None:
    cfg = snap.config
    _axes_visible(fig, cfg is not None and cfg.pp > 1)
    if cfg is None or cfg.pp == 1:
        _grid_bars(fig.data, [])
        fig.layout.title.text = "Pipeline schedule"
        fig.layout.annotations = _note("this layout has no pipeline (pp = 1): choose pp ≥ 2")
        return
    v = config_stages(cfg)
    grid = config_grid(cfg)
    _grid_bars(fig.data[:2], [(r, a, t, 1.0) for r in range(grid.pp) for t in range(grid.steps)
                              if (a := grid.at(r, t)) is not None])
    measured = pipeline_intervals(snap.common_latest(), cfg.pp)
    origin = min((iv.start_ns for iv in measured), default=0)
    _grid_bars(fig.data[2:], [(iv.rank, Action(iv.stage, iv.kind, iv.microbatch), (iv.start_ns - origin) / 1e6,
                               (iv.end_ns - iv.start_ns) / 1e6) for iv in measured])
    ideal = ideal_bubble_fraction(cfg.pp, cfg.micro_batches, v)
    formula = "(p−1)/(v·m+p−1)" if v > 1 else "(p−1)/(m+p−1)"
    measured_text = (f"measured {measured_bubble(measured).fraction:.0%}" if measured
                     else "measured: no F/B intervals yet")
    fig.layout.title.text = (f"Pipeline schedule: {cfg.schedule}, pp={cfg.pp}, m={cfg.micro_batches}<br>"
                             f"<sup>bubble {measured_text} · ideal {formula} = {ideal:.0%}</sup>")
    fig.layout.annotations = _note(None if measured else "measured schedule: F/B intervals not reported yet", y=0.2)


# -- gradient-sync bytes per step (Config.compression) ---------------------------------------------------
def setup_sync_bytes(fig: go.Figure, world_size: int) -> None:
    _base_layout(fig, "Gradient sync: bytes sent per step per rank")
    for r in range(world_size):
        fig.add_scatter(name=f"rank {r}", mode="lines+markers", marker=dict(size=4), line=dict(color=_rank_color(r)))
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="bytes sent", rangemode="tozero")


def draw_sync_bytes(fig: go.Figure, snap: Snapshot) -> None:
    """StepMetrics.grad_sync_bytes as measured on each rank; layout changes (e.g. none → int8) marked as on the
    loss plot, so the two plots read side by side."""
    any_sync = False
    for r, trace in enumerate(fig.data):
        steps = snap.steps(r)
        any_sync |= any(m.grad_sync_bytes for m in steps)
        trace.x, trace.y = [m.step for m in steps], [m.grad_sync_bytes for m in steps]
        trace.customdata = [m.layout for m in steps]
        trace.hovertemplate = "step %{x}<br>%{y:,} B<br>%{customdata}<extra></extra>"
    fig.layout.shapes = [dict(type="line", x0=c.step - 0.5, x1=c.step - 0.5, y0=0, y1=1, yref="paper",
                              line=dict(color="#888", dash="dot", width=1)) for c in snap.layout_changes]
    labels = [dict(text=c.layout, x=c.step - 0.5, y=1, xref="x", yref="paper", showarrow=False, textangle=-90,
                   xanchor="left", yanchor="top", font=dict(size=11, color="#555")) for c in snap.layout_changes]
    steps = snap.steps(0)
    fig.layout.annotations = labels + _note(None if any_sync else "no data-parallel gradient sync measured yet "
                                            "(needs dp > 1 and telemetry)" if steps else "no steps yet", y=0.5)
# -- mixture of experts ------------------------------------------------------------------------------
def setup_expert_load(fig: go.Figure, world_size: int) -> None:
    _base_layout(fig, "Expert load")
    fig.add_heatmap(colorscale="Blues", colorbar=dict(title=dict(text="tokens", side="right"), thickness=12),
                    hovertemplate="layer %{y}, expert %{x}: %{z} assignments<extra></extra>")
    fig.update_layout(xaxis=dict(title="expert", dtick=1), yaxis=dict(title="MoE layer", autorange="reversed",
                                                                      type="category"))


def _no_experts_note(snap: Snapshot, steps: tuple[StepMetrics, ...]) -> str | None:
    cfg = snap.config
    if cfg is not None and not cfg.model.n_experts:
        return "dense model: no experts (a ModelConfig with n_experts, e.g. preset \"tiny-moe\")"
    return None if steps else "no steps yet"


def draw_expert_load(fig: go.Figure, snap: Snapshot) -> None:
    """The router's assignments per MoE layer × expert in the latest step's global batch, as the ranks agreed them."""
    steps = tuple(m for m in snap.steps(0) if m.expert_load)
    latest = steps[-1] if steps else None
    heat = fig.data[0]
    heat.z = [list(row) for row in latest.expert_load] if latest else None
    names = snap.config.model.moe_layers if latest and snap.config is not None else ()
    heat.y = [f"layer {i}" for i in names] if latest and len(names) == len(latest.expert_load) else None
    if latest is None:
        fig.layout.title.text = "Expert load"
    else:
        fig.layout.title.text = (f"Expert load, step {latest.step}<br><sup>assignments per layer × expert · dropped "
                                 f"per layer {list(latest.tokens_dropped)} · aux loss {latest.aux_loss:.4g}</sup>")
    fig.layout.annotations = _note(None if latest else _no_experts_note(snap, steps))
    _axes_visible(fig, latest is not None)


def setup_routing(fig: go.Figure, world_size: int) -> None:
    _base_layout(fig, "Balancing loss and dropped tokens")
    fig.add_scatter(name="loss", mode="lines", line=dict(color="#4C78A8"))
    fig.add_scatter(name="aux loss (balancing)", mode="lines", line=dict(color="#F58518"), yaxis="y2")
    # Dropped assignments as a layer × step heatmap: one fixed trace whatever the number of MoE layers.
    fig.add_heatmap(name="dropped", colorscale="Reds", yaxis="y3", showscale=False,
                    hovertemplate="step %{x}, layer %{y}: %{z} dropped<extra></extra>")
    fig.update_layout(yaxis=dict(title="loss", domain=[0.7, 1]),
                      yaxis2=dict(title="aux", domain=[0.4, 0.64], anchor="x"),
                      yaxis3=dict(title="dropped", domain=[0, 0.32], anchor="x", type="category",
                                  autorange="reversed"),
                      xaxis=dict(title=dict(text="step", standoff=4), anchor="y3"))


def draw_routing(fig: go.Figure, snap: Snapshot) -> None:
    """Main loss and aux loss per step, and the assignments dropped per MoE layer per step."""
    steps = tuple(m for m in snap.steps(0) if m.expert_load)
    x = [m.step for m in steps]
    fig.data[0].x, fig.data[0].y = x, [m.loss for m in steps]
    fig.data[1].x, fig.data[1].y = x, [m.aux_loss for m in steps]
    dropped = fig.data[2]
    layers = len(steps[-1].tokens_dropped) if steps else 0
    same_shape = [m for m in steps if len(m.tokens_dropped) == layers]
    dropped.x = [m.step for m in same_shape] or None
    dropped.z = [[m.tokens_dropped[i] for m in same_shape] for i in range(layers)] or None
    names = snap.config.model.moe_layers if snap.config is not None else ()
    dropped.y = [f"layer {i}" for i in names] if len(names) == layers else None
    if steps:
        last = steps[-1]
        fig.layout.title.text = (f"Balancing loss and dropped tokens<br><sup>step {last.step}: loss {last.loss:.4f}, "
                                 f"aux {last.aux_loss:.4g}, dropped per layer {list(last.tokens_dropped)}</sup>")
    else:
        fig.layout.title.text = "Balancing loss and dropped tokens"
    fig.layout.annotations = _note(None if steps else _no_experts_note(snap, steps))
    _axes_visible(fig, bool(steps))


# -- the set of panels, live and static ----------------------------------------------------------------
@dataclass(frozen=True)
class Panel:
    name: str
    setup: Callable[[go.Figure, int], None]
    draw: Callable[[go.Figure, Snapshot], None]


PANELS: tuple[Panel, ...] = (
    Panel("loss", setup_loss, draw_loss),
    Panel("throughput", setup_throughput, draw_throughput),
    Panel("memory", setup_memory, draw_memory),
    Panel("timeline", setup_timeline, draw_timeline),
    Panel("overlap", setup_overlap, draw_overlap),
    Panel("pipeline", setup_pipeline, draw_pipeline),
    Panel("sync_bytes", setup_sync_bytes, draw_sync_bytes),
    Panel("expert_load", setup_expert_load, draw_expert_load),
    Panel("routing", setup_routing, draw_routing),
)


def static_figures(snap: Snapshot, world_size: int) -> dict[str, go.Figure]:
    """Plain plotly figures of a snapshot (for reports and for looking at without widgets)."""
    figures = {}
    for panel in PANELS:
        fig = go.Figure()
        panel.setup(fig, world_size)
        panel.draw(fig, snap)
        figures[panel.name] = fig
    return figures


def _sync_widget_state(fig: go.FigureWidget) -> None:
    """Make the figure's synced state the whole current figure, as FigureWidget does when displayed itself.

    A FigureWidget inside a container is displayed by the container, so its
    synced state stays what it was at construction; the front end learns of
    later edits only from one-shot update messages, and those that arrive
    before plotly's 5 MB widget module has loaded are dropped. A view
    rendered later (or after a page reload) then draws an empty figure.
    Setting the state keeps every new view complete.
    """
    fig._widget_layout = copy.deepcopy(fig._layout_obj._props)
    fig._widget_data = copy.deepcopy(fig._data)


class LivePlots:
    """The panels as FigureWidgets, redrawn from a TelemetryStore when it changes.

    resync_s: how often, at most, the full figures are also sent as widget
    state (see `_sync_widget_state`); the updates in between are incremental.
    """

    def __init__(self, store: TelemetryStore, world_size: int, resync_s: float = 2.0) -> None:
        self.store = store
        self.resync_s = resync_s
        self._synced_at = float("-inf")
        self._unsynced = False
        self.figures: dict[str, go.FigureWidget] = {}
        for panel in PANELS:
            fig = go.FigureWidget()
            panel.setup(fig, world_size)
            self.figures[panel.name] = fig
        self._drawn_version = -1
        self._lock = threading.Lock()
        # Fixed-width figures in a wrapping row: two columns on a wide screen, one on a narrow one.
        self.widget = widgets.Box(list(self.figures.values()),
                                  layout=widgets.Layout(display="flex", flex_flow="row wrap", grid_gap="4px 8px",
                                                        width="100%"))
        self.refresh()

    def refresh(self, force: bool = False) -> bool:
        """Redraw every panel from a fresh snapshot if the store changed; True when something was drawn."""
        with self._lock:  # the ticker and a cell may both call it
            snap = self.store.snapshot()
            drawn = force or snap.version != self._drawn_version
            if drawn:
                for panel in PANELS:
                    fig = self.figures[panel.name]
                    with fig.batch_update():
                        panel.draw(fig, snap)
                self._drawn_version = snap.version
                self._unsynced = True
            if self._unsynced and time.monotonic() - self._synced_at >= self.resync_s:
                for fig in self.figures.values():
                    _sync_widget_state(fig)
                self._synced_at, self._unsynced = time.monotonic(), False
            return drawn


class Ticker:
    """Calls `tick` on a daemon thread when woken (and every `idle_s` anyway), at most once per `min_interval_s`.

    Holds only a weak reference to the tick's owner, so a dropped dashboard stops its thread.
    """

    def __init__(self, tick: Callable[[], object], min_interval_s: float = 0.3, idle_s: float = 1.0) -> None:
        self._tick = weakref.WeakMethod(tick) if hasattr(tick, "__self__") else (lambda: tick)
        self.min_interval_s, self.idle_s = min_interval_s, idle_s
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="workbench-ui-ticker", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.wake.wait(self.idle_s)
            self.wake.clear()
            tick = self._tick()
            if tick is None or self._stop.is_set():
                return
            try:
                tick()
            except Exception:  # noqa: BLE001 - a failed redraw must not end live updates
                log.exception("workbench dashboard refresh failed")
            del tick
            self._stop.wait(self.min_interval_s)

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
