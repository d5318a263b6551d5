"""Mixture of experts: the router's load per layer × expert, the balancing loss and the dropped tokens."""

from __future__ import annotations

import plotly.graph_objects as go

from workbench.config import ModelConfig
from workbench.telemetry.events import StepMetrics
from workbench.telemetry.runs import Snapshot
from workbench.ui.panels.style import axes_visible, base_layout, note


def setup_expert_load(fig: go.Figure, world_size: int) -> None:
    base_layout(fig, "Expert load")
    fig.add_heatmap(colorscale="Blues", colorbar=dict(title=dict(text="tokens", side="right"), thickness=12),
                    hovertemplate="layer %{y}, expert %{x}: %{z} assignments<extra></extra>")
    fig.update_layout(xaxis=dict(title="expert", dtick=1), yaxis=dict(title="MoE layer", autorange="reversed",
                                                                      type="category"))


def _no_experts_note(snap: Snapshot, steps: tuple[StepMetrics, ...]) -> str | None:
    cfg = snap.config
    if cfg is not None and not cfg.model.n_experts:
        return "dense model: no experts (a ModelConfig with n_experts, e.g. preset \"tiny-moe\")"
    return None if steps else "no steps yet"


def _moe_layers(snap: Snapshot) -> tuple[int, ...]:
    """The built-in model's mixture-of-experts blocks, by index (another model's router reports no load)."""
    model = snap.config.model if snap.config is not None else None
    return model.moe_layers if isinstance(model, ModelConfig) else ()


def draw_expert_load(fig: go.Figure, snap: Snapshot) -> None:
    """The router's assignments per MoE layer × expert in the latest step's global batch, as the ranks agreed them."""
    steps = tuple(m for m in snap.steps(0) if m.expert_load)
    latest = steps[-1] if steps else None
    heat = fig.data[0]
    heat.z = [list(row) for row in latest.expert_load] if latest else None
    names = _moe_layers(snap) if latest else ()
    heat.y = [f"layer {i}" for i in names] if latest and len(names) == len(latest.expert_load) else None
    if latest is None:
        fig.layout.title.text = "Expert load"
    else:
        fig.layout.title.text = (f"Expert load, step {latest.step}<br><sup>assignments per layer × expert · dropped "
                                 f"per layer {list(latest.tokens_dropped)} · aux loss {latest.aux_loss:.4g}</sup>")
    fig.layout.annotations = note(None if latest else _no_experts_note(snap, steps))
    axes_visible(fig, latest is not None)


def setup_routing(fig: go.Figure, world_size: int) -> None:
    base_layout(fig, "Balancing loss and dropped tokens")
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
    names = _moe_layers(snap)
    dropped.y = [f"layer {i}" for i in names] if len(names) == layers else None
    if steps:
        last = steps[-1]
        fig.layout.title.text = (f"Balancing loss and dropped tokens<br><sup>step {last.step}: loss {last.loss:.4f}, "
                                 f"aux {last.aux_loss:.4g}, dropped per layer {list(last.tokens_dropped)}</sup>")
    else:
        fig.layout.title.text = "Balancing loss and dropped tokens"
    fig.layout.annotations = note(None if steps else _no_experts_note(snap, steps))
    axes_visible(fig, bool(steps))
