"""A session as one self-contained HTML file: every run's summary and Config, and the plots overlaying them."""

from __future__ import annotations

import dataclasses
import datetime
import html
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.config import Config
from workbench.telemetry import run_summary
from workbench.telemetry.runs import Snapshot
from workbench.ui.comparison import comparison_table
from workbench.ui.panels import PANELS, static_figures

if TYPE_CHECKING:
    from workbench.workbench import Workbench

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0 20px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
th { background: #f5f5f5; }
.plots { display: grid; grid-template-columns: repeat(2, minmax(0, 1fr)); gap: 8px; }
"""


def _config_rows(cfg: Config) -> dict[str, str]:
    row = {f.name: str(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name != "model"}
    return {"model": run_summary.model_name(cfg.model), **row}


def _table(rows: list[dict[str, Any]]) -> str:
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(run_summary.cell_text(v))}</td>" for v in r.values())
                   + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _runs_table(snap: Snapshot, beside: run_summary.Beside | None) -> str:
    if not snap.runs:
        return "<p>No layout was applied.</p>"
    return _table([s.row() for s in run_summary.summaries(snap.runs, beside)])


def _configs_table(snap: Snapshot) -> str:
    if not snap.runs:
        return ""
    return _table([{"run": str(r.id), "from step": str(r.first_step), "layout": r.layout, **_config_rows(r.config)}
                   for r in snap.runs])


def _summary(facts: dict[str, str], snap: Snapshot) -> str:
    trained = sum(len(r.steps(0)) for r in snap.runs)
    facts = {**facts, "runs": str(len(snap.runs)), "steps trained": str(trained)}
    steps = snap.steps(0)
    if steps:
        facts["last loss"] = f"{steps[-1].loss:.4f} (step {steps[-1].step}, {steps[-1].layout})"
    return "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                               for k, v in facts.items()) + "</table>"


def report(bench: "Workbench", path: str | Path = "run.html", title: str = "workbench session",
           beside: run_summary.Beside | None = None) -> Path:
    """Write `bench`'s runs and plots to `path` (plotly's JavaScript embedded once); returns the path.

    beside: extra columns per run (predictions) for the runs table; see `workbench.telemetry.run_summary`.
    """
    pool = bench.pool
    facts = {"ranks": str(pool.world_size), "device": pool.device, "backend": pool.backend or "?"}
    snap = bench.store.snapshot()
    comparison = comparison_table(snap, pool.device, bench.capabilities.get("name", ""))
    return write_report(snap, pool.world_size, facts, path, title, beside, comparison)


def report_from_metrics(metrics: str | Path, path: str | Path = "run.html", config: Config | str | Path | None = None,
                        title: str = "workbench run") -> Path:
    """The same page as `bench.report()`, from the JSONL file `python -m workbench.train` writes (every rank's
    StepMetrics); `config` (a Config or its config.json) is the run's Config."""
    from workbench.telemetry import jsonl
    from workbench.telemetry.store import TelemetryStore

    records = list(jsonl.read(metrics))
    store = TelemetryStore()
    if config is not None:
        cfg = config if isinstance(config, Config) else Config.load(config)
        first = min((m.step for m in records if m.rank == 0), default=0)
        store.start_run(cfg, first, continues=False, origin=f"python -m workbench.train ({metrics})")
    for m in records:
        store.add(m.rank, m)
    snap = store.snapshot()
    world_size = max(snap.ranks, default=0) + 1
    facts = {"ranks": str(world_size), "source": str(metrics)}
    return write_report(snap, world_size, facts, path, title)


def write_report(snap: Snapshot, world_size: int, facts: dict[str, str], path: str | Path,
                 title: str = "workbench session", beside: run_summary.Beside | None = None,
                 comparison: str = "") -> Path:
    """One self-contained HTML page of a snapshot's runs and plots, with `facts` in its summary table."""
    # Every run overlaid: the page is the record of the whole session.
    every = snap.compare([r.id for r in snap.runs])
    figures = static_figures(every, world_size, applicable_only=True)
    absent = "".join(f"<p><b>{html.escape(p.title)}</b> — {html.escape(why)}</p>" for p in PANELS
                     if (why := p.absent(every)) is not None)
    plots = []
    for i, fig in enumerate(figures.values()):
        # The first figure carries plotly.js; the others reuse it, so the file holds it once.
        plots.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0), default_width="100%"))
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    document = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1><p>written {stamp}</p>"
                f"{_summary(facts, snap)}<h2>Runs</h2>{_runs_table(snap, beside)}"
                f"<h2>Configs</h2>{_configs_table(snap)}{comparison}"
                f"<h2>Plots</h2><div class='plots'>{''.join(plots)}</div>{absent}</body></html>")
    path = Path(path)
    path.write_text(document, encoding="utf-8")
    return path
