"""The notebook's user interface: controls that produce a Config, live plots that draw telemetry.

This package module stays light (no ipywidgets, plotly or IPython) so that
`import workbench` and ranks unpickling a `%%ranks` cell's function never pay
for them; the submodules import them.

    from workbench.ui.dashboard import dashboard
    from workbench.ui.report import report
    dashboard(bench)               # controls + live plots, one widget
    report(bench, "run.html")      # the session's plots and configs, one self-contained file
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_ipython_extension"]


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext workbench.ui` (or `%load_ext workbench`): registers the `%%ranks` cell magic."""
    from workbench.magics import load_ipython_extension as load

    load(ipython)
