"""Rank functions for the emulation tests."""

from __future__ import annotations

from workbench.emulation.collectives import KINDS, time_kinds

__all__ = ["KINDS", "time_kinds", "emulation_status"]


def emulation_status() -> dict:
    from workbench.emulation import rank as emulation

    status = emulation.status()
    status.pop("cluster")
    return status
