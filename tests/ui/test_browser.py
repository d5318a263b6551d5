"""A real browser: JupyterLab runs the quickstart, the dashboard's buttons train, the plots gain points.

Needs Chromium (installed with apt-get when missing and possible) and the
playwright package (no browser download: Debian's chromium is driven). Writes
artifacts/dashboard.png (docs/dashboard.png, which the README shows, is one of these).
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

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
# Written where git does not look, so a test run never dirties the checkout; docs/dashboard.png (the README's)
# is a copy of one taken this way.
SCREENSHOT = REPO / "artifacts" / "dashboard.png"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


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
    """JupyterLab on 127.0.0.1 with a token, over a copy of notebooks/, with no news pop-up or update check."""
    shutil.copytree(REPO / "notebooks", tmp_path / "notebooks")
    settings = tmp_path / "lab-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false",
                                                                          "checkForUpdates": False}))
    token, port = secrets.token_hex(16), free_port()
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "lab-settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"), JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), OMP_NUM_THREADS="1")
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
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


def _plot(page, title_start: str) -> dict:
    return next(p for p in page.evaluate(_PLOTS_JS) if p["title"].startswith(title_start))


def sync_api_errors():
    import playwright.sync_api

    return playwright.sync_api


def _log(what: str, _start=[]) -> None:
    # Printed progress is shown with a failure: it says which stage of the walk-through stalled.
    _start.append(_start[0] if _start else time.monotonic())
    print(f"[{time.monotonic() - _start[0]:6.1f} s] {what}", flush=True)


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def test_quickstart_dashboard_in_a_real_browser(lab):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    chromium = _chromium()
    url, token, root = lab
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(str(root / "profile"), executable_path=chromium, headless=True,
                                                       args=CHROMIUM_ARGS, viewport={"width": 1440, "height": 1800})
        try:
            page = browser.pages[0] if browser.pages else browser.new_page()
            page.set_default_timeout(60_000)
            try:
                _walk_through(page, url, token)
            except BaseException:
                page.screenshot(path=str(root / "failure.png"))
                print("screenshot of the failure:", root / "failure.png")
                print((root / "lab.log").read_text()[-3000:])
                raise
        finally:
            browser.close()


def _walk_through(page, url: str, token: str) -> None:
    page.goto(f"{url}/lab/tree/notebooks/00_quickstart.ipynb?token={token}")
    page.wait_for_function("window.jupyterapp && document.querySelector('.jp-Notebook')")
    # A fresh profile may ask which kernel to start; the notebook's own (python3) is preselected.
    chooser = page.locator(".jp-Dialog", has_text="Select Kernel")
    try:
        chooser.wait_for(timeout=8_000)
        chooser.get_by_role("button", name="Select", exact=True).click()
    except sync_api_errors().TimeoutError:
        pass
    # Wait for the kernel before running everything, or the first cells queue behind its start.
    page.wait_for_function("window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel?.status === 'idle'")
    _log("notebook open, kernel idle")
    # Not awaited: the command's promise settles only when every cell has run.
    page.evaluate("() => { window.jupyterapp.shell.collapseLeft(); "
                  "window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    # The last code cell's output (the cell's source holds the name too, so look in outputs only).
    page.locator(".jp-OutputArea-output", has_text="PosixPath('quickstart_report.html')").wait_for(timeout=240_000)
    _log("notebook ran")
    assert page.locator(".jp-OutputArea-output >> text=Traceback").count() == 0, "a cell raised"

    board = page.locator(".workbench-dashboard")
    board.scroll_into_view_if_needed()
    loss_before = _plot(page, "Loss per step")["points"][0]

    def toggle(label: str, value: str) -> None:
        group = board.locator(".widget-toggle-buttons").filter(
            has=page.locator(".widget-label", has_text=re.compile(f"^{label}$")))
        group.get_by_role("button", name=value, exact=True).click()

    # Back to data parallel from the buttons: dp 2, tp 1, ZeRO 1, then Apply.
    toggle("tp", "1")
    toggle("dp", "2")
    toggle("ZeRO", "1")
    board.get_by_role("button", name="Apply").click()
    page.wait_for_selector(".workbench-dashboard >> text=applied dp2·zero1", timeout=120_000)
    _log("applied dp2·zero1 from the dashboard")
    steps = board.locator(".widget-inline-hbox").filter(
        has=page.locator(".widget-label", has_text=re.compile("^steps$"))).locator("input")
    steps.fill("15")
    steps.press("Enter")  # a text box tells the kernel on Enter or blur
    board.get_by_role("button", name="Train").click()
    page.wait_for_selector(".workbench-dashboard >> text=/trained \\d+ of \\d+ steps/", timeout=180_000)
    _wait(lambda: _plot(page, "Loss per step")["points"][0] >= loss_before + 15, 30, "the loss plot")
    _log("trained 15 steps from the dashboard")
    assert "dp2·zero1" in _plot(page, "Loss per step")["notes"]

    time.sleep(1.0)  # let the last redraw land before the picture
    SCREENSHOT.parent.mkdir(exist_ok=True)
    board.screenshot(path=str(SCREENSHOT))
    _log(f"screenshot: {SCREENSHOT}")

    memory = _plot(page, "Memory per rank")
    if memory["notes"] == ["memory by category: not reported yet"]:
        pytest.xfail("the ranks do not report memory by category yet (telemetry probes)")
    assert sum(memory["points"]) > 0
