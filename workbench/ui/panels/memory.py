"""Memory per rank by category: now (end of step and peak) beside what the estimator predicted for the layout, and
the peak of each run picked for comparison."""

from __future__ import annotations

import plotly.graph_objects as go

from workbench.compare import AT_REST, Comparison, measured_memory
from workbench.hardware import si
from workbench.telemetry.runs import Snapshot
from workbench.ui.panels.style import (
    MEMORY_CATEGORIES,
    MEMORY_COLORS,
    axes_visible,
    base_layout,
    compared_runs,
    note,
)


def setup_memory(fig: go.Figure, world_size: int) -> None:
    base_layout(fig, "Memory per rank by category")
    for cat in MEMORY_CATEGORIES:
        # "other" is the rest of the process (on CPU the Python and torch runtime, hundreds of MB) and would
        # flatten the categories a layout changes; it starts hidden, one click on its legend entry away.
        fig.add_bar(name=cat, marker_color=MEMORY_COLORS[cat], visible="legendonly" if cat == "other" else True)
    fig.update_layout(barmode="stack", yaxis=dict(title="bytes", tickformat=".2s", ticksuffix="B"))


def draw_memory(fig: go.Figure, snap: Snapshot) -> None:
    latest = snap.common_latest()
    ranks = [r for r in sorted(latest) if latest[r].memory or latest[r].peak_memory]
    # Per rank: the bytes held at the end of the latest step, each category's peak during it and the estimate (its
    # parameters and optimizer at rest, its gradients and activations at their peak, as `compare` reads both); then,
    # for each run picked to compare, the peak of its last step.
    predicted = snap.current.predicted_memory if snap.current is not None else {}
    bars = [(r, label, d) for r in ranks
            for label, d in (("end of step", latest[r].memory), ("peak", latest[r].peak_memory),
                             ("predicted", predicted.get(r))) if d]
    # A predicted bar's hover names the figure it predicts and its error, as the comparison table does.
    versus = {r: {cat: Comparison(cat, "B", predicted[r].get(cat, 0), measured_memory(latest[r], cat))
                  for cat in predicted[r]} for r in ranks if predicted.get(r)}
    compared = [(run, snap.common_latest(run)) for run in compared_runs(snap)]
    for run, last in compared:
        bars += [(r, f"run {run.id} peak", last[r].peak_memory) for r in sorted(last)
                 if last[r].peak_memory]
    x = [[f"rank {r}" for r, _, _ in bars], [label for _, label, _ in bars]]
    # The estimate's bars are hatched: the same colours, read as a prediction, not a measurement.
    hatch = ["/" if label == "predicted" else "" for _, label, _ in bars]
    for cat, trace in zip(MEMORY_CATEGORIES, fig.data):
        trace.x = x
        trace.y = [d.get(cat) for _, _, d in bars]
        trace.marker.pattern.shape = hatch
        trace.customdata = [_against(versus[r].get(cat)) if label == "predicted" else "" for r, label, _ in bars]
        trace.hovertemplate = f"{cat}: %{{y:.3s}}B%{{customdata}}<extra>%{{x}}</extra>"
    step = next(iter(latest.values())).step if latest else None
    title = f"Memory per rank by category, step {step}" if ranks else "Memory per rank by category"
    sub = "hatched: predicted · 'other' (the runtime) is hidden: click it"
    # The activation meter samples a settled layout's steps: an older figure says when it was measured.
    older = sorted({m.activations_step for m in latest.values() if m.activations_step not in (None, m.step)})
    if older and ranks:
        sub = f"activations measured at step {', '.join(map(str, older))} · " + sub
    if compared:
        sub = "beside: " + ", ".join(f"run {run.id} = {run.name}" for run, _ in compared) + " · " + sub
    fig.layout.title.text = f"{title}<br><sup>{sub}</sup>" if bars else title
    missing = None if bars else ("no steps yet" if not latest else "memory by category: not reported yet")
    fig.layout.annotations = note(missing)
    axes_visible(fig, bool(bars))


def _against(row: Comparison | None) -> str:
    if row is None:
        return ""
    error = "" if row.error_pct is None else f" ({row.error_pct:+.1f}%)"
    read = "at rest" if row.quantity in AT_REST else "at its peak"
    return f"<br>measured {si(row.measured, 'B')} {read}{error}"
