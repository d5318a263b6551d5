"""Where the interactive loop's time goes: start, apply, restart, telemetry, the step (issue 22's table).

Every row of the table is printed beside its goal, as medians of several
runs, with the phases that make it up and the baseline it is compared with
measured in the same run:

- the first cell, `import workbench as wb; b = wb.Workbench(2); b.apply(wb.Config(dp=2))`, in fresh
  interpreters, cold and with a standby an earlier kernel left, alternated, and the first `train(1)`
  (benches/first_cell.py, its own runtime folder): the pool's start by phase and the first apply by part on the
  ranks (imports, mesh, data, model build, layout, optimizer, telemetry attach);
- `apply(tp=2)` on a trained `tiny` model (reshard, state kept), by phase on
  the ranks (mesh, state export, data, model build, layout, optimizer,
  telemetry attach, state import, barrier) and its first step;
- `restart()` after a rank was killed, until the model is back, with the
  warm standby and without it (the cold baseline);
- a steady dp=2 step with telemetry on / off: the probe toggled per apply on one pool, beside the A/A noise of
  the method, and the recording backend's cost apart (benches/telemetry.py);
- a steady dp=2 step through the workbench / the same loop under torchrun.

    .venv/bin/python benches/latency.py            # about 4 minutes on 2 quiet cores
    .venv/bin/python benches/latency.py --rows start,restart   # only those rows (a before/after of one change)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
import cloudpickle  # noqa: E402

REPEATS = 3
STEPS = 20


def med(values):
    return statistics.median(values)


# -- on the ranks: apply(tp=2) by phase ------------------------------------------------------------------
def timed_apply(cfg, corpus, telemetry):
    """session.apply with a stopwatch around each of its parts (the engine's own functions, wrapped for the
    call): seconds per part, rank by rank."""
    import torch.distributed as dist

    from workbench.engine import data, session, trainer as trainer_module

    spent: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    patches = [(session, "export_full_state", "state export"), (session, "import_full_state", "state import"),
               (session, "build_mesh", "mesh"), (trainer_module, "build", "model build"),
               (trainer_module, "parallelize", "layout (parallelize)"),
               (trainer_module, "build_optimizer", "optimizer"), (trainer_module, "StepProbe", "telemetry attach"),
               (dist, "barrier", "barrier")]
    originals = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for_config = data.TokenData.__dict__["for_config"]
    try:
        for (module, name, label), (_, _, fn) in zip(patches, originals):
            setattr(module, name, timed(label, fn))
        data.TokenData.for_config = classmethod(timed("data", for_config.__func__))
        t = time.perf_counter()
        session.apply(cfg, corpus, telemetry, False)
        spent["total"] = time.perf_counter() - t
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)
        data.TokenData.for_config = for_config
    return spent


def apply_phases(bench, wb) -> tuple[list[float], list[dict], list[float], list[float]]:
    driver, ranks, first, steady = [], [], [], []
    for i in range(REPEATS + 1):
        bench.apply(wb.Config(dp=2))
        bench.train(3).wait()
        t = time.perf_counter()
        per_rank = bench.pool.run(timed_apply, wb.Config(tp=2), bench.corpus, bench.telemetry)
        took = time.perf_counter() - t
        bench.config = wb.Config(tp=2)  # what bench.apply would record (the store is not needed here)
        t = time.perf_counter()
        bench.train(1).wait()
        one = time.perf_counter() - t
        t = time.perf_counter()
        bench.train(1).wait()
        if i:  # the first round builds the tp mesh, later ones reuse it, as a session does
            driver.append(took)
            ranks.append({k: max(r[k] for r in per_rank) for k in per_rank[0]})
            first.append(one)
            steady.append(time.perf_counter() - t)
    return driver, ranks, first, steady


# -- restart ---------------------------------------------------------------------------------------------
def restart_times(wb, standby: bool) -> tuple[dict[str, list[float]], list[dict], object]:
    """restart() after a SIGKILL until the model is back. With the standby, restarts alternate between the pool
    as it is (fresh ranks read what the first ones measured about the machine, `workbench.machine.machine_fact`) and
    the baseline of measuring again (the facts' folder emptied first): both in the same conditions."""
    totals: dict[str, list[float]] = {"kept": [], "measured again": []}
    phases = []
    with wb.Workbench(2, standby=standby) as bench:
        bench.apply(wb.Config(dp=2))
        facts = bench.pool._facts  # the bench's own runtime folder's (main)
        for i in range(2 * REPEATS if standby else 1):
            kind = "kept" if i % 2 == 0 else "measured again"
            bench.train(2).wait()
            while standby and not bench.pool.standby.ready:
                time.sleep(0.1)
            if kind != "kept":
                for name in os.listdir(facts):
                    os.remove(os.path.join(facts, name))
            os.kill(bench.pool.pids[1], signal.SIGKILL)
            while not bench.pool.broken:
                time.sleep(0.001)
            t = time.perf_counter()
            bench.pool.restart()
            t_pool = time.perf_counter()
            bench._capabilities = bench.session.capabilities()
            t_caps = time.perf_counter()
            bench.apply(bench.config, fresh=True)
            t_apply = time.perf_counter()
            totals[kind].append(t_apply - t)
            if kind == "kept":
                phases.append({"pool": t_pool - t, **{f"  {k}": v for k, v in bench.pool.last_start.items()},
                               "capabilities": t_caps - t_pool, "apply (fresh model)": t_apply - t_caps})
        while standby and not bench.pool.standby.ready:
            time.sleep(0.1)
        cost = bench.pool.standby
    return totals, phases, cost


# -- steady steps ----------------------------------------------------------------------------------------
def steady_steps_on_off(wb, rounds: int = 3) -> tuple[float, float]:
    """Median steady dp=2 step with telemetry on and off: two Workbenches side by side (the recording backend and
    the probe / plain gloo), their rounds alternated, so a drift of the machine falls on both alike."""
    benches = {flag: wb.Workbench(2, telemetry=flag, standby=False) for flag in (True, False)}
    try:
        times: dict[bool, list[float]] = {True: [], False: []}
        for bench in benches.values():
            bench.apply(wb.Config(dp=2))
            bench.train(3).wait()
        for _ in range(rounds):
            for flag, bench in benches.items():
                times[flag] += [m.step_time_s for m in bench.train(STEPS).wait()][3:]
        return med(times[True]), med(times[False])
    finally:
        for bench in benches.values():
            bench.close()


ROWS = ("start", "apply", "restart", "telemetry", "step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)} (default: all)")
    wanted = set(p.parse_args().rows.split(","))
    if unknown := wanted - set(ROWS):
        p.error(f"--rows: unknown {sorted(unknown)}; choose from {', '.join(ROWS)}")
    from bytecode import require_compiled  # benches/bytecode.py

    require_compiled("benches/latency.py")

    import engine  # benches/engine.py: the plain torchrun loop
    import first_cell  # benches/first_cell.py: the first cell in fresh interpreters, cold and with a standby
    import telemetry  # benches/telemetry.py: the probe toggled on one pool, the recording backend replayed

    import workbench as wb

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cloudpickle.register_pickle_by_value(telemetry)  # its rank functions, which the ranks cannot import
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; torch {__import__('torch').__version__}")
    rows = []
    if "start" in wanted:
        rows += first_cell.report(first_cell.measure())
    if "apply" in wanted:
        with wb.Workbench(2) as bench:
            driver, ranks, first, steady_after = apply_phases(bench, wb)
        rows.append(("apply(tp=2) on a trained tiny model", f"{med(driver):.3f} s", "≤ 0.1 s"))
        print("\nphases of apply(tp=2) on the ranks (median of runs; the slowest rank per phase):")
        for name in ranks[0]:
            print(f"  {name:34s} {med([r[name] for r in ranks]):.4f} s")
        print(f"  {'first step after it / a steady one':34s} {med(first):.3f} s / {med(steady_after):.3f} s")
    if "restart" in wanted:
        with_standby, standby_phases, standby = restart_times(wb, standby=True)
        without_standby = restart_times(wb, standby=False)[0]["kept"]
        kept, again = med(with_standby["kept"]), med(with_standby["measured again"])
        rows.append(("restart() after a failure, until ready (standby)",
                     f"{kept:.2f} s (no standby, forked: {med(without_standby):.2f} s, "
                     f"{med(without_standby) / kept:.1f}×)",
                     "≤ 1 s"))
        print(f"\nrestart() with the standby: {kept:.2f} s; measuring the machine again on the fresh ranks "
              f"(as before machine facts were kept): {again:.2f} s, {again / kept:.2f}× "
              f"(runs alternated: {', '.join(f'{a:.2f}' for a in with_standby['kept'])} / "
              f"{', '.join(f'{a:.2f}' for a in with_standby['measured again'])} s)")
        print("phases of restart() with the standby (median of runs):")
        for name in standby_phases[0]:
            print(f"  {name:34s} {med([p[name] for p in standby_phases]):.3f} s")
        print(f"  the standby's cost: {standby}")
    if "telemetry" in wanted:
        with wb.Workbench(2, standby=False) as bench:
            cost = telemetry.toggled_cost(bench, wb.Config(dp=2))
            backend = telemetry.recording_backend_cost(bench)
        print("\ntelemetry, the probe toggled per apply on one pool (benches/telemetry.py):")
        telemetry.print_costs(cost, backend)
        recording, plain_gloo, _ = backend
        rows.append(("telemetry on / off, steady dp=2 step",
                     f"{cost.ratio:.3f}× (A/A {cost.aa_ratio:.3f}×; CPU {cost.cpu_ratio():.3f}×; backend {(recording - plain_gloo) / cost.mean('off'):+.1%})",
                     "≤ 1.01×"))
    if "step" in wanted:
        off = steady_steps_on_off(wb)[1]
        plain = engine.plain_torchrun(STEPS)
        rows.append(("steady step, workbench / torchrun",
                     f"{off / plain:.3f}× ({off * 1e3:.1f} / {plain * 1e3:.1f} ms)", "≤ 1.01×"))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'action':{width}s}  {'now':44s}  goal")
    for action, now, goal in rows:
        print(f"{action:{width}s}  {now:44s}  {goal}")


if __name__ == "__main__":
    # A runtime folder of the bench's own (set here, not at import: spawned helpers import this module again):
    # it empties the machine facts' folder (restart row) and must never take over, or end, the user's standby.
    RUNTIME = tempfile.mkdtemp(prefix="workbench-bench-")
    os.environ["WORKBENCH_RUNTIME_DIR"] = RUNTIME
    try:
        main()
    finally:
        shutil.rmtree(RUNTIME, ignore_errors=True)
