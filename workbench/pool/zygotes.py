"""The zygotes of this process: one per way of preparing ranks, shared by its pools, lingering after the last.

A pool `acquire`s the zygote for its ranks' environment and preparation and `release`s it when it closes; the
last release leaves it `LINGER_S` for a pool a next cell may make, then it ends. The zygote is the user's standby
where it is wanted and can be reached (`workbench.pool.user_standby`: taken over from an earlier kernel, or started
to outlive this one), else one of this process's own (`zygote.Zygote.start_private`). At most `MAX_ZYGOTES` live
at once; the least recently used idle one makes room.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from pathlib import Path

from workbench.machine import MACHINE_FACTS
from workbench.pool import user_standby
from workbench.pool.private_dir import DRIVER_PID
from workbench.pool.zygote import Zygote

LINGER_S = 120.0
"""How long a zygote outlives its last pool (a Workbench remade in the next cell forks instead of spawning)."""
MAX_ZYGOTES = 2
"""Zygotes kept at once in a process (each ~300 MB); the least recently used idle one ends first."""
PER_POOL = (MACHINE_FACTS, "WORKBENCH_PREPARE", "OMP_NUM_THREADS", DRIVER_PID)
"""Environment that differs between pools but is read only after the fork (the child gets the pool's own)."""

_lock = threading.Lock()
_zygotes: dict[str, Zygote] = {}
_lingering: dict[str, threading.Timer] = {}


def usable(device: str) -> bool:
    """Whether ranks of a pool on `device` may be forked: CPU ranks, zygotes not turned off."""
    if os.environ.get("WORKBENCH_ZYGOTE", "1") == "0":
        return False
    return device == "cpu" or (device == "auto" and not any(Path("/dev").glob("nvidia[0-9]*")))


def acquire(env: dict[str, str], prepare: dict, standby: bool = False) -> Zygote:
    """The zygote for ranks with this environment and preparation; `release` it. `standby`: the user's standby
    (`workbench.pool.user_standby`: taken over from an earlier kernel, or started to outlive this one), else, or
    where the standby cannot be reached, one of this process's own (started if there is none)."""
    shared = {k: v for k, v in env.items() if k not in PER_POOL}
    key = _key(shared, prepare, standby)
    with _lock:
        timer = _lingering.pop(key, None)
        if timer is not None:
            timer.cancel()
        zygote = _zygotes.get(key)
        if zygote is None or not zygote.alive:
            if zygote is not None:
                zygote.close()
            _evict_idle(keep=MAX_ZYGOTES - 1)
            zygote = _zygotes[key] = _start(shared, prepare, standby)
        zygote.users += 1
        return zygote


def _start(shared: dict[str, str], prepare: dict, standby: bool) -> Zygote:
    if standby:
        zygote = user_standby.connect(shared, prepare)
        if zygote is not None:
            return zygote
    return Zygote.start_private(shared, prepare)


def release(zygote: Zygote) -> None:
    """A pool no longer needs `zygote`; the last one leaves it `LINGER_S` for the next pool, then it ends."""
    with _lock:
        zygote.users -= 1
        if zygote.users > 0:
            return
        key = next((k for k, z in _zygotes.items() if z is zygote), None)
        if key is None:
            return
        timer = threading.Timer(LINGER_S, _end_if_idle, args=(key, zygote))
        timer.daemon = True
        timer.name = "workbench-zygote-linger"
        _lingering[key] = timer
        timer.start()


def close_all() -> None:
    with _lock:
        for timer in _lingering.values():
            timer.cancel()
        _lingering.clear()
        zygotes = list(_zygotes.values())
        _zygotes.clear()
    for zygote in zygotes:
        zygote.close()


def _end_if_idle(key: str, zygote: Zygote) -> None:
    with _lock:
        if zygote.users or _zygotes.get(key) is not zygote:
            return
        del _zygotes[key]
        _lingering.pop(key, None)
    zygote.close()


def _evict_idle(keep: int) -> None:
    idle = sorted((z.last_used, k) for k, z in _zygotes.items() if not z.users)
    while len(_zygotes) > keep and idle:
        _, key = idle.pop(0)
        timer = _lingering.pop(key, None)
        if timer is not None:
            timer.cancel()
        _zygotes.pop(key).close()


def _key(shared: dict[str, str], prepare: dict, standby: bool) -> str:
    return json.dumps([shared, {k: v for k, v in prepare.items() if k not in ("private_dir", "threads")}, standby],
                      sort_keys=True)


atexit.register(close_all)
