"""Context parallel: what splitting each sequence over 2 ranks costs and saves on this machine, in one run.

The same model and global batch (tiny, 4 sequences of 1024 tokens) on 2 ranks, split three ways: dp=2 (each rank
takes 2 whole sequences), tp=2 (weights split, sequence parallel between blocks) and cp=2 (each rank takes half of
every sequence, in the two balanced chunks, and attention passes keys and values round the ring). dp=2 keeps the
most activations per rank at a batch that can no longer be split (4 sequences cannot go to 8 ranks; one long
sequence cannot go to 2); cp=2 and tp=2 are the two ways past that. Prints steady-state step times, peak saved
activations per rank, and their ratios to dp=2; for cp=2 also the share of the step its send/recv on the cp group
are in flight, the share the rank waits on them, and the bytes it sends per rank and step.

    .venv/bin/python benches/context_parallel.py
"""

from __future__ import annotations

import os
import statistics

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import workbench as wb  # noqa: E402
from workbench.telemetry.analysis import covered_ns  # noqa: E402

BASE = wb.Config(batch_size=4, seq_len=1024)
LAYOUTS = {"dp2": dict(dp=2), "tp2": dict(tp=2), "cp2": dict(cp=2)}
STEPS = 8
WARMUP = 2


def measure(bench: wb.Workbench, cfg: wb.Config) -> dict[str, list[float]]:
    bench.apply(cfg, fresh=True)
    bench.train(WARMUP).wait()
    bench.train(STEPS).wait()
    out: dict[str, list[float]] = {"time": [], "activations": [], "ring_share": [], "ring_waits": [], "ring_bytes": []}
    for r in range(2):
        for m in bench.store.steps(r)[-STEPS:]:
            if r == 0:
                out["time"].append(m.step_time_s)
            out["activations"].append(m.peak_memory["activations"])
            ring = [iv for iv in m.intervals if iv.kind == "comm" and iv.group == "mesh_cp"]
            # The rank's thread blocked on a send or recv: without a pipeline, only the ring's.
            waits = [iv for iv in m.intervals if iv.kind == "wait" and iv.name in ("SEND", "RECV")]
            for key, spans in (("ring_share", ring), ("ring_waits", waits)):
                out[key].append(covered_ns([(iv.start_ns, iv.end_ns) for iv in spans]) * 1e-9 / m.step_time_s)
            out["ring_bytes"].append(sum(iv.bytes for iv in ring if iv.name == "send"))
    return out


def main() -> None:
    results: dict[str, dict[str, list[float]]] = {name: {} for name in LAYOUTS}
    with wb.Workbench(2, device="cpu", telemetry=True) as bench:
        for _ in range(2):  # alternate: the machine is shared
            for name, degrees in LAYOUTS.items():
                for key, values in measure(bench, BASE.replace(**degrees)).items():
                    results[name].setdefault(key, []).extend(values)
    med = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in results.items()}
    base = med["dp2"]
    print(f"model: tiny ({BASE.model.num_params / 1e6:.2f} M parameters), global batch {BASE.batch_size} × "
          f"{BASE.seq_len} tokens, fp32, 2 ranks, gloo on CPU")
    for name in LAYOUTS:
        m = med[name]
        print(f"{name}: step {m['time'] * 1e3:7.1f} ms (×{m['time'] / base['time']:.2f} of dp2), peak activations "
              f"{m['activations'] / 2**20:6.1f} MiB per rank (×{m['activations'] / base['activations']:.2f} of dp2)")
    cp = med["cp2"]
    print(f"cp2 K/V exchange: in flight {cp['ring_share']:.1%} of the step (union of send/recv on mesh_cp), the rank "
          f"waiting on it {cp['ring_waits']:.1%} (medians over ranks and steps); {cp['ring_bytes'] / 2**20:.1f} MiB "
          "sent per rank per step")


if __name__ == "__main__":
    main()
