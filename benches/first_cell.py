"""The first cell as a newcomer meets it (issue 35's figures), in fresh interpreters:

    import workbench as wb; b = wb.Workbench(2); b.apply(wb.Config(dp=2))     # until it returns
    b.train(1).wait()                                                           # the first step

Two arms, alternated round by round, median of ROUNDS each:
- cold: no standby runs (the one the previous run left is ended first), so this interpreter's pool prepares the
  process its ranks fork from (the standby it starts, to outlive it);
- standby: the standby the previous interpreter (an earlier kernel) left is taken over.
The CPU's matmul peak (a machine fact, `workbench.machine.machine_fact`) is known in both, as on any machine where
workbench ran once; the very first start, before it is, is measured once and printed apart.

Then, in runs of their own (timers installed on the ranks before the apply, so these runs are not the ones
timed above), where the first apply spends its time on the ranks: the imports it triggers, mesh, data, model
build, layout, optimizer, telemetry attach (of which the CPU peak, when not yet known), barrier; and the first
step's own time on the ranks.

Runs in a runtime folder of its own ($WORKBENCH_RUNTIME_DIR): it never meets the user's standby, and it ends
every standby it started.

    .venv/bin/python benches/first_cell.py          # about a minute on 2 quiet cores
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from bytecode import require_compiled  # benches/bytecode.py

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 5

FIRST_CELL = textwrap.dedent('''
    import json, time
    t0 = time.monotonic()
    import workbench as wb
    t1 = time.monotonic()
    b = wb.Workbench(2)
    t2 = time.monotonic()
    b.apply(wb.Config(dp=2))
    t3 = time.monotonic()
    step = b.train(1).wait()[0].step_time_s
    t4 = time.monotonic()
    from workbench.pool import user_standby
    prepared = [s.get("preparation") for s in user_standby.running() if s["pid"] == b.pool._zygote.pid]
    print(json.dumps({"import": t1 - t0, "Workbench(2)": t2 - t1, "apply": t3 - t2, "ready": t3 - t0,
                      "train(1)": t4 - t3, "step on the ranks": step, "from": b.pool.ranks_from,
                      "pool": b.pool.last_start, "preparation": prepared[0] if prepared else None}))
    b.close()
''')

PHASES = textwrap.dedent('''
    import json, sys, time
    sys.path.insert(0, "benches")
    import cloudpickle, first_cell
    cloudpickle.register_pickle_by_value(first_cell)
    import workbench as wb
    b = wb.Workbench(2)
    b.pool.run(first_cell.install_timers)
    b.apply(wb.Config(dp=2))
    ranks = b.pool.run(first_cell.collect_timers)
    print(json.dumps({k: max(r[k] for r in ranks) for k in ranks[0]}))
    b.close()
''')


# -- on the ranks ----------------------------------------------------------------------------------------
def install_timers() -> None:
    """Wrap the engine's parts of an apply (and the import machinery) with stopwatches, until `collect_timers`."""
    import importlib._bootstrap as bootstrap

    import torch.distributed as dist

    from workbench import hardware
    from workbench.engine import data, session, trainer as trainer_module
    from workbench.pool import rank

    spent: dict[str, float] = {}
    depth = [0]

    def timed(name, fn, outermost=False):
        def wrapper(*args, **kwargs):
            depth[0] += outermost
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= outermost
                if not outermost or depth[0] == 0:
                    spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    patches = [(session, "build_mesh", "mesh"), (trainer_module, "build", "model build"),
               (trainer_module, "parallelize", "layout (parallelize)"), (trainer_module, "build_optimizer", "optimizer"),
               (trainer_module, "StepProbe", "telemetry attach"), (hardware, "measure_cpu", "  of which CPU peak"),
               (session, "apply", "total"), (dist, "barrier", "barrier")]
    originals = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, label in patches:
        setattr(module, name, timed(label, getattr(module, name)))
    for_config = data.TokenData.__dict__["for_config"]
    data.TokenData.for_config = classmethod(timed("data", for_config.__func__))
    load = bootstrap._find_and_load
    bootstrap._find_and_load = timed("imports (within the parts above)", load, outermost=True)

    def restore():
        for module, name, fn in originals:
            setattr(module, name, fn)
        data.TokenData.for_config = for_config
        bootstrap._find_and_load = load

    rank.state["bench-timers"] = (spent, restore)


def collect_timers() -> dict[str, float]:
    from workbench.pool import rank

    spent, restore = rank.state.pop("bench-timers")
    restore()
    return spent


# -- the notebook's side -----------------------------------------------------------------------------------
def _run(script: str, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    if out.returncode:
        raise RuntimeError(f"the run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _stop_standbys(env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "workbench", "--stop-standbys"], cwd=ROOT, env=env,
                   capture_output=True, check=True)


def measure(rounds: int = ROUNDS) -> dict:
    """Every figure of the first cell, from runs alternated between the arms."""
    folder = tempfile.mkdtemp(prefix="workbench-bench-")
    env = {**os.environ, "WORKBENCH_RUNTIME_DIR": folder}
    env.pop("WORKBENCH_STANDBY", None)
    try:
        first_ever = _run(FIRST_CELL, env)  # the CPU peak measured on the way
        runs: dict[str, list[dict]] = {"cold": [], "standby": []}
        phases: dict[str, list[dict]] = {"cold": [], "standby": []}
        loads = []
        for i in range(rounds + 2):
            _stop_standbys(env)
            loads.append(os.getloadavg()[0])
            if i < rounds:
                runs["cold"].append(_run(FIRST_CELL, env))
                runs["standby"].append(_run(FIRST_CELL, env))
            else:  # the phases, in runs of their own: a timer changes what it times a little
                phases["cold"].append(_run(PHASES, env))
                phases["standby"].append(_run(PHASES, env))
        _stop_standbys(env)
        return {"first_ever": first_ever, "runs": runs, "phases": phases, "loads": loads}
    finally:
        _stop_standbys(env)
        shutil.rmtree(folder, ignore_errors=True)


def med(values):
    return statistics.median(values)


def report(result: dict) -> list[tuple[str, str, str]]:
    """Print the figures; return the done-when rows (what, now, goal) for a summary table."""
    runs, phases = result["runs"], result["phases"]
    loads = result["loads"]
    print(f"\nthe first cell in a fresh interpreter (median of {len(runs['cold'])} runs per arm, alternated; "
          f"load average {min(loads):.1f}-{max(loads):.1f} over the runs):")
    keys = ("import", "Workbench(2)", "apply", "ready", "train(1)", "step on the ranks")
    print(f"  {'':34s} " + " ".join(f"{k:>17s}" for k in keys))
    for arm, rows in runs.items():
        print(f"  {arm:34s} " + " ".join(f"{med([r[k] for r in rows]):16.3f}s" for k in keys))
    each = {arm: ", ".join(f"{r['ready']:.2f}" for r in rows) for arm, rows in runs.items()}
    print(f"  each run, ready: cold {each['cold']} s; standby {each['standby']} s")
    print(f"  ranks from: cold: {runs['cold'][0]['from']}; standby: {runs['standby'][0]['from']}")
    cold_pool = runs["cold"][0]["pool"]
    print("  cold: the pool's start by phase (median): " + ", ".join(
        f"{name} {med([r['pool'][name] for r in runs['cold']]):.3f} s" for name in cold_pool))
    print("  ('spawn' holds the preparation of the process the ranks fork from: torch, the engine, torch._dynamo)")
    prepared = [r["preparation"] for r in runs["cold"] if r["preparation"]]
    if prepared:
        print("  cold: that preparation, in the standby, by part (median): " + ", ".join(
            f"{name} {med([p[name] for p in prepared]):.3f} s" for name in prepared[0]))
    ever = result["first_ever"]
    print(f"  the very first start on this machine (its CPU peak measured in the first apply): ready "
          f"{ever['ready']:.2f} s (apply {ever['apply']:.2f} s)")
    print("\nthe first apply on the ranks by part (the slowest rank; runs of their own, with timers):")
    names = list(dict.fromkeys(k for arm in phases.values() for p in arm for k in p))
    print(f"  {'':34s} {'cold':>9s} {'standby':>9s}")
    for name in names:
        cells = [f"{med([p.get(name, 0.0) for p in phases[arm]]):8.3f}s" for arm in ("cold", "standby")]
        print(f"  {name:34s} {cells[0]} {cells[1]}")
    return [("first cell: import + Workbench(2) + apply(dp=2), cold", f"{med([r['ready'] for r in runs['cold']]):.2f} s",
             "≤ 2 s"),
            ("first cell with a standby from an earlier kernel", f"{med([r['ready'] for r in runs['standby']]):.2f} s",
             "≤ 0.5 s"),
            ("first train(1) (cold / standby)", f"{med([r['train(1)'] for r in runs['cold']]):.2f} / "
             f"{med([r['train(1)'] for r in runs['standby']]):.2f} s", "≤ 0.3 s")]


def main() -> None:
    require_compiled("benches/first_cell.py")
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    rows = report(measure())
    width = max(len(r[0]) for r in rows)
    print(f"\n{'action':{width}s}  {'now':18s}  goal")
    for action, now, goal in rows:
        print(f"{action:{width}s}  {now:18s}  {goal}")


if __name__ == "__main__":
    main()
