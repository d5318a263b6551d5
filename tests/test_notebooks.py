"""Every notebook runs top to bottom on 2 CPU cores, and none is stored with outputs."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
BUDGET_S = 180
"""What a newcomer waits at most for one notebook on two CPU cores."""

CLAIMS = {
    # The notebook asserts its measured claims in its cells; these are the sentences it must have printed.
    "08_a_cluster_on_your_laptop": ("the link model says", "EMULATED cluster h100-25gbe: 2 nodes × 1 h100",
                                    "int8 / none", "of the throughput lost across"),
}
"""Per notebook, text its run must print: the measured claims its words rest on."""


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:1] == ["00_quickstart.ipynb"] and len(NOTEBOOKS) >= 5


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: cell {cell.id} has outputs"
    # Executed notebooks embed megabytes of widget state: none may be committed.
    assert "widgets" not in nb.metadata, f"{path.name} carries saved widget state"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_top_to_bottom(path, tmp_path):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    # A copy of the folder, so that files a notebook writes (reports) land in the test's temporary directory.
    work = tmp_path / "notebooks"
    shutil.copytree(path.parent, work)
    # The "python3" kernel runs this interpreter (jupyter_client swaps "python" for sys.executable).
    client = NotebookClient(nb, timeout=BUDGET_S, kernel_name="python3", resources={"metadata": {"path": str(work)}})
    start = time.monotonic()
    client.execute()
    elapsed = time.monotonic() - start
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    for claim in CLAIMS.get(path.stem, ()):
        assert claim in printed, f"{path.name} did not print {claim!r}"
    assert elapsed < BUDGET_S, f"{path.name} took {elapsed:.0f} s"
    out = os.environ.get("WORKBENCH_EXECUTED_NOTEBOOKS")
    if out:  # to look at what a run printed: WORKBENCH_EXECUTED_NOTEBOOKS=/tmp/x pytest tests/test_notebooks.py
        Path(out).mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, Path(out) / path.name)
