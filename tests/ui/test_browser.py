"""A real browser: JupyterLab (file browser open) shows the dashboard; its buttons reshard and train, the run picker
overlays an earlier run, Restart asks first; at 1280 and 1920 px the plots stand in two or more columns, no
element overlaps another, and the plan table needs no sideways scroll.

Needs Chromium (installed with apt-get when missing and possible) and the playwright package (no browser
download: Debian's chromium is driven). One browser session serves both widths. Writes
artifacts/dashboard-1280.png and artifacts/dashboard-1920.png (docs/dashboard.png, which the README shows, is
the 1280 one).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.local_launch import free_port

pytestmark = [pytest.mark.processes, pytest.mark.mostly_waits, pytest.mark.browser, pytest.mark.slow,
              pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
# Written where git does not look, so a test run never dirties the checkout; docs/dashboard.png (the README's)
# is a copy of one taken this way.
ARTIFACTS = REPO / "artifacts"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
WIDTHS = (1280, 1920)

# What a user runs before touching the dashboard: a small trained model, then the dashboard.
CELLS = [
    "import workbench as wb\n"
    "bench = wb.Workbench(2)\n"
    "bench.apply(wb.Config(dp=2, batch_size=16, seq_len=64))\n"
    "bench.train(6).wait()\n"
    "board = bench.dashboard()\n"
    "board",
    "print('setup done')",
]


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None and shutil.which("apt-get") and os.geteuid() == 0:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        # A fresh machine's package lists may be missing or stale: refresh them once, then install.
        for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
            subprocess.run(command, capture_output=True, timeout=600, env=env)
        path = shutil.which("chromium")
    if path is None:
        pytest.skip("no chromium, and it cannot be installed here (apt-get install chromium needs root and apt)")
    return path


@pytest.fixture
def lab(tmp_path):
    """JupyterLab on 127.0.0.1 with a token, over a small notebook, with no news pop-up or update check."""
    import nbformat  # not at the module's top: see tests/test_notebooks.py

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    (tmp_path / "notebooks").mkdir()
    nbformat.write(nb, tmp_path / "notebooks" / "dashboard.ipynb")
    settings = tmp_path / "lab-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false",
                                                                          "checkForUpdates": False}))
    token, port = secrets.token_hex(16), free_port()
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "lab-settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"), JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), OMP_NUM_THREADS="1")
    log = open(tmp_path / "lab.log", "w")
    # `-m jupyterlab`, not `jupyter lab`: the `jupyter-lab` script may belong to another environment (a copied venv).
    proc = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
                             f"--port={port}", f"--IdentityProvider.token={token}", "--allow-root",
                             "--LabApp.expose_app_in_browser=True", f"--ServerApp.root_dir={tmp_path}",
                             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
                time.sleep(0.3)
        yield url, token, tmp_path
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


_PLOTS_JS = """() => Array.from(document.querySelectorAll('.workbench-dashboard .js-plotly-plot')).map(gd => ({
    title: (gd.layout.title && gd.layout.title.text) || '',
    points: gd.data.map(t => (t.y || []).length),
    notes: (gd.layout.annotations || []).map(a => a.text)}))"""

_MEMORY_BARS_JS = """() => { const gd = Array.from(document.querySelectorAll('.workbench-dashboard .js-plotly-plot'))
    .find(g => ((g.layout.title && g.layout.title.text) || '').startsWith('Memory per rank'));
    return gd && gd.data[0].x ? Array.from(gd.data[0].x[1]) : []; }"""
# Boxes of what must not overlap: the dashboard's parts, the plot cells, the inputs of each line of controls,
# and inside every plot its legend, axis titles and the loss plot's layout labels.
_BOXES_JS = """() => {
  const box = (e) => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const shown = (e) => { const r = e.getBoundingClientRect(); return r.width > 0 && r.height > 0; };
  const board = document.querySelector('.workbench-dashboard');
  const groups = {};
  groups.parts = Array.from(board.children).filter(shown).map(box);
  groups.cells = Array.from(board.querySelector('.workbench-plots').children).filter(shown).map(box);
  board.querySelectorAll('.workbench-controls > .widget-hbox').forEach((line, i) => {
    groups['controls line ' + i] = Array.from(line.children).filter(shown).map(box);
  });
  board.querySelectorAll('.workbench-plots .js-plotly-plot').forEach((gd, i) => {
    const title = (gd.layout.title && gd.layout.title.text || '').split('<')[0];
    const parts = ['.legend', '.xtitle', '.infolayer .g-gtitle'].flatMap(s => Array.from(gd.querySelectorAll(s)));
    groups['plot ' + title] = parts.filter(shown).map(box);
    if (title.startsWith('Loss')) groups['loss labels'] = Array.from(gd.querySelectorAll('.annotation')).filter(shown).map(box);
  });
  const plotsWidth = board.querySelector('.workbench-plots').getBoundingClientRect().width;
  const figures = Array.from(board.querySelectorAll('.workbench-plots .js-plotly-plot')).map(gd => {
    let cell = gd;
    while (cell.parentElement && !cell.parentElement.classList.contains('workbench-plots')) cell = cell.parentElement;
    const svg = gd.querySelector('.main-svg');
    return {width: svg ? svg.getBoundingClientRect().width : 0, cell: cell.getBoundingClientRect().width};
  });
  const table = board.querySelector('.workbench-plan-table');
  const tableBox = table ? table.parentElement : null;
  return {groups, plotsWidth, figures,
          boardScroll: [board.scrollWidth, board.clientWidth],
          tableScroll: tableBox ? [tableBox.scrollWidth, tableBox.clientWidth] : null,
          tableRight: table ? table.getBoundingClientRect().right : null,
          boardRight: board.getBoundingClientRect().right,
          sidebar: (document.querySelector('#jp-left-stack') || {}).offsetWidth || 0};
}"""


def overlaps(boxes: list[list[float]], tolerance: float = 1.0) -> list[tuple[int, int]]:
    """Pairs of boxes (left, top, right, bottom) that overlap by more than `tolerance` px both ways."""
    out = []
    for i, a in enumerate(boxes):
        for j, b in enumerate(boxes[i + 1:], i + 1):
            if min(a[2], b[2]) - max(a[0], b[0]) > tolerance and min(a[3], b[3]) - max(a[1], b[1]) > tolerance:
                out.append((i, j))
    return out


def test_overlaps_finds_overlapping_boxes_only():
    assert overlaps([[0, 0, 10, 10], [10, 0, 20, 10], [5, 5, 15, 15]]) == [(0, 2), (1, 2)]


def _plot(page, title_start: str) -> dict:
    return next(p for p in page.evaluate(_PLOTS_JS) if p["title"].startswith(title_start))


def _log(what: str, _start=[]) -> None:
    # Printed progress is shown with a failure: it says which stage of the walk-through stalled.
    _start.append(_start[0] if _start else time.monotonic())
    print(f"[{time.monotonic() - _start[0]:6.1f} s] {what}", flush=True)


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.3)


def test_the_dashboard_in_a_real_browser_at_two_widths(lab):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    chromium = _chromium()
    url, token, root = lab
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(str(root / "profile"), executable_path=chromium, headless=True,
                                                       args=CHROMIUM_ARGS,
                                                       viewport={"width": WIDTHS[0], "height": 1000})
        try:
            page = browser.pages[0] if browser.pages else browser.new_page()
            page.set_default_timeout(60_000)
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type in ("error", "warning")
                    else None)
            if os.environ.get("WORKBENCH_BROWSER_LOG"):  # to watch a run: the console as it happens
                def show(m) -> None:
                    stacks = []
                    if m.type == "error":
                        for arg in m.args:
                            try:
                                stacks.append(arg.evaluate("e => (e && e.stack) || ''")[:1500])
                            except Exception:  # noqa: BLE001 - a debugging aid only
                                pass
                    print(f"[console {m.type}] {m.text[:300]} {' | '.join(x for x in stacks if x)}", flush=True)

                page.on("console", show)
            page.on("pageerror", lambda e: console.append(f"page error: {e}"))
            try:
                _walk_through(page, url, token)
            except BaseException:
                page.screenshot(path=str(root / "failure.png"))
                print("screenshot of the failure:", root / "failure.png")
                print("browser console:\n" + "\n".join(console[-40:]))
                print((root / "lab.log").read_text()[-3000:])
                raise
        finally:
            browser.close()


def _walk_through(page, url: str, token: str) -> None:
    page.goto(f"{url}/lab/tree/notebooks/dashboard.ipynb?token={token}")
    page.wait_for_function("window.jupyterapp && document.querySelector('.jp-Notebook')")
    # A fresh profile may ask which kernel to start (the notebook's own, python3, is preselected), or start it at
    # once: wait for whichever comes first, not for a dialog that may never come.
    idle = "window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel?.status === 'idle'"
    page.wait_for_function(f"() => ({idle}) || Array.from(document.querySelectorAll('.jp-Dialog'))"
                           ".some(d => d.textContent.includes('Select Kernel'))")
    chooser = page.locator(".jp-Dialog", has_text="Select Kernel")
    if chooser.count():
        chooser.get_by_role("button", name="Select", exact=True).click()
    # Wait for the kernel before running everything, or the first cells queue behind its start.
    page.wait_for_function(idle)
    _log("notebook open, kernel idle")
    # The file browser stays open (JupyterLab's default): the dashboard must fit beside it.
    page.evaluate("() => { window.jupyterapp.shell.expandLeft(); "
                  "window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    page.locator(".jp-OutputArea-output", has_text="setup done").wait_for(timeout=240_000)
    _log("notebook ran")
    assert page.locator(".jp-OutputArea-output >> text=Traceback").count() == 0, "a cell raised"

    board = page.locator(".workbench-dashboard")
    board.scroll_into_view_if_needed()
    _wait(lambda: _plot(page, "Loss per step")["points"][0] >= 6, 60, "the loss plot's first 6 steps")

    def toggle(label: str, value: str) -> None:
        group = board.locator(".widget-toggle-buttons").filter(
            has=page.locator(".widget-label", has_text=re.compile(f"^{label}$")))
        group.get_by_role("button", name=value, exact=True).click()

    def number(label: str, value: int) -> None:
        box = board.locator(".widget-inline-hbox").filter(
            has=page.locator(".widget-label", has_text=re.compile(f"^{label}$"))).locator("input")
        box.fill(str(value))
        box.press("Enter")  # a text box tells the kernel on Enter or blur

    # Reshard into a pipeline from the buttons: dp 1, pp 2, 4 micro-batches, then Apply and Train.
    toggle("dp", "1")
    toggle("pp", "2")
    number("micro-batches", 4)
    board.get_by_role("button", name="Apply").click()
    page.wait_for_selector(".workbench-dashboard >> text=applied pp2", timeout=120_000)
    _log("applied pp2 from the dashboard")
    number("steps", 6)
    board.get_by_role("button", name="Train").click()
    page.wait_for_selector(".workbench-dashboard >> text=/trained \\d+ of 6 steps/", timeout=180_000)
    _wait(lambda: _plot(page, "Loss per step")["points"][0] >= 12, 30, "the loss plot's 12 steps")
    loss = _plot(page, "Loss per step")
    assert loss["notes"][:2] == ["dp2", "pp2·1f1b×4"], loss["notes"]
    assert any(p["title"].startswith("Pipeline schedule: 1f1b, pp=2, m=4") for p in page.evaluate(_PLOTS_JS))
    _log("trained 6 steps from the dashboard")

    # Predicted beside measured for the new layout: the table, and a hatched estimate bar beside each rank's memory.
    board.get_by_text("Predicted beside measured (pp2·1f1b×4, cpu)").wait_for(timeout=30_000)
    _wait(lambda: page.evaluate(_MEMORY_BARS_JS).count("predicted") == 2, 30, "the memory plot's predicted bars")

    # Restart asks first; cancelling leaves the ranks as they are.
    board.get_by_role("button", name="Restart").click()
    question = board.locator(".workbench-confirm")
    question.get_by_text("weights trained so far").wait_for(timeout=10_000)
    question.get_by_role("button", name="Cancel").click()
    question.wait_for(state="hidden", timeout=10_000)

    # Draw the first run (dp2) whole beside the current history.
    picker = board.locator(".widget-select-multiple select")
    # ipywidgets writes option labels with non-breaking spaces.
    first = picker.evaluate("s => Array.from(s.options).map(o => o.text)"
                            ".find(t => t.replace(/\\u00a0/g, ' ').startsWith('1 · dp2 ·'))")
    picker.select_option(label=first)
    _wait(lambda: sum(n > 0 for n in _plot(page, "Loss per step")["points"]) >= 2, 30, "the compared run")
    _log("compared the first run")

    # The plan table, opened once for both widths.
    board.get_by_text("Plan a large run").click()
    board.get_by_role("button", name="Plan", exact=True).click()
    board.locator(".workbench-plan-table").wait_for(timeout=60_000)

    ARTIFACTS.mkdir(exist_ok=True)
    for width in WIDTHS:
        _resize(page, width, 1000)
        _check_layout(page.evaluate(_BOXES_JS), width)
        # The picture: a window tall enough for the whole dashboard (JupyterLab draws only what is on screen).
        tall = int(board.evaluate("b => b.getBoundingClientRect().height")) + 400
        _resize(page, width, tall)
        board.screenshot(path=str(ARTIFACTS / f"dashboard-{width}.png"))
        _log(f"layout checked at {width} px: {ARTIFACTS / f'dashboard-{width}.png'}")


def _resize(page, width: int, height: int) -> None:
    """Resize the window, then wait until the page has laid itself out again and every figure follows its column.

    Right after the resize the page may still show the old layout, whose figures already follow their old columns:
    so the layout must also stand still over two looks 0.5 s apart (under load the reflow came after a first look
    had passed, and the layout check then saw a 420 px figure in a 490 px column).
    """
    page.set_viewport_size({"width": width, "height": height})
    page.wait_for_function(f"window.innerWidth === {width} && window.innerHeight === {height}")
    last: list = []

    def settled() -> bool:
        figures = page.evaluate(_BOXES_JS)["figures"]
        follow = bool(figures) and all(0.9 * f["cell"] <= f["width"] <= f["cell"] + 1 for f in figures)
        still = figures == (last[-1] if last else None)
        last.append(figures)
        if not still:
            time.sleep(0.5)
        return follow and still

    _wait(settled, 60, f"the figures to follow their columns at {width}x{height} px")


def _check_layout(found: dict, width: int) -> None:
    assert found["sidebar"] > 150, "the file browser should be open"
    columns = {round(box[0]) for box in found["groups"]["cells"]}
    assert len(columns) >= 2, f"at {width} px the plots stand in one column"
    for name, boxes in found["groups"].items():
        assert not overlaps(boxes), f"at {width} px, in {name}, boxes overlap: {overlaps(boxes)} of {boxes}"
    for fig in found["figures"]:
        assert fig["width"] <= fig["cell"] + 1, f"at {width} px a figure is wider than its column: {fig}"
        assert fig["width"] >= 0.9 * fig["cell"], f"at {width} px a figure did not follow its column: {fig}"
    scroll, client = found["boardScroll"]
    assert scroll <= client + 1, f"at {width} px the dashboard scrolls sideways ({scroll} > {client})"
    scroll, client = found["tableScroll"]
    assert scroll <= client + 1, f"at {width} px the plan table scrolls sideways ({scroll} > {client})"
    assert found["tableRight"] <= found["boardRight"] + 1
