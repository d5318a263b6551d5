"""report(): the session's plots and layouts as one self-contained HTML file."""

from __future__ import annotations

import re

import workbench as wb
from tests.ui.fakes import fake_workbench
from workbench.ui.panels import PANELS
from workbench.ui.report import report


def test_one_file_with_plotly_once_every_panel_and_every_layout(tmp_path):
    bench = fake_workbench(step_s=0.0)
    bench.apply(wb.Config(dp=2, zero=1))
    bench.train(5).wait()
    bench.apply(wb.Config(tp=2, precision="bf16"))
    bench.train(5).wait()
    path = report(bench, tmp_path / "run.html")
    text = path.read_text()
    assert text.count("plotly.js v") == 1  # the library's banner: embedded exactly once
    assert not re.search(r"<script[^>]+src=", text)  # nothing fetched from elsewhere
    # Every panel the last layout (tp2, dense) has is drawn; the others say why in one line.
    assert text.count("Plotly.newPlot(") == len(PANELS) - 4
    for absent in ("tp2·bf16 has no pipeline", "no data-parallel gradient sync", "dense model"):
        assert absent in text
    for expected in ("dp2·zero1", "tp2·bf16", "<th>from step</th>", "<td>5</td>", "tiny", "steps trained",
                     "<td>resharded from run 1</td>"):
        assert expected in text, expected
    # Predicted beside measured, as the dashboard shows it: the table, and the estimate's bars in the memory plot.
    assert "Predicted beside measured (tp2·bf16, cpu)" in text and "memory: activations" in text
    assert '"predicted"' in text


def test_a_session_without_steps_still_writes_a_readable_file(tmp_path):
    path = report(fake_workbench(), tmp_path / "empty.html")
    text = path.read_text()
    assert "No layout was applied" in text and "no steps yet" in text
