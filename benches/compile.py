"""torch.compile on this machine: a compiled step against the eager step, and what compiling costs.

For "tiny" at dp=2 on 2 CPU ranks (inductor with the system C++ compiler): the
eager step time, the compiled step time once compiled (both medians of the
same number of steps, interleaved run by run), their ratio; the compile time
itself as the ranks report it (Compilation spans: every forward and backward
graph, summed on rank 0); and what a reshard costs afterwards: back to a
layout compiled before (nothing to compile) and to a new one (tp=2).

    .venv/bin/python benches/compile.py [--preset tiny] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import workbench as wb  # noqa: E402
from workbench.telemetry.events import Compilation  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = wb.Config(model=wb.ModelConfig.preset(args.preset), dp=2, batch_size=8, seq_len=128)
    compiled = base.replace(compile=True)
    spans: list[Compilation] = []
    with wb.Workbench(2, telemetry=False) as bench:
        bench.pool.subscribe(lambda r, e: spans.append(e) if isinstance(e, Compilation) and r == 0 and e.end_ns
                             else None)

        def compile_s(since: int) -> tuple[float, int]:
            time.sleep(0.3)  # the events of the last step cross after its result
            done = spans[since:]
            return sum(e.end_ns - e.start_ns for e in done) / 1e9, len(done)

        bench.apply(compiled)
        t0 = time.perf_counter()
        bench.train(1).wait()
        first_step = time.perf_counter() - t0
        first_compile, graphs = compile_s(0)
        eager, fast = [], []
        for _ in range(args.repeats):  # interleaved, so drifting machine load hits both alike
            bench.apply(base)
            eager += [m.step_time_s for m in bench.train(args.steps).wait()]
            mark = len(spans)
            bench.apply(compiled)  # a reshard back to the compiled layout: cached, nothing to compile
            fast += [m.step_time_s for m in bench.train(args.steps).wait()]
            assert compile_s(mark)[1] == 0, "a layout compiled before compiled again"
        mark = len(spans)
        bench.apply(base.replace(dp=1, tp=2, compile=True))
        t0 = time.perf_counter()
        bench.train(1).wait()
        new_layout_step = time.perf_counter() - t0
        new_compile, new_graphs = compile_s(mark)
    med_e, med_c = statistics.median(eager), statistics.median(fast)
    print(f"torch.compile, {args.preset} at dp=2 on 2 CPU ranks ({len(eager)} steps each, medians):")
    print(f"  eager step {med_e * 1e3:.1f} ms, compiled step {med_c * 1e3:.1f} ms: compiled/eager ×{med_c / med_e:.2f}")
    print(f"  first compiled step {first_step:.1f} s, of it compiling {first_compile:.1f} s ({graphs} compilations "
          f"on rank 0: one forward and one backward graph serve every block); pays back after "
          f"{first_compile / max(med_e - med_c, 1e-9):.0f} steps" if med_c < med_e else
          f"  first compiled step {first_step:.1f} s, of it compiling {first_compile:.1f} s ({graphs} compilations)")
    print(f"  reshard back to dp=2 (compiled before): 0 compilations; to tp=2 (new): {new_graphs} compilations, "
          f"{new_compile:.1f} s, first step {new_layout_step:.1f} s")


if __name__ == "__main__":
    main()
