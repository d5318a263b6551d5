"""Predicted beside measured, as the dashboard and `bench.report()` show it: the last layout's estimate next to the
steps its ranks measured (`workbench.compare` makes the rows; this only picks the hardware profile that
describes the ranks and writes the table)."""

from __future__ import annotations

import html
import statistics

from workbench.config import ConfigError
from workbench.hardware import profile_for, si
from workbench.telemetry.runs import Snapshot


def comparison_table(snap: Snapshot, device: str, device_name: str = "") -> str:
    """The last layout's predicted and measured figures with their errors, as an HTML table ("" before a step with
    telemetry, or for a GPU without a profile). On CPU ranks the profile is the matmul peak they measured for
    their MFU (no measuring, no torch, in the notebook)."""
    from workbench.tracing.estimate import estimate  # any model: traced where it is not the built-in one
    from workbench.compare import compare
    from workbench.estimate.predict import CPU_EFFICIENCY
    from workbench.hardware import cpu_with_peak

    profile = profile_for(device, device_name)
    if profile is None or not snap.layout_changes:
        return ""
    change = snap.layout_changes[-1]
    metrics = [m for r in snap.ranks for m in snap.steps(r) if m.step >= change.step and m.intervals]
    if not metrics:
        return ""
    if profile == "cpu":
        rated = [m for m in metrics if m.mfu and m.step_time_s]
        if not rated:
            return ""
        peak = rated[-1].flops / rated[-1].step_time_s / rated[-1].mfu
        hardware = cpu_with_peak(change.config.precision, peak)
        # The CPU model's step time is one stated assumption against this machine's load: say which, and how the
        # ranks did, so that a large step-time error reads as that, not as a wrong layout.
        note = (f"<p style='font-size:12px;color:#666'>On CPU the estimate runs compute at "
                f"{CPU_EFFICIENCY:.0%} of the matmul peak the ranks measured ({si(peak, 'FLOP/s')} a rank); they "
                f"ran at {statistics.median(m.mfu for m in rated):.0%} of it over their whole steps (MFU, median). "
                "Where the two differ, the step-time rows differ about as much, with nothing wrong in the layout: "
                "small matmuls and a busy machine run below the assumption. Memory and bytes do not depend on "
                "it.</p>")
    else:
        hardware, note = profile, ""
    title = f"Predicted beside measured ({html.escape(change.layout)}, {html.escape(profile)})"
    try:
        est = estimate(change.config, hardware)
    except ConfigError as e:  # a model the estimator cannot price: said, not guessed
        return f"<h2>{title}</h2><p style='font-size:12px;color:#666'>No prediction: {html.escape(str(e))}</p>"
    cells = [(r.quantity, _fmt(r.predicted, r.unit),
              _fmt(r.measured, r.unit) + ("" if r.measured_step is None else f" (at step {r.measured_step})"),
              "" if r.error_pct is None else f"{r.error_pct:+.1f}%")
             for r in compare(est, metrics)]
    head = "".join(f"<th>{h}</th>" for h in ("quantity", "predicted", "measured", "error"))
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in cells)
    return f"<h2>{title}</h2><table><tr>{head}</tr>{body}</table>{note}"


def _fmt(value: float, unit: str) -> str:
    return f"{value * 1e3:,.1f} ms" if unit == "s" else si(value, "B")
