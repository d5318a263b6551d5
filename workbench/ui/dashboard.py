"""One widget for a Workbench: the controls on top, the live plots below, kept current by one timer thread."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from workbench.ui.controls import Controls
from workbench.ui.plan_panel import PlanPanel
from workbench.ui.live import LivePlots, Ticker

if TYPE_CHECKING:
    from workbench.workbench import Workbench

_HEADER = ("<div style='font-size:15px;margin-bottom:4px'><b>workbench</b> — choose a layout, <b>Apply</b> it, "
           "<b>Train</b>; the plots below update as the ranks report. Dotted lines on the loss mark layout "
           "changes.</div>")

_live: "weakref.WeakKeyDictionary[Any, Dashboard]" = weakref.WeakKeyDictionary()


class Dashboard(widgets.VBox):
    """Controls + plots of one Workbench; `close()` stops its updates.

    The plots redraw when the store changes (at most every `refresh_s`), and
    the status line once a second. A newer dashboard of the same Workbench
    takes over the live updates, so re-running a cell does not leave timers
    behind competing for the CPU the ranks train on.
    """

    def __init__(self, bench: "Workbench", refresh_s: float = 0.3) -> None:
        self.bench = bench
        self.store = bench.store
        self.controls = Controls(bench)
        self.plots = LivePlots(self.store, bench.pool.world_size)
        self.planner = PlanPanel(bench, self.controls)
        planning = widgets.Accordion([self.planner.widget], titles=("Plan a large run",), selected_index=None)
        # The header also says whether the links are this machine's or an emulated cluster's (Workbench.links).
        self.header = widgets.HTML(_HEADER + _links_line(bench))
        super().__init__([self.header, self.controls.widget, self.plots.widget, planning],
                         layout=widgets.Layout(width="100%"))
        self.add_class("workbench-dashboard")  # a handle for browser tests and user CSS
        previous = _live.get(bench)
        if previous is not None:
            previous.stop()
        _live[bench] = self
        self.ticker = Ticker(self.tick, min_interval_s=refresh_s)
        self._unsubscribe = self.store.subscribe(lambda _record: self.ticker.wake.set())

    def tick(self) -> None:
        self.plots.refresh()
        self.controls.refresh_status()
        self.header.value = _HEADER + _links_line(self.bench)

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
