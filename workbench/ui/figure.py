"""Plotly FigureWidgets that share one copy of plotly's widget code per page and follow their container's width.

A plain `go.FigureWidget` carries plotly's whole front-end bundle (~5 MB of JavaScript) as its own anywidget
module: a dashboard of nine figures sends 45 MB to the browser, which parses it nine times, and an executed
notebook saves it nine times in its widget state. Here the bundle travels once, in one `PlotlyBundle`
widget per kernel; each `LiveFigure`'s module is a few lines that wait for that bundle and hand over to
plotly's own widget code (the same model and view, so every plotly feature works as in a FigureWidget).

The few lines also watch the figure's container: plotly's anywidget view sizes a figure once, when it is
first drawn, so a figure drawn while its cell was narrow (or hidden) would keep that width. Watching the
container lets the dashboard's grid give each figure its column's width at any window size.
"""

from __future__ import annotations

import threading

import anywidget
import plotly
import plotly.graph_objects as go
import traitlets
from plotly.basewidget import BaseFigureWidget

_KEY = "__workbenchPlotlyWidget_" + plotly.__version__.replace(".", "_")
"""Where the page keeps the loaded bundle (a promise of its module): one per plotly version."""

_LOADER = """
export default {
  initialize({ model }) {
    if (!globalThis.%(key)s) {
      const url = URL.createObjectURL(new Blob([model.get("bundle")], { type: "text/javascript" }));
      globalThis.%(key)s = import(url);
    }
  },
};
""" % {"key": _KEY}

# initialize() returns at once: anywidget drops every message of a model whose initialize takes over 2 s, and
# parsing 5 MB on a busy machine may take longer. A figure whose bundle was not there yet misses the updates
# sent until it is (plotly's model applies them to its copy of the figure); the full figure the kernel sends
# as state every few seconds (ui.live._sync_widget_state) then redraws it once, with Plotly.react.
_FIGURE = """
async function bundle() {
  for (let i = 0; i < 2400 && !globalThis.%(key)s; i++) await new Promise((r) => setTimeout(r, 25));
  if (!globalThis.%(key)s) throw new Error("workbench: plotly's widget code did not arrive (PlotlyBundle)");
  return globalThis.%(key)s;
}
export default () => {
  let inner = null;
  let missed = false;
  const ready = (ctx) => bundle().then((mod) => {
    if (inner === null) { inner = mod.default(); inner.initialize({ model: ctx.model }); }
    return inner;
  });
  return {
    initialize(ctx) {
      missed = !globalThis.%(key)s;
      ready(ctx);
    },
    async render(ctx) {
      const figure = await ready(ctx);
      const cleanup = figure.render(ctx);
      const el = ctx.el;
      if (missed) {
        const heal = () => {
          if (globalThis.Plotly && el._fullLayout) {
            globalThis.Plotly.react(el, structuredClone(ctx.model.get("_widget_data")),
                                    structuredClone(ctx.model.get("_widget_layout")));
          }
          ctx.model.off("change:_widget_layout", heal);
        };
        ctx.model.on("change:_widget_layout", heal);
      }
      let width = 0;
      const observer = new ResizeObserver(() => {
        const now = el.clientWidth;
        if (now > 0 && now !== width && globalThis.Plotly && el._fullLayout) {
          width = now;
          globalThis.Plotly.Plots.resize(el);
        }
      });
      observer.observe(el);
      return () => { observer.disconnect(); if (typeof cleanup === "function") cleanup(); };
    },
  };
};
""" % {"key": _KEY}


class PlotlyBundle(anywidget.AnyWidget):
    """Carries plotly's widget bundle to the page once; never displayed."""

    _esm = _LOADER
    bundle = traitlets.Unicode().tag(sync=True)


_bundle: PlotlyBundle | None = None
_bundle_lock = threading.Lock()


def plotly_bundle() -> PlotlyBundle:
    """The kernel's one bundle carrier, made (again, if something closed it) when first needed."""
    global _bundle
    with _bundle_lock:
        if _bundle is None or _bundle.comm is None:
            source = BaseFigureWidget._esm
            text = source.read_text() if hasattr(source, "read_text") else str(source)
            _bundle = PlotlyBundle(bundle=text)
        return _bundle


class LiveFigure(go.FigureWidget):
    """A FigureWidget whose front-end code is the page's one `PlotlyBundle` (see the module docstring)."""

    _esm = _FIGURE

    def __init__(self, *args, **kwargs) -> None:
        plotly_bundle()  # before this figure's model reaches the page, so the bundle is on its way first
        super().__init__(*args, **kwargs)
