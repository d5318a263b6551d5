"""What full telemetry costs: step time with it on vs off, in one run.

Alternates off/on several times (the machine is shared and noisy) and prints
the ratio of medians, then where the probe's own time goes on a rank. On CPU
(the default) the tiny model at dp=2; on a GPU (``--device cuda``) one rank per
GPU at the 125m preset, where telemetry is CUDA event marks on the streams
(target: on/off <= 1.02).

    .venv/bin/python benches/telemetry.py
    .venv/bin/python benches/telemetry.py --device cuda            # world size = GPUs, 125m, bf16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import workbench as wb  # noqa: E402

CFG = wb.Config(dp=2)
WARMUP, STEPS, ROUNDS = 3, 15, 3


def step_times(bench: wb.Workbench) -> list[float]:
    bench.train(WARMUP).wait()
    return [m.step_time_s for m in bench.train(STEPS).wait()]


def probe_costs() -> list[tuple[str, int, float]]:
    """What the step probe costs a step on this rank, piece by piece, as a step calls it.

    Each row: (piece, calls a step, microseconds a call), timed on the trained model with the probe's own
    objects (its cached `ModelMemory`, its activation meter's hooks, its hooks on the parameters and optimizers),
    so the rows add up to the probe's Python work in a step; what they leave out of the measured on/off
    difference is the recording backend's and autograd's side.
    """
    import torch

    from workbench.engine.model import loss_fn
    from workbench.engine.session import current
    from workbench.pool import rank
    from workbench.telemetry import activations, probes

    session = current()
    trainer = session.trainer
    probe = trainer.probe
    with rank.unchecked():
        last = trainer.step(session.next_step)  # the probe now holds a real step's spans
    session.next_step += 1
    spans = list(last.intervals)

    def per_call(fn, n=200) -> float:
        fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e6

    rows: list[tuple[str, int, float]] = []
    micro = 0 if trainer.pipeline is not None else trainer.cfg.micro_batches
    if trainer.pipeline is None:
        # The tensors one micro-batch's forward saves for backward, through the meter's hooks as autograd calls them.
        model = getattr(trainer.modules[0], "module", trainer.modules[0])  # DDP's module: no reducer state touched
        inputs, targets = trainer._batch(session.next_step)
        n = trainer.cfg.micro_batches
        x, y = inputs.chunk(n)[0], targets.chunk(n)[0]
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss_fn(model(x), y)
        meter = activations.ActivationMeter(buffers=list(model.buffers()))

        def pack_unpack_release() -> None:
            packed = [meter._pack(t) for t in saved]
            for p in packed:
                activations._unpack(p)
            del packed[:]

        rows.append((f"saved tensor: pack+unpack+release ({len(saved)} a forward)", len(saved) * n,
                     per_call(pack_unpack_release, 50) / len(saved)))
    if probe.gpu is None:  # on a GPU the hooks and spans are CUDA event marks, resolved in finish
        grad_hook = probes._weakly(probe._grad_ready)
        parameters = [p for m in trainer.modules for p in m.parameters() if p.requires_grad]
        rows.append(("gradient-ready hook", len(parameters), per_call(lambda: grad_hook(parameters[0]))))
        begins, ends = probes._weakly(probe._optimizer_begins), probes._weakly(probe._optimizer_ends)
        rows.append(("optimizer pre+post hooks", len(trainer.optimizers), per_call(lambda: (begins(), ends()))))

        def forward_and_backward_spans() -> None:
            with probe.span("forward"):
                pass
            with probe.backward():
                pass

        rows.append(("forward span + backward span", micro, per_call(forward_and_backward_spans)))
    rows.append(("begin_step (drain)", 1, per_call(probe.begin_step)))
    # After backward the gradients exist (a step drops them at its end): stand-ins of their size, as DDP's buckets.
    grads = [p for m in trainer.modules for p in m.parameters() if p.requires_grad]
    for p in grads:
        p.grad = torch.zeros_like(p)
    rows.append(("after_backward (memory)", 1, per_call(probe.after_backward)))
    gradient_bytes = per_call(probe.memory.gradient_bytes)
    for p in grads:
        p.grad = None
    rows.append(("before_vote", 1, per_call(probe.before_vote)))

    def finish() -> None:
        probe.spans = list(spans)  # a real step's intervals to sort and sum, as finish sees them
        probe.finish(last)

    rows.append((f"finish ({len(spans)} intervals)", 1, per_call(finish)))
    # finish's and after_backward's parts, for where their time goes
    rows.append(("  memory.parameter_bytes", micro + 2, per_call(probe.memory.parameter_bytes)))
    rows.append(("  memory.gradient_bytes (gradients held)", 1, gradient_bytes))
    rows.append(("  memory.gradient_bytes (gradients dropped)", 1, per_call(probe.memory.gradient_bytes)))
    rows.append(("  memory.optimizer_bytes", 1, per_call(probe.memory.optimizer_bytes)))
    rows.append(("  process_bytes", 2, per_call(lambda: probes.process_bytes(trainer.device))))
    rows.append(("  step_summary", 1, per_call(lambda: probe.native.step_summary(spans))))
    probe.begin_step()  # leave the probe as a step expects it
    return rows


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="telemetry on/off step time")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: 2 on cpu, every GPU on cuda)")
    parser.add_argument("--preset", default=None, help="model preset (default: tiny on cpu, 125m on cuda)")
    parser.add_argument("--precision", default=None, help="default: fp32 on cpu, bf16 on cuda")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    return parser.parse_args(argv)


def config_for(args: argparse.Namespace, world: int) -> wb.Config:
    if args.device == "cpu" and args.preset is None and world == 2:
        return CFG
    gpu = args.device == "cuda"
    return wb.Config(dp=world, model=wb.ModelConfig.preset(args.preset or ("125m" if gpu else "tiny")),
                     precision=args.precision or ("bf16" if gpu else "fp32"),
                     batch_size=args.batch_size or (8 * world if gpu else 16),
                     seq_len=args.seq_len or (1024 if gpu else 128))


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.world_size is not None:
        world = args.world_size
    elif args.device == "cuda":
        import torch

        world = max(1, torch.cuda.device_count())
    else:
        world = 2
    cfg = config_for(args, world)
    benches = {flag: wb.Workbench(world, device=args.device, telemetry=flag) for flag in (False, True)}
    try:
        for bench in benches.values():
            bench.apply(cfg)
        times = {False: [], True: []}
        for _ in range(ROUNDS):
            for flag, bench in benches.items():
                times[flag] += step_times(bench)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"{args.device}: {cfg.layout}, "
              f"model dim {cfg.model.dim} x {cfg.model.n_layers} layers, {cfg.precision}, "
              f"{ROUNDS}×{STEPS} steps each, alternating")
        print(f"step time, telemetry off: median {off * 1e3:.1f} ms")
        print(f"step time, telemetry on:  median {on * 1e3:.1f} ms")
        print(f"ratio on/off: {on / off:.3f}")
        print(f"TELEMETRY_RATIO={on / off:.4f}")  # one machine-readable line for benches/gpu_check.sh
        last = benches[True].train(1).wait()[-1]
        kinds = sorted({(iv.kind, iv.stream) for iv in last.intervals})
        print(f"a step with telemetry on: {len(last.intervals)} intervals {kinds}, "
              f"comm {last.comm_time_s * 1e3:.2f} ms, exposed {last.exposed_comm_s * 1e3:.2f} ms, "
              f"overlap {last.overlap}, device memory {getattr(last, 'device_memory', {})}")
        rows = benches[True].pool.run(probe_costs)[0]
        print("the probe's pieces as a step calls them, rank 0:")
        print(f"  {'piece':52s} {'calls':>5s} {'µs/call':>8s} {'µs/step':>8s}")
        total = 0.0
        for name, calls, us in rows:
            print(f"  {name:52s} {calls:5d} {us:8.1f} {calls * us:8.1f}")
            total += 0 if name.startswith("  ") else calls * us
        print(f"  {'total (parts indented are inside the rows above)':52s} {'':5s} {'':8s} {total:8.1f}"
              f"   = {total / 1e3:.2f} ms of the {(on - off) * 1e3:.1f} ms measured on - off")
    finally:
        for bench in benches.values():
            bench.close()


if __name__ == "__main__":
    main(sys.argv[1:])
