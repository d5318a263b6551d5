"""ZeRO-Offload (Config.offload): what leaves the device and what the host holds instead."""

from __future__ import annotations

from dataclasses import replace

from workbench.config import Config
from workbench.estimate.records import Memory
from workbench.estimate.stage import ceil_div


def offloaded(memory: Memory, cfg: Config, param_bytes: int, sync: int) -> Memory:
    """`memory` with Config.offload: zero 2/3 (FSDP2's CPUOffloadPolicy) keeps the parameter and gradient shards
    and the moments on the host; zero 0/1 (a host AdamW) the moments, the fp32 master copy and a pinned gradient
    buffer of this rank's optimizer share (ZeRO-1 shards over the `sync` ranks, dp·cp)."""
    if cfg.zero >= 2:
        host = memory.parameters + memory.gradients + memory.optimizer
        return replace(memory, parameters=0, gradients=0, optimizer=0, host=host)
    share = ceil_div(param_bytes, sync if cfg.zero == 1 else 1)
    return replace(memory, optimizer=0, host=memory.optimizer + 2 * share)
