"""The panels live in a notebook: FigureWidgets redrawn from a TelemetryStore as the ranks report.

`LivePlots` holds one FigureWidget per panel (`workbench.ui.panels`) and
redraws them from a store snapshot, one `batch_update` per figure; a `Ticker`
calls it at most a few times a second from a background thread, so training
never waits for the browser. The figures sit in a grid of columns at least
`MIN_COLUMN_PX` wide (two beside JupyterLab's open file browser at 1280 px);
a panel the layout has nothing for is one line under the grid instead.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable

import html

import ipywidgets as widgets
import plotly.graph_objects as go

from workbench.telemetry.store import TelemetryStore
from workbench.ui.figure import LiveFigure
from workbench.ui.panels import PANELS
from workbench.ui.panels.style import new_figure

log = logging.getLogger("workbench.ui")

MIN_COLUMN_PX = 380
"""The narrowest a plot column gets before the grid drops to fewer columns."""


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
        self.compared: tuple[int, ...] = ()
        """Ids of the runs drawn beside the current history (the dashboard's run picker sets them)."""
        self.figures: dict[str, go.FigureWidget] = {}
        for panel in PANELS:
            # Set up as a plain figure first: the widget's first state then holds every trace, so the page never
            # sees a figure with fewer traces than the updates that follow name.
            fig = new_figure()
            panel.setup(fig, world_size)
            self.figures[panel.name] = LiveFigure(fig)
        self.absent: dict[str, str] = {}
        """Panels the current layout has nothing for, with the line said instead of drawing them."""
        self._drawn_version = -1
        self._lock = threading.Lock()
        # One cell per figure, hidden rather than removed when its panel does not apply: a figure's page view is
        # made once and kept (plotly's view keeps listening to its model after it is removed from the page).
        self.cells = {name: widgets.Box([fig], layout=widgets.Layout(min_width="0")) for name, fig in self.figures.items()}
        self.grid = widgets.GridBox(list(self.cells.values()), layout=widgets.Layout(
            grid_template_columns=f"repeat(auto-fill, minmax({MIN_COLUMN_PX}px, 1fr))", grid_gap="4px 8px",
            width="100%"))
        self.grid.add_class("workbench-plots")
        self.absent_lines = widgets.HTML()
        self.widget = widgets.VBox([self.grid, self.absent_lines], layout=widgets.Layout(width="100%"))
        self.refresh()

    def compare(self, run_ids: tuple[int, ...] | list[int]) -> None:
        """Draw these runs beside the current history (and redraw now)."""
        self.compared = tuple(run_ids)
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> bool:
        """Redraw every panel from a fresh snapshot if the store changed; True when something was drawn."""
        with self._lock:  # the ticker and a cell may both call it
            snap = self.store.snapshot().compare(self.compared)
            drawn = force or snap.version != self._drawn_version
            if drawn:
                for panel in PANELS:
                    fig = self.figures[panel.name]
                    with fig.batch_update():
                        panel.draw(fig, snap)
                self._show(snap)
                self._drawn_version = snap.version
                self._unsynced = True
            if self._unsynced and time.monotonic() - self._synced_at >= self.resync_s:
                for fig in self.figures.values():
                    _sync_widget_state(fig)
                self._synced_at, self._unsynced = time.monotonic(), False
            return drawn

    def _show(self, snap) -> None:
        absent = {p.name: reason for p in PANELS if (reason := p.absent(snap)) is not None}
        if absent == self.absent and self._drawn_version >= 0:
            return
        self.absent = absent
        for name, cell in self.cells.items():
            cell.layout.display = "none" if name in absent else "block"
        self.absent_lines.value = "".join(
            f"<div style='color:#666;font-size:12px;line-height:1.5'><b>{html.escape(p.title)}</b> — "
            f"{html.escape(absent[p.name])}</div>" for p in PANELS if p.name in absent)


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
