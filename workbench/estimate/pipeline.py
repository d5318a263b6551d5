"""Pipeline parallel: the micro-batches a rank holds in flight in its schedule's order, its receive buffers, and
the sends between stages."""

from __future__ import annotations

import functools

from workbench.schedules import rank_orders
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


def receive_buffers(st: Stage) -> int:
    """torch allocates, once, a receive buffer per micro-batch for each stage's input (but the first stage's) and
    for the gradient of its output (but the last's), and keeps them between steps."""
    return st.boundaries * st.cfg.micro_batches * st.residual() if st.cfg.pp > 1 else 0


def pp_comm(st: Stage, net: Network) -> list[Collective]:
    cfg = st.cfg
    if cfg.pp == 1:
        return []
    # Forward sends the fp32 residual stream on (sequence-sharded under tp); backward sends its gradient back.
    # Each boundary is crossed both ways: this rank sends as many activations and gradients as it receives.
    return [collective(net, st.rank, "pp", "send_recv", Role.PIPELINE, "activations and their gradients",
                       st.boundaries * cfg.micro_batches, st.residual(), 2)]
