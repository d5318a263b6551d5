"""Where the time of `apply()` goes: a reshard of a trained model, phase by phase, on the ranks and around them.

Each phase is timed on the ranks by wrapping the very functions `engine/session.py`
and `engine/trainer.py` call (nothing in the package is changed for it); the
driver adds the whole round trip, so "control plane + driver" is what the
notebook waits for beyond the slowest rank. Applies alternate between two
layouts (`--source`, `--target`, one training step after each so the optimizer
holds state) and each row is the median over the applies into the target.

    .venv/bin/python benches/apply_phases.py [--repeats 7] [--telemetry off]

`phase_table(bench, source, target, repeats)` is what benches/latency.py calls
for its apply rows.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import workbench as wb  # noqa: E402

if __name__ != "__main__":
    # Imported (by benches/latency.py): the rank functions below must travel by value, since ranks cannot
    # import a module from benches/.
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

GOAL_S = 0.1
"""Issue 22: apply(tp=2) on a trained tiny model, reshard with state kept."""

# (phase, module, attribute): the functions timed on the ranks, in the order apply runs them. Indented phases
# run inside the one above them. A name a module no longer has is skipped.
PHASES = (
    ("rank total", "workbench.engine.session", "apply"),
    ("  mesh", "workbench.engine.session", "build_mesh"),
    ("  data", "workbench.engine.session", "TokenData.for_config"),
    ("  trainer", "workbench.engine.session", "Trainer"),
    ("    model build", "workbench.engine.trainer", "build"),
    ("    parallelize", "workbench.engine.trainer", "parallelize"),
    ("    optimizer", "workbench.engine.trainer", "build_optimizer"),
    ("    precision", "workbench.engine.trainer", "MixedPrecision"),
    ("    telemetry attach", "workbench.engine.trainer", "StepProbe"),
    ("  reshard", "workbench.engine.session", "reshard_into"),
    ("    describe pieces", "workbench.engine.reshard_direct", "_describe"),
    ("    gather descriptions", "torch.distributed", "all_gather_object"),
    ("    plan", "workbench.engine.reshard_direct", "plan_moves"),
    ("    move pieces", "workbench.engine.reshard_direct", "_run_moves"),
    ("    install optimizer state", "workbench.engine.reshard_direct", "_install_state"),
    ("    export full state", "workbench.engine.reshard_direct", "export_full_state"),
    ("    import full state", "workbench.engine.reshard_direct", "import_full_state"),
    ("  barrier", "torch.distributed", "barrier"),
)
PATHS = {"direct": True, "full state": False}
"""The reshard paths compared in one run: `reshard_into(..., direct=...)`."""
_STATE_KEY = "apply_phases"
"""Where a rank keeps its phase times (`workbench.pool.rank.state`): functions sent by value have no shared
module globals across commands."""


def _times() -> dict[str, list[float]]:
    from workbench.pool import rank

    return rank.state.setdefault(_STATE_KEY, defaultdict(list))


def _timed(phase: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _times()[phase].append(time.perf_counter() - start)

    wrapper.__wrapped_phase__ = fn
    return wrapper


def _owner(module: str, attribute: str) -> tuple[Any, str] | None:
    owner: Any = importlib.import_module(module)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part, None)
    return (owner, name) if owner is not None and hasattr(owner, name) else None


def install_timers() -> list[str]:
    """On a rank: wrap every phase's function with a timer (once); the phases found."""
    found = []
    for phase, module, attribute in PHASES:
        where = _owner(module, attribute)
        if where is None:
            continue
        owner, name = where
        fn = getattr(owner, name)
        if not hasattr(fn, "__wrapped_phase__"):
            wrapped = _timed(phase, fn)
            # A classmethod read from its class is bound already: keep it callable the same way.
            setattr(owner, name, staticmethod(wrapped) if isinstance(owner, type) else wrapped)
        found.append(phase)
    return found


def remove_timers() -> None:
    """On a rank: put every wrapped function back."""
    for _, module, attribute in PHASES:
        where = _owner(module, attribute)
        if where is None:
            continue
        owner, name = where
        fn = getattr(owner, name)
        if hasattr(fn, "__wrapped_phase__"):
            original = fn.__wrapped_phase__
            setattr(owner, name, classmethod(original.__func__) if hasattr(original, "__func__") else original)


def take_times() -> dict[str, float]:
    """On a rank: each phase's total time since the last call (a phase may run several times in one apply)."""
    times = _times()
    out = {phase: sum(ts) for phase, ts in times.items()}
    times.clear()
    return out


def force_path(direct: bool | None) -> None:
    """On a rank: make the session's apply take the given reshard path (None: its own choice again)."""
    from workbench.engine import session
    from workbench.pool import rank

    chosen = rank.state.setdefault("apply_phases.reshard_into", session.reshard_into)
    session.reshard_into = chosen if direct is None else functools.partial(chosen, direct=direct)


def phase_table(bench: wb.Workbench, source: wb.Config, target: wb.Config, repeats: int,
                paths: tuple[str, ...] = ("direct",)) -> dict[str, dict[str, list[float]]]:
    """Per reshard path: apply `source`, train a step, apply `target` (timed), train a step, `repeats` times over,
    the paths interleaved (the machine may be shared).

    Returns, per path, each phase's times (seconds) over the timed applies: a rank phase as the slowest rank's,
    plus "driver wall" (what `bench.apply` took) and "control plane + driver" (wall minus the slowest rank's total).
    """
    bench.apply(source)
    bench.train(1).wait()
    found = bench.pool.run(install_timers)[0]
    tables: dict[str, dict[str, list[float]]] = {path: defaultdict(list) for path in paths}
    try:
        for _ in range(repeats):
            for path in paths:
                bench.pool.run(force_path, PATHS[path])
                bench.pool.run(take_times)
                start = time.perf_counter()
                info = bench.apply(target)
                wall = time.perf_counter() - start
                per_rank = bench.pool.run(take_times)
                if not info["reshard"].startswith(path):
                    raise RuntimeError(f"asked for the {path} path, the apply took: {info['reshard']}")
                bench.train(1).wait()
                rows = tables[path]
                for phase in found:
                    rows[phase].append(max(r.get(phase, 0.0) for r in per_rank))
                rows["driver wall"].append(wall)
                rows["control plane + driver"].append(wall - max(r.get("rank total", 0.0) for r in per_rank))
                bench.apply(source)
                bench.train(1).wait()
    finally:
        bench.pool.run(force_path, None)
        bench.pool.run(remove_timers)
    return {path: {phase: times for phase, times in rows.items() if any(times)} for path, rows in tables.items()}


def print_table(rows: dict[str, list[float]], title: str) -> None:
    print(title)
    print(f"  {'phase':<30} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for phase, times in rows.items():
        print(f"  {phase:<30} {statistics.median(times) * 1e3:10.1f} {min(times) * 1e3:8.1f} {max(times) * 1e3:8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--telemetry", choices=("on", "off"), default="on")
    args = parser.parse_args()
    source, target = wb.Config(dp=2), wb.Config(tp=2)
    with wb.Workbench(2, device="cpu", telemetry=args.telemetry == "on") as bench:
        tables = phase_table(bench, source, target, args.repeats, paths=tuple(PATHS))
    for path, rows in tables.items():
        print_table(rows, f"apply({target.layout}) after apply({source.layout}) + 1 step, {path} reshard: tiny model, "
                          f"2 ranks, telemetry {args.telemetry}, {args.repeats} applies (slowest rank per phase)")
    direct, full = (statistics.median(tables[p]["driver wall"]) for p in PATHS)
    print(f"apply({target.layout}), state kept: {direct:.3f} s median, goal ≤ {GOAL_S} s ({direct / GOAL_S:.2f}× the "
          f"goal); the full-state path in the same run: {full:.3f} s (direct/full = {direct / full:.2f})")


if __name__ == "__main__":
    main()
