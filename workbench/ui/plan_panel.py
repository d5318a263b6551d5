"""The plan panel: the estimator's best layouts for a large run, and a button that tries one on the local pool.

It draws what `wb.plan` and `plan.scale_layout` return; it computes nothing itself.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from workbench.config import PRESETS, Config, ModelConfig
from workbench.hardware import DATASHEETS
from workbench.plan import Plan, Scaled, scale_layout
from workbench.tracing.estimate import plan  # any model: traced where it is not the built-in one

if TYPE_CHECKING:
    from workbench.ui.controls import Controls
    from workbench.workbench import Workbench

_LABEL = {"description_width": "initial"}
APPLIED = "applied"
"""The model choice that plans the notebook's applied model (a Hugging Face or a module of one's own), traced."""
_HELP = ("<div style='font-size:13px'>Rank every layout of a model on many GPUs by the estimator's predicted step "
         "time (only layouts whose busiest rank fits the device's memory). <b>Apply locally</b> tries the chosen "
         "layout on this notebook's ranks and model: the degrees shrink dp first, then pp, then cp, then tp, and every "
         "change is listed before you apply.</div>")


class PlanPanel:
    """Inputs for `wb.plan`, its top layouts as a table, and the chosen one applied (scaled) to the local pool."""

    def __init__(self, bench: "Workbench", controls: "Controls | None" = None, *, model: str = "8b",
                 hardware: str = "h100", gpus: int = 64, global_batch: int = 256, seq_len: int = 4096,
                 top: int = 8) -> None:
        self.bench, self.controls, self.top = bench, controls, top
        self.plan: Plan | None = None
        small = dict(style=_LABEL, layout=widgets.Layout(width="170px"))
        self.model = widgets.Dropdown(description="model", options=self._model_options(), value=model, **small)
        self.hardware = widgets.Dropdown(description="hardware", options=list(DATASHEETS), value=hardware, **small)
        self.gpus = widgets.BoundedIntText(description="GPUs", value=gpus, min=1, max=65536, **small)
        self.global_batch = widgets.BoundedIntText(description="global batch", value=global_batch, min=1,
                                                   max=1 << 20, **small)
        self.seq_len = widgets.BoundedIntText(description="seq_len", value=seq_len, min=1, max=1 << 20, **small)
        self.precision = widgets.Dropdown(description="precision", options=["bf16", "fp16", "fp32"], value="bf16",
                                          **small)
        self.plan_button = widgets.Button(description="Plan", button_style="primary")
        self.table = widgets.HTML()
        self.choice = widgets.Dropdown(description="layout", options=[], style=_LABEL,
                                       layout=widgets.Layout(width="420px"))
        self.scaling = widgets.HTML()
        self.apply_button = widgets.Button(description="Apply locally", disabled=True)
        self.status = widgets.HTML()
        self.plan_button.on_click(lambda _b: self.run_plan())
        self.apply_button.on_click(lambda _b: self.apply())
        self.choice.observe(lambda _c: self._show_scaling(), names="value")
        self.widget = widgets.VBox([
            widgets.HTML(_HELP),
            widgets.HBox([self.model, self.hardware, self.gpus]),
            widgets.HBox([self.global_batch, self.seq_len, self.precision, self.plan_button]),
            self.table, widgets.HBox([self.choice, self.apply_button]), self.scaling, self.status])

    def _model_options(self) -> list[tuple[str, str]]:
        """The presets, and the applied model where it is another (the picker's Hugging Face folder or factory)."""
        options = [(name, name) for name in PRESETS]
        applied = self.bench.config.model if self.bench.config is not None else None
        if applied is not None and not isinstance(applied, ModelConfig):
            options.append((f"applied: {getattr(applied, 'name', None) or type(applied).__name__}", APPLIED))
        return options

    def refresh_models(self) -> None:
        """Offer the applied model once one other than the built-in is applied (the dashboard calls this)."""
        options = self._model_options()
        if options != list(self.model.options):
            chosen = self.model.value if self.model.value in {v for _, v in options} else "8b"
            with self.model.hold_trait_notifications():
                self.model.options, self.model.value = options, chosen

    def run_plan(self) -> Plan | None:
        model = self.bench.config.model if self.model.value == APPLIED else self.model.value
        try:
            self.plan = plan(model, self.hardware.value, self.gpus.value, self.global_batch.value,
                             seq_len=self.seq_len.value, precision=self.precision.value)
        except Exception as e:  # noqa: BLE001 - shown inline: a bad input must not leave a traceback in the cell
            self.plan = None
            self.table.value, self.status.value = "", _line(False, str(e))
            self.choice.options, self.apply_button.disabled = [], True
            return None
        self.table.value = _table(self.plan, self.top)
        candidates = self.plan.top(self.top)
        self.choice.options = [(choice_label(row), i) for i, row in enumerate(self.plan.rows(self.top))]
        self.choice.value = 0 if candidates else None
        self.apply_button.disabled = not candidates
        self._show_scaling()
        return self.plan

    def scaled(self) -> Scaled | None:
        """The chosen layout on this pool's ranks and the notebook's model (from `plan.scale_layout`)."""
        if self.plan is None or self.choice.value is None:
            return None
        chosen = self.plan.top(self.top)[self.choice.value].config
        onto = self.bench.config or Config()
        return scale_layout(chosen, self.bench.pool.world_size, onto)

    def _show_scaling(self) -> None:
        try:
            scaled = self.scaled()
        except Exception as e:  # noqa: BLE001 - e.g. the local model admits none of the layout's axes
            self.scaling.value, self.apply_button.disabled = _line(False, f"cannot run here: {e}"), True
            return
        if scaled is None:
            self.scaling.value = ""
            return
        self.apply_button.disabled = False
        self.scaling.value = (f"<div style='font-size:13px'>On these {self.bench.pool.world_size} ranks with the "
                              f"notebook's model: <b>{html.escape(scaled.config.layout)}</b> — "
                              f"{html.escape(scaled.describe())}</div>")

    def apply(self) -> Any:
        """Apply the scaled layout: through the dashboard's controls when there are some (their status shows it)."""
        scaled = self.scaled()
        if scaled is None:
            return None
        if self.controls is not None:
            self.controls.set_config(scaled.config)
            self.controls.validate()
            self.status.value = _line(True, f"sent {scaled.config.layout} to the controls; see their status")
            return self.controls.apply()
        try:
            info = self.bench.apply(scaled.config)
        except Exception as e:  # noqa: BLE001 - shown inline
            self.status.value = _line(False, str(e))
            return None
        self.status.value = _line(True, f"applied {scaled.config.layout}")
        return info


COLUMNS = ("#", "layout", "micro", "step", "tokens/s/GPU", "MFU", "memory/rank")
"""What the table shows of `Plan.rows`: the layout string already names the degrees, ZeRO stage, schedule and
recompute, so their own columns would only widen the table past the notebook's width."""


def choice_label(row: dict[str, str]) -> str:
    """A dropdown entry that tells a layout from the next: two rows may share a layout string (it omits the
    gradient-accumulation micro-batches), never all of what is shown here."""
    micro = f" · micro {row['micro']}" if row["pp"] == "1" and row["micro"] != "1" else ""
    return f"#{row['#']} {row['layout']}{micro} · {row['step']} · {row['memory/rank']}"


def _table(p: Plan, top: int) -> str:
    rows = [{k: r[k] for k in COLUMNS} for r in p.rows(top)]
    summary = ", ".join(f"{k}: {v}" for k, v in p.refusal_summary().items())
    foot = (f"<div style='font-size:12px'>{len(p.ranked)} of {len(p.ranked) + len(p.refused)} layouts fit; refused "
            f"— {html.escape(summary) or 'none'}. Predicted by {html.escape(p.basis)}.</div>")
    if not rows:
        return "<b>no layout fits</b>" + foot
    cell = "padding:2px 6px;text-align:left;vertical-align:top"
    head = "".join(f"<th style='{cell}'>{html.escape(k)}</th>" for k in rows[0])
    # The layout may break at its "·": the table keeps to the notebook's width instead of scrolling sideways.
    body = "".join("<tr>" + "".join(f"<td style='{cell}'>{html.escape(v).replace('·', '·<wbr>')}</td>"
                                    for v in r.values()) + "</tr>" for r in rows)
    return (f"<table class='workbench-plan-table' style='font-size:12px;border-collapse:collapse;max-width:100%'>"
            f"<tr>{head}</tr>{body}</table>{foot}")


def _line(ok: bool, text: str) -> str:
    color = "#2a7" if ok else "#c33"
    return f"<div style='color:{color};font-size:13px'>{html.escape(text)}</div>"
