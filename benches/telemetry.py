"""What full telemetry costs: step time with it on vs off, in the same ranks, beside the noise of the method.

The probe's cost: one pool (started with the recording backend) applies the
same layout again and again, with the probe on, off, and off again (the A/A
arm: the same as off, so its ratio is what the method reads for no change),
each round in another of their six orders (so each arm is as often first, and
after each of the others), and trains a few steps after each. Each
arm's round gives a mean step time (the meter's sampled steps count where
they fall; a step over 1.5x the round's median, another process preempting
this one, is left out: the probe costs a few percent, never that); a round's
on/off ratio sets two arms run seconds apart side by side, and the figure is
the median over rounds, the A/A one beside it. Beside the wall time, the CPU
time the ranks' processes spent per step (every thread: the training loop,
gloo's, the events sent): what other processes' load disturbs far less. Comparing two pools instead reads ±5% for no
change on 2 cores (benches/latency.py measured it): ranks placed on cores
differently, allocators in different states.

The recording backend's cost, apart: it is registered when a pool starts, so
no apply can take it away. Each rank replays one step's collectives (their
kinds and sizes as recorded) through a recording group and a plain gloo
group of the same ranks, alternated; the difference, per step, against the
step time: an upper bound, as the replay waits for each collective while a
real step overlaps DDP's with backward.

Then where the probe's own time goes on a rank, piece by piece. On CPU (the
default) the tiny model at dp=2; on a GPU (``--device cuda``) one rank per GPU
at the 125m preset, where telemetry is CUDA event marks on the streams
(target: on/off <= 1.02).

    .venv/bin/python benches/telemetry.py                          # about 3 minutes on 2 quiet cores
    .venv/bin/python benches/telemetry.py --device cuda            # world size = GPUs, 125m, bf16
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("OMP_NUM_THREADS", "1")

import workbench as wb  # noqa: E402

CFG = wb.Config(dp=2)
WARMUP, STEPS, ROUNDS = 3, 15, 12
ARMS = ("on", "off", "off again")
"""The probe on, off, and off again: "off again" is "off" in another apply, the A/A arm that shows the noise."""
ORDERS = list(itertools.permutations(ARMS))


@dataclass(frozen=True)
class ToggledCost:
    """Each arm's mean step time (s) round by round, and the ratios they give."""

    rounds: dict[str, list[float]]
    cpu_rounds: dict[str, list[float]]
    """Each arm's CPU seconds a step, round by round: the ranks' processes' (every thread), the busier rank's."""

    def _ratios(self, arm: str, cpu: bool = False) -> list[float]:
        rounds = self.cpu_rounds if cpu else self.rounds
        return [a / b for a, b in zip(rounds[arm], rounds["off"])]

    @property
    def ratio(self) -> float:
        """on / off, the median over rounds."""
        return statistics.median(self._ratios("on"))

    @property
    def aa_ratio(self) -> float:
        """off again / off, the median over rounds: what the method reads for no change; |1 - it| is its noise."""
        return statistics.median(self._ratios("off again"))

    def cpu_ratio(self, arm: str = "on") -> float:
        return statistics.median(self._ratios(arm, cpu=True))

    def spread(self, arm: str = "on", cpu: bool = False) -> tuple[float, float]:
        """The quartiles of the rounds' ratios of `arm` to off."""
        ratios = self._ratios(arm, cpu)
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        return q[0], q[2]

    def mean(self, arm: str, cpu: bool = False) -> float:
        return statistics.fmean((self.cpu_rounds if cpu else self.rounds)[arm])


def _round_mean(times: list[float]) -> float:
    """A round's mean step time, without steps over 1.5x its median (another process took the core meanwhile)."""
    limit = 1.5 * statistics.median(times)
    return statistics.fmean([t for t in times if t <= limit])


def toggled_cost(bench: wb.Workbench, cfg: wb.Config, rounds: int = ROUNDS, steps: int = STEPS,
                 warmup: int = WARMUP) -> ToggledCost:
    """The probe's cost on `bench`'s ranks: `cfg` applied with telemetry on, off and off again each round, in the
    arms' six orders in turn (a multiple of 6 rounds balances position and predecessor), `steps` timed after
    `warmup`.
    Leaves `bench.telemetry` as it found it."""
    kept = bench.telemetry
    times: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
    try:
        for r in range(rounds):
            for arm in ORDERS[r % len(ORDERS)]:
                bench.telemetry = arm == "on"
                bench.apply(cfg)
                bench.train(warmup).wait()
                before = bench.pool.run(time.process_time)
                times[arm].append([m.step_time_s for m in bench.train(steps).wait()])
                cpu[arm].append(max(b - a for a, b in zip(before, bench.pool.run(time.process_time))) / steps)
    finally:
        bench.telemetry = kept
    return ToggledCost({arm: [_round_mean(run) for run in runs] for arm, runs in times.items()}, cpu)


def replay_collectives(collectives: list[tuple[str, int]], reps: int = 30) -> dict[str, float]:
    """On every rank: seconds per replay of `collectives` ((kind, bytes) of one step) through a recording group and
    through a plain gloo group of the same ranks, medians of `reps` replays alternated. Both groups are destroyed
    after, so nothing stays behind."""
    import torch
    import torch.distributed as dist

    from workbench.pool import rank

    device = torch.device(rank.info.device)
    ranks = list(range(dist.get_world_size()))
    plain = "nccl" if device.type == "cuda" else "gloo"  # what the recording backend wraps for this device
    groups = {"recording": dist.new_group(ranks), "plain": dist.new_group(ranks, backend=plain)}
    ops = {"all_reduce": dist.all_reduce, "broadcast": lambda t, group: dist.broadcast(t, 0, group=group)}
    tensors = [(ops[kind], torch.zeros(max(1, nbytes // 4), device=device))
               for kind, nbytes in collectives if kind in ops]
    spent: dict[str, list[float]] = {name: [] for name in groups}
    try:
        for rep in range(reps + 2):
            for name in (("recording", "plain") if rep % 2 else ("plain", "recording")):
                dist.barrier(group=groups[name])
                t = time.perf_counter()
                for op, x in tensors:
                    op(x, group=groups[name])
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if rep >= 2:  # the first replays warm the groups' connections
                    spent[name].append(time.perf_counter() - t)
    finally:
        for group in groups.values():
            dist.destroy_process_group(group)
    return {name: statistics.median(v) for name, v in spent.items()}


def recording_backend_cost(bench: wb.Workbench) -> tuple[float, float, list[tuple[str, int]]]:
    """(recording, plain) seconds per step's collectives, the slowest rank's, and the collectives replayed:
    those of one step of the layout applied on `bench` (telemetry on), as its intervals recorded them."""
    kept = bench.telemetry
    bench.telemetry = True
    try:
        bench.apply(bench.config)
        last = bench.train(2).wait()[-1]
    finally:
        bench.telemetry = kept
    collectives = [(iv.name, iv.bytes) for iv in last.intervals if iv.kind == "comm"]
    per_rank = bench.pool.run(replay_collectives, collectives)
    return max(r["recording"] for r in per_rank), max(r["plain"] for r in per_rank), collectives


def print_costs(cost: ToggledCost, backend: tuple[float, float, list[tuple[str, int]]]) -> None:
    recording, plain, collectives = backend
    off = cost.mean("off")
    print(f"step time, probe off / off again / on: {off * 1e3:.1f} / {cost.mean('off again') * 1e3:.1f} / "
          f"{cost.mean('on') * 1e3:.1f} ms (means of {len(cost.rounds['off'])} rounds each, the same ranks: "
          f"on / both offs {cost.mean('on') / statistics.fmean([off, cost.mean('off again')]):.4f})")
    (lo, hi), (aa_lo, aa_hi) = cost.spread("on"), cost.spread("off again")
    print(f"probe on/off: {cost.ratio:.4f} (rounds' quartiles {lo:.3f}–{hi:.3f});  "
          f"A/A off again/off: {cost.aa_ratio:.4f} ({aa_lo:.3f}–{aa_hi:.3f}): medians over rounds")
    (lo, hi), (aa_lo, aa_hi) = cost.spread("on", cpu=True), cost.spread("off again", cpu=True)
    print(f"CPU time a step, off / off again / on: {cost.mean('off', True) * 1e3:.1f} / "
          f"{cost.mean('off again', True) * 1e3:.1f} / {cost.mean('on', True) * 1e3:.1f} ms; on/off "
          f"{cost.cpu_ratio():.4f} ({lo:.3f}–{hi:.3f});  A/A {cost.cpu_ratio('off again'):.4f} ({aa_lo:.3f}–{aa_hi:.3f})")
    kinds = ", ".join(f"{kind} {nbytes / 1e3:,.1f} kB" for kind, nbytes in collectives)
    print(f"recording backend: {(recording - plain) * 1e6:+.0f} µs a step = {(recording - plain) / off:+.2%} "
          f"of the step (a step's collectives replayed: recording {recording * 1e3:.3f} ms, plain gloo "
          f"{plain * 1e3:.3f} ms; {kinds})")


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
    from workbench.telemetry import activations, analysis, probes

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
    rows.append(("  step_summary", 1, per_call(lambda: analysis.step_summary(spans))))
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
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds of the three arms (default {ROUNDS})")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"steps timed per arm and round (default {STEPS})")
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
    bench = wb.Workbench(world, device=args.device, telemetry=True, standby=False)
    try:
        print(f"{args.device}: {cfg.layout}, model dim {cfg.model.dim} x {cfg.model.n_layers} layers, "
              f"{cfg.precision}; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        cost = toggled_cost(bench, cfg, rounds=args.rounds, steps=args.steps)
        backend = recording_backend_cost(bench)
        print_costs(cost, backend)
        print(f"TELEMETRY_RATIO={cost.ratio:.4f}")  # one machine-readable line for benches/gpu_check.sh
        bench.apply(cfg)  # telemetry on
        last = bench.train(1).wait()[-1]
        kinds = sorted({(iv.kind, iv.stream) for iv in last.intervals})
        print(f"a step with telemetry on: {len(last.intervals)} intervals {kinds}, "
              f"comm {last.comm_time_s * 1e3:.2f} ms, exposed {last.exposed_comm_s * 1e3:.2f} ms, "
              f"overlap {last.overlap}, device memory {getattr(last, 'device_memory', {})}")
        rows = bench.pool.run(probe_costs)[0]
        print("the probe's pieces as a step calls them, rank 0 (the meter's on the steps it watches):")
        print(f"  {'piece':52s} {'calls':>5s} {'µs/call':>8s} {'µs/step':>8s}")
        total = 0.0
        for name, calls, us in rows:
            print(f"  {name:52s} {calls:5d} {us:8.1f} {calls * us:8.1f}")
            total += 0 if name.startswith("  ") else calls * us
        print(f"  {'total (parts indented are inside the rows above)':52s} {'':5s} {'':8s} {total:8.1f}"
              f"   = {total / 1e3:.2f} ms of the {(cost.mean('on') - cost.mean('off')) * 1e3:.1f} ms measured on - off")
    finally:
        bench.close()


if __name__ == "__main__":
    main(sys.argv[1:])
