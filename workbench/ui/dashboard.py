"""One widget for a Workbench: the controls on top, the run picker, the live plots in columns, kept current by one
timer thread."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from workbench.telemetry.runs import RunRecord, Snapshot
from workbench.ui.comparison import comparison_table
from workbench.ui.controls import Controls
from workbench.ui.live import LivePlots, Ticker
from workbench.ui.plan_panel import PlanPanel

if TYPE_CHECKING:
    from workbench.workbench import Workbench

_HEADER = ("<div style='font-size:14px;margin-bottom:2px'><b>workbench</b> — choose a layout, <b>Apply</b> it, "
           "<b>Train</b>; the plots follow what the ranks report. Each Apply starts a run; dotted lines on the loss "
           "mark where the layout changed, and <i>compare</i> draws earlier runs beside this one.</div>")

_live: "weakref.WeakKeyDictionary[Any, Dashboard]" = weakref.WeakKeyDictionary()


def run_label(run: RunRecord, current: RunRecord | None) -> str:
    """How the run picker names a run: distinct for every run (its id leads), with what tells runs apart."""
    steps = len(run.steps(0))
    now = " (now)" if current is not None and run.id == current.id else ""
    name = run.name if run.name.startswith(f"{run.id} · ") else f"{run.id} · {run.name}"  # a given name may repeat
    return f"{name}{now} · {run.origin} · {steps} steps from {run.first_step}"


class Dashboard(widgets.VBox):
    """Controls + run picker + plots of one Workbench; `close()` stops its updates.

    The plots redraw when the store changes (at most every `refresh_s`), and
    the status line once a second. A newer dashboard of the same Workbench
    takes over the live updates, so re-running a cell does not leave timers
    behind competing for the CPU the ranks train on; a closed Workbench's
    dashboard stops and says so.
    """

    def __init__(self, bench: "Workbench", refresh_s: float = 0.3) -> None:
        self.bench = bench
        self.store = bench.store
        self.controls = Controls(bench)
        self.plots = LivePlots(self.store, bench.pool.world_size)
        self.runs = widgets.SelectMultiple(description="compare", options=[], rows=3,
                                           style={"description_width": "initial"},
                                           layout=widgets.Layout(width="100%", max_width="720px"))
        """Earlier runs to draw beside the current one (loss, tokens/s, step time, memory)."""
        self.runs.observe(lambda change: self.plots.compare(change["new"]), names="value")
        self._runs_seen: tuple = ()
        self.planner = PlanPanel(bench, self.controls)
        planning = widgets.Accordion([self.planner.widget], titles=("Plan a large run",), selected_index=None)
        # The header also says whether the links are this machine's or an emulated cluster's (Workbench.links).
        self.header = widgets.HTML(_HEADER + _links_line(bench))
        self.predicted = widgets.HTML()
        """The last layout's estimate beside what its ranks measured, each quantity with its error
        (`workbench.ui.comparison`); redrawn when a step arrives or the layout changes."""
        self._predicted_version = -1
        predicted = widgets.Accordion([self.predicted], titles=("Predicted beside measured",), selected_index=0)
        super().__init__([self.header, self.controls.widget, self.runs, self.plots.widget, predicted, planning],
                         layout=widgets.Layout(width="100%"))
        self.add_class("workbench-dashboard")  # a handle for browser tests and user CSS
        self._refresh_runs()
        previous = _live.get(bench)
        if previous is not None:
            previous.stop()
        _live[bench] = self
        self.ticker = Ticker(self.tick, min_interval_s=refresh_s)
        self._unsubscribe = self.store.subscribe(lambda _record: self.ticker.wake.set())

    def tick(self) -> None:
        if self.bench.closed:
            self.controls.close("this Workbench is closed (a newer one replaced it, or bench.close()): its ranks "
                                "are gone. Its runs stay in the plots and in bench.runs.")
            self.stop()
            return
        snap = self.store.snapshot()  # one copy of the store for the picker and the table (the plots take their own)
        self._refresh_runs(snap)
        self.plots.refresh()
        self._refresh_predicted(snap)
        self.controls.refresh_status()
        self.planner.refresh_models()
        self.header.value = _HEADER + _links_line(self.bench)

    def _refresh_runs(self, snap: Snapshot | None = None) -> None:
        snap = self.store.snapshot() if snap is None else snap
        seen = tuple((r.id, len(r.steps(0))) for r in snap.runs)
        if seen == self._runs_seen:
            return
        self._runs_seen = seen
        chosen = tuple(v for v in self.runs.value if any(r.id == v for r in snap.runs))
        with self.runs.hold_trait_notifications():
            self.runs.options = [(run_label(r, snap.current), r.id) for r in reversed(snap.runs)]
            self.runs.value = chosen
        self.runs.layout.display = "flex" if len(snap.runs) > 1 else "none"  # one run: nothing to compare

    def _refresh_predicted(self, snap: Snapshot) -> None:
        if snap.version == self._predicted_version:
            return
        self._predicted_version = snap.version
        table = comparison_table(snap, self.bench.pool.device, self.bench.capabilities.get("name", ""))
        self.predicted.value = table or ("<div style='font-size:13px;color:#666'>The estimate for this layout "
                                         "appears beside its measurement after its first step with telemetry "
                                         "(on a GPU with a profile: h100, h200, a100; on CPU ranks).</div>")

    def stop(self) -> None:
        """Stop live updates (the widgets stay as they are)."""
        self.ticker.stop()
        self._unsubscribe()

    def close(self) -> None:
        self.stop()
        super().close()


def _links_line(bench: "Workbench") -> str:
    line = getattr(bench, "links", "")
    return f"<div style='font-size:13px'>{line}</div>" if line else ""


def dashboard(bench: "Workbench", refresh_s: float = 0.3) -> Dashboard:
    """Controls and live plots of `bench` as one widget; display it (the last expression of a cell)."""
    return Dashboard(bench, refresh_s)

