"""One collective summed over a step: its payload, the bytes it puts on a rank's busiest link, and their time."""

from __future__ import annotations

from workbench.estimate.records import Axis, Collective, CollectiveKind, Role
from workbench.hardware import Hardware
from workbench.telemetry.analysis import bus_factor


def collective(hw: Hardware, axis: Axis, kind: CollectiveKind, role: Role, what: str, calls: int, payload: float,
               group: int, hidden_by: float = 0.0) -> Collective:
    """`calls` collectives of `payload` bytes each (the whole gathered or reduced data) among `group` ranks;
    `hidden_by` seconds of computation run beside them."""
    nbytes = payload * calls
    # send_recv counts this rank's sends; links are full duplex, so what it receives takes nothing from them.
    wire = nbytes * bus_factor("send" if kind == "send_recv" else kind, group)
    time_s = wire / hw.link_bw
    return Collective(axis=axis, kind=kind, role=role, what=what, calls=calls, bytes=round(nbytes),
                      wire_bytes=round(wire), time_s=time_s, exposed_s=max(0.0, time_s - hidden_by))
