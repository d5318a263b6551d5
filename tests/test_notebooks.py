"""Every notebook runs top to bottom on 2 CPU cores, says only what it measured, and is stored without outputs.

Each notebook's key claims (what its text tells the reader the numbers show) are checked against what that
run measured: `CLAIMS` is code run in the notebook's own kernel after its last cell (so it reads the
notebook's variables), `PRINTED` are patterns its cells' printed output must show. A claim that fails says
which sentence of the notebook its run contradicts.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest


def _nbformat():
    """nbformat, imported when a test needs it, not when pytest collects this file: it imports jsonschema, which
    builds rfc3987_syntax's grammar at import (1-3 s of a core), and each of `make test`'s three pytest runs
    collects every file."""
    import nbformat

    return nbformat


NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
BUDGET_S = 240
"""What a newcomer waits at most for one notebook on two CPU cores (a bound on hangs, not a timing test)."""

CLAIMS: dict[str, str] = {
    "00_quickstart": """
assert metrics[-1].loss < metrics[0].loss - 0.5, "the loss falls while it trains"
drop = metrics[0].loss - metrics[-1].loss
assert abs(tp_steps[0].loss - metrics[-1].loss) < 0.5 * drop, "tp2 continues where data parallel left it"
assert tp_steps[0].step == metrics[-1].step + 1
assert [r.layout for r in bench.run_records] == ["dp2", "tp2"], "every Apply starts a run"
assert Path("quickstart_report.html").exists()
""",
    "01_data_parallel_and_zero": """
peak = {z: latest[z][0].peak_memory for z in latest}
half = lambda a, b: abs(a / b - 0.5) < 0.02
assert half(peak[1]["optimizer"], peak[0]["optimizer"]), "ZeRO 1 halves the optimizer state"
assert half(peak[2]["gradients"], peak[0]["gradients"]), "ZeRO 2 halves the gradients"
assert peak[2]["parameters"] > peak[0]["parameters"], "ZeRO 2 keeps the gathered parameters beside its shard"
m = bench.config.model
root = 4 * (2 * m.vocab_size * m.dim + m.dim)
expected = peak[0]["parameters"] / 2 + root
assert abs(peak[3]["parameters"] - expected) <= 0.01 * expected, "ZeRO 3: half the parameters plus the root's"
big = {z: {iv.name for iv in latest[z][0].intervals if iv.kind == "comm" and iv.bytes > 1024} for z in latest}
assert big == {0: {"all_reduce"}, 1: {"all_reduce", "broadcast"}, 2: {"all_gather", "reduce_scatter"},
               3: {"all_gather", "reduce_scatter"}}, big
assert 1.8 < sent[3]["all_gather"] / sent[2]["all_gather"] < 2.05, "ZeRO 3 all-gathers twice ZeRO 2's payload"
for z in latest:  # the trainer's one 24-byte all-reduce per step
    assert [iv.bytes for iv in latest[z][0].intervals if iv.name == "all_reduce" and iv.bytes <= 64] == [24]
h = bench.history
assert all(h[6 * z].loss < h[0].loss - 1.0 for z in (1, 2, 3)), "the loss carries on across the stages"
""",
    "02_tensor_parallel": """
assert calls["all_gather"] == predicted["all_gather"] and calls["reduce_scatter"] == predicted["reduce_scatter"]
assert sizes["all_reduce"] == [24, 4608], sizes  # the trainer's vote; every norm's gradient in one call
assert calls["all_reduce"] == predicted["all_reduce"] + 1 == 2, (calls, predicted)
""",
    "03_pipeline_schedules": """
# Each measured bubble is its quiet value moved by at most the share of a step the ranks waited for a core
# (busy[...]: a rank waiting for a core stretches its peer's idle time, or its own action): ~0 on quiet cores, so
# there these are the quiet claims; on a busy machine they give way by exactly what the machine took.
slack = lambda *keys: sum(busy[k] for k in keys)  # noqa: E731
for s in ("gpipe", "1f1b"):
    assert bubble[s, 8] < bubble[s, 2] - 0.05 + slack((s, 8), (s, 2)), f"{s}: more micro-batches, smaller {busy}"
    for m in M:
        assert abs(bubble[s, m] - ideal_bubble_fraction(2, m)) < 0.2 + slack((s, m)), f"{s} m={m} near the formula"
for m in M:
    assert abs(bubble["gpipe", m] - bubble["1f1b", m]) < 0.12 + slack(("gpipe", m), ("1f1b", m)), "idle about alike"
for m in (4, 8):
    assert activations["gpipe", m][0] > 1.5 * activations["1f1b", m][0], "GPipe holds every micro-batch"
assert len(last_actions["interleaved_1f1b", 8]) == 2 * len(last_actions["1f1b", 8]), "twice as many actions"
b8 = last_actions["1f1b", 8]
# Medians: a core taken away mid-action (a busy machine) lengthens that one action, not the typical one. Where
# every action was held off a core (a busy machine: a B, longer, is held off more often than an F), the bound
# gives by what the ranks waited for a core in a step (busy: that wait as a share of the step), which is all an
# action can have been stretched by; on quiet cores that is ~0 and this is the quiet claim.
f_ns = statistics.median(a.end_ns - a.start_ns for a in b8 if a.kind == "F")
b_ns = statistics.median(a.end_ns - a.start_ns for a in b8 if a.kind == "B")
held_ns = busy["1f1b", 8] * (max(a.end_ns for a in b8) - min(a.start_ns for a in b8))
assert 1.1 * (f_ns - held_ns) < b_ns and b_ns - held_ns < 2.5 * f_ns, (
    f"a B takes longer than an F, up to about twice: {b_ns / f_ns:.2f} (held off a core {held_ns / 1e6:.0f} ms)")
inter, one = (lambda m: bubble["interleaved_1f1b", m]), (lambda m: bubble["1f1b", m])
for s in ("gpipe", "1f1b"):
    assert bubble[s, 8] + slack((s, 8)) > ideal_bubble_fraction(2, 8), f"{s}: above the formula at m=8 {bubble}"
inter_slack, one_slack = slack(("interleaved_1f1b", 8)), slack(("1f1b", 8))
assert inter(8) + inter_slack > 2 * ideal_bubble_fraction(2, 8, 2), f"interleaved: at least twice its formula {bubble}"
assert ((inter(8) + inter_slack) / ideal_bubble_fraction(2, 8, 2)
        > (one(8) - one_slack) / ideal_bubble_fraction(2, 8)), f"in proportion {bubble} {busy}"
assert small[8] + small_busy[8] > ideal_bubble_fraction(2, 8) + 0.05, f"one sequence per action: above it {small}"
""",
    "04_precision_and_recompute": """
(fp32, bf16, fp16, selective, full) = results.values()
act = lambda r: r[1][-1].peak_memory["activations"]
for r in results.values():
    assert abs(act(r) - r[2].activations) <= 0.01 * r[2].activations, "the prediction is the measured figure"
assert 0.65 * act(fp32) < act(bf16) < 0.85 * act(fp32), "16-bit: about a quarter less, not half"
assert abs(act(fp16) - act(bf16)) <= 0.01 * act(bf16)
assert act(full) < act(selective) < act(fp32) and act(full) < 0.25 * act(fp32)
for cat in ("parameters", "gradients", "optimizer"):
    values = [r[1][-1].peak_memory[cat] for r in results.values()]
    assert max(values) <= 1.01 * min(values), f"{cat} is the same in every row"
skipped = sum(m.skipped for m in fp16[1])
assert fp16[1][-1].loss_scale == 65536 / 2 ** skipped, "the loss scale halves at every skipped step"
""",
    "05_mixture_of_experts": """
dropped = [r[2] for r in rows]
assert all(a >= b for a, b in zip(dropped, dropped[1:])) and dropped[0] > 0.3 and dropped[-1] == 0
peaks = [r[3] for r in rows]
assert all(a <= b * 1.001 for a, b in zip(peaks, peaks[1:])), "activations grow with what is kept"
assert all(r[3] <= r[4] * 1.005 for r in rows) and abs(rows[-1][3] - rows[-1][4]) <= 0.005 * rows[-1][4]
assert late[0.1] < late[0.0] - 0.05 and late[0.1] < start, f"the balancing loss evens the load: {late}, {start}"
a2a = sum(c.calls for c in estimated_comm[2] if c.kind == "all_to_all")
assert measured_comm[2]["all_to_all"][2] == a2a and "all_to_all" not in measured_comm[1]
assert measured_comm[2]["all_to_all"][0] <= 1.001 * sum(c.bytes for c in estimated_comm[2] if c.kind == "all_to_all")
assert measured_comm[2]["all_reduce"][0] < 0.5 * measured_comm[1]["all_reduce"][0], "ep=2 syncs the dense part"
runs_by_name = {r.name: r for r in bench.run_records}
branches = [runs_by_name["aux_loss_coef 0.0"], runs_by_name["aux_loss_coef 0.1"]]
assert [r.first_step for r in branches] == [12, 12] and [len(r.steps(0)) for r in branches] == [14, 14]
""",
    "06_compression_and_offload": """
med = {k: statistics.median(m.grad_sync_bytes for m in steps[2:]) for k, (cfg, steps) in runs.items()}
assert abs(med["fp16"] / med["none"] - 0.5) < 0.01 and 0.24 < med["int8"] / med["none"] < 0.27
assert 0.02 < med["1bit"] / med["none"] < 0.045
for k, (cfg, steps) in runs.items():
    est = sum(c.wire_bytes for c in wb.estimate(cfg, "cpu").comm if c.axis == "dp")
    assert abs(med[k] - est) <= 0.01 * est, (k, med[k], est)
final = {k: statistics.mean(m.loss for m in steps[-10:]) for k, (cfg, steps) in runs.items()}
off = {k: abs(v - final["none"]) for k, v in final.items()}
assert off["1bit"] > max(off["fp16"], off["int8"]), f"1bit drifts most: {final}"
assert all(on < off_ for on, off_ in feedback.values()), f"error feedback keeps the sum close: {feedback}"
assert losses[True] == losses[False]
""",
    "07_from_prototype_to_large_run": """
assert cfg.zero == 3, "the text speaks of ZeRO 3: the plan's best layout scaled down"
assert cfg.mixed_precision == "fsdp", "the text says the plan chose FSDP2's mixed precision (bf16 gathers)"
assert measured["parameters"] - predicted.parameters == root, "above the estimate by the root module's parameters"
for name in ("gradients", "optimizer", "activations"):
    assert abs(measured[name] - getattr(predicted, name)) <= 0.005 * getattr(predicted, name), name
assert inside == outside
""",
    "09_your_own_model": """
assert qwen_facts.params == sum(p.numel() for p in own.parameters()), "the count is transformers' own class's"
assert qwen_facts.support["ep"] and not any(w for a, w in qwen_facts.support.items() if a != "ep"), "all but ep apply"
assert set(worst) == {"dp2 zero3", "tp2", "pp2"} and max(worst.values()) < 1e-5, f"one process's losses: {worst}"
assert [r.name for r in bench.run_records][:3] == list(layouts), "every apply is a run of its own"
assert {f.name for f in files} == {"model.safetensors", "config.json"}
assert not info["missing_keys"] and not info["unexpected_keys"], "transformers opens it with nothing missing"
assert ours.step == step and abs(ours.loss - theirs) <= 1e-5 * theirs, "the export's loss is the ranks' next step's"
assert big.model_params == 8_190_735_360 and big.fits and cluster.world_size == 64, "8.19 B parameters; it fits"
assert mine_facts.params == sum(p.numel() for p in my_model.build(dim=64, layers=2, heads=4).parameters())
assert refusal.startswith("tp: ") and "no tensor-parallel plan" in refusal, refusal
assert mine_worst < 1e-5, f"tp2 trains the module's own losses: {mine_worst}"
assert mine_est.model_params == mine_facts.params, "the trace counts the module's own parameters"
assert saved["model"]["source"] == "custom" and saved["model"]["plan"] == my_model.PLAN
assert any("your own module" in u for u in exported_run.unexpressed), "the export says torchtitan cannot train it"
""",
}

PRINTED: dict[str, list[tuple[str, str]]] = {
    # (a line of the cell's source, a pattern its output must show)
    "00_quickstart": [("controls.dp.value = 2", r"Apply disabled: True"),
                      ("controls.dp.value = 2", r"2 ranks"),
                      ("%%ranks", r"\[rank 0\] Out: \(\(192, 128\), \(384, 128\)\)"),
                      ("%%ranks", r"\[rank 1\] Out: \(\(192, 128\), \(384, 128\)\)")],
    "02_tensor_parallel": [("reference = F.linear", r"\[rank 0\] Out: True"), ("reference = F.linear", r"\[rank 1\] Out: True"),
                           ("reference = F.linear", r"engine's shards: True True"),
                           ("engine = ff(", r"\[rank 0\] Out: True"), ("engine = ff(", r"\[rank 1\] Out: True")],
}


MUST_PRINT: dict[str, tuple[str, ...]] = {
    # Notebook 08 asserts its measured claims in its own cells; these are the sentences its run must print.
    "08_a_cluster_on_your_laptop": ("the link model says", "EMULATED cluster h100-25gbe: 2 nodes × 1 h100",
                                    "int8 / none", "of the throughput lost across"),
}


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:1] == ["00_quickstart.ipynb"] and len(NOTEBOOKS) >= 5


def test_every_teaching_notebook_has_its_claims_checked():
    assert {p.stem for p in NOTEBOOKS if p.stem[:2] <= "07"} <= set(CLAIMS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_without_outputs(path):
    nbformat = _nbformat()
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: cell {cell.id} has outputs"
    # Executed notebooks embed megabytes of widget state: none may be committed.
    assert "widgets" not in nb.metadata, f"{path.name} carries saved widget state"


def _text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            out.append(o.text)
        elif o.output_type in ("execute_result", "display_data"):
            out.append(o.data.get("text/plain", ""))
    return "".join(out)


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.mostly_waits  # a kernel's cells between its ranks' steps: 0.70 of 2 cores idle on average
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.smoke) if p.stem == "00_quickstart" else p
                                  for p in NOTEBOOKS], ids=lambda p: p.stem)
def test_runs_top_to_bottom_and_its_claims_hold(path, tmp_path):
    from nbclient import NotebookClient

    nbformat = _nbformat()
    nb = nbformat.read(path, as_version=4)
    claims = CLAIMS.get(path.stem)
    if claims:
        nb.cells.append(nbformat.v4.new_code_cell("from pathlib import Path\nimport statistics\n" + claims))
    # A copy of the folder, so that files a notebook writes (reports) land in the test's temporary directory.
    work = tmp_path / "notebooks"
    shutil.copytree(path.parent, work)
    # The "python3" kernel runs this interpreter (jupyter_client swaps "python" for sys.executable).
    client = NotebookClient(nb, timeout=BUDGET_S, kernel_name="python3", resources={"metadata": {"path": str(work)}},
                            allow_errors=True)
    # The kernels take their ranks from one user standby in the test run's own runtime folder (tests/conftest.py),
    # as a user's successive kernels do: the first notebook's kernel prepares it, the others fork at once.
    client.execute(env={**os.environ, "WORKBENCH_STANDBY": "1"})
    out = os.environ.get("WORKBENCH_EXECUTED_NOTEBOOKS")
    if out:  # to look at what a run printed: WORKBENCH_EXECUTED_NOTEBOOKS=/tmp/x pytest tests/test_notebooks.py
        Path(out).mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, Path(out) / path.name)
    errors = [(i, o) for i, c in enumerate(nb.cells) if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    for i, error in errors:
        claim = " (a claim of the text, checked after the last cell)" if claims and i == len(nb.cells) - 1 else ""
        pytest.fail(f"{path.name} cell {i}{claim}: {error.ename}: {error.evalue}\n" + "\n".join(error.traceback[-3:]))
    # Light to keep: plotly's widget code (~5 MB) at most once in the saved widget state, not once per figure.
    states = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    bundles = [k for k, v in states.items() if len(str(v.get("state", {}).get("bundle", ""))) > 1_000_000
               or len(str(v.get("state", {}).get("_esm", ""))) > 1_000_000]
    assert len(bundles) <= 1, f"{path.name} saved plotly's bundle {len(bundles)} times"
    printed = "".join(_text(c) for c in nb.cells if c.cell_type == "code")
    for sentence in MUST_PRINT.get(path.stem, ()):
        assert sentence in printed, f"{path.name} did not print {sentence!r}"
    for needle, pattern in PRINTED.get(path.stem, []):
        cell = next(c for c in nb.cells if c.cell_type == "code" and needle in c.source)
        assert re.search(pattern, _text(cell)), f"{path.name}: the cell with {needle!r} should print {pattern!r}"
