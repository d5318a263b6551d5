"""Pipeline parallel: the micro-batches a rank holds in flight in its schedule's order, its receive buffers, the
sends between stages, and (GPU model) the schedule run in time with each stage's own compute."""

from __future__ import annotations

import functools

from workbench.schedules import Action, rank_orders, simulate
from workbench.estimate.collectives import Network, collective
from workbench.estimate.records import Collective, Role
from workbench.estimate.stage import Stage


@functools.lru_cache(maxsize=128)
def _rank_orders(schedule: str, pp: int, micro_batches: int, chunks: int) -> tuple[tuple, ...]:
    """Every rank's actions in order, computed once per schedule shape: each stage of an estimate, and each of the
    many layouts `wb.plan` estimates, reads the same grid."""
    return tuple(tuple(order) for order in rank_orders(schedule, pp, micro_batches, chunks))


def peak_in_flight(st: Stage, saved: dict[int, int]) -> int:
    """The most bytes saved at once, walking this rank's actions in the schedule's order: a forward adds its
    stage's micro-batch (`saved[stage]`), a full backward (or a weight-gradient half) frees one. Interleaved stages save different amounts, so
    which forward ends at the peak depends on the order, not only on how many micro-batches are in flight."""
    cfg = st.cfg
    if cfg.pp == 1:
        return saved[0]  # gradient accumulation backpropagates each micro-batch before the next forward
    live = peak = 0
    for action in _rank_orders(cfg.schedule, cfg.pp, cfg.micro_batches, st.chunks)[st.rank]:
        # A split backward's input half (I) keeps the graph alive for its weight half (W): torch's pipelining runs
        # I with retain_graph, so a micro-batch's saved tensors go only when its W (or a full B) has run.
        if action.kind == "F":
            live += saved[action.stage]
        elif action.kind in ("B", "W"):
            live -= saved[action.stage]
        peak = max(peak, live)
    return peak


def pipeline_span(st: Stage, times: dict[int, tuple[float, float]], hop_s: float) -> float:
    """Seconds from the first forward to the last backward of a step: the schedule's actions placed in time, each
    as early as its rank and its inputs allow (`schedules.simulate`), a stage's forward and backward of one
    micro-batch taking `times[stage]` (uneven stages, the embedding's and the head's chunks, each their own) and
    every hop between ranks a send of the stage boundary (`hop_s`), posted when the receiving rank is free (torch
    batches a stage's receive with its previous action's send). A split backward's halves take half of B each."""
    cfg = st.cfg
    return _span(cfg.schedule, cfg.pp, cfg.micro_batches, st.chunks, tuple(sorted(times.items())), hop_s)


@functools.lru_cache(maxsize=4096)
def _span(schedule: str, pp: int, micro_batches: int, chunks: int, times: tuple[tuple[int, tuple[float, float]], ...],
          hop_s: float) -> float:
    # Cached on plain numbers: of the layouts `wb.plan` estimates, those that differ only in what a stage's actions
    # do not see (the ZeRO stage, the data-parallel collectives) run the same schedule in the same times (for the
    # 8B plan on 64 H100s, 1,572 different runs of 4,544).
    durations = dict(times)

    def duration(action: Action) -> float:
        forward, backward = durations[action.stage]
        return forward if action.kind == "F" else backward if action.kind == "B" else backward / 2

    orders = _rank_orders(schedule, pp, micro_batches, chunks)
    return simulate(orders, duration, chunks, hop_s, receive_when_free=True).makespan


def receive_buffers(st: Stage) -> int:
    """torch allocates, once, a receive buffer per micro-batch for each stage's input (but the first stage's) and
    for the gradient of its output (but the last's), and keeps them between steps."""
    return st.boundaries * st.cfg.micro_batches * st.residual() if st.cfg.pp > 1 else 0


def pp_comm(st: Stage, net: Network, in_time: bool = False) -> list[Collective]:
    """The sends between stages. `in_time`: the step's span already holds them (`pipeline_span` waits for each
    hop on the critical path), so none is exposed beyond it."""
    cfg = st.cfg
    if cfg.pp == 1:
        return []
    # Forward sends the residual stream on (sequence-sharded under tp); backward sends its gradient back.
    # Each boundary is crossed both ways: this rank sends as many activations and gradients as it receives.
    calls = st.boundaries * cfg.micro_batches
    return [collective(net, st.rank, "pp", "send_recv", Role.PIPELINE, "activations and their gradients",
                       calls, st.residual(), 2, hidden_by=float("inf") if in_time else 0.0)]


def hop_time(st: Stage, net: Network) -> float:
    """Seconds one send of a stage boundary takes between neighbouring pipeline ranks."""
    return net.call_time("send_recv", "pp", st.residual(), 2, st.rank)
