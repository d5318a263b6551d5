"""The pool's private folder (mode 0700: control socket, key, rendezvous store) and its removal.

A pool removes its folder when it closes. A driver that is killed cannot, so
two others do: its local ranks, which notice the driver is gone (their
parent changed) and remove the folder before they exit; and the next pool
started on the machine, which sweeps the folders of drivers that no longer
run. The folder names its driver's pid, and a `driver` file inside holds the
pid and the process's start time, so a recycled pid is not taken for it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

PREFIX = "workbench-"
OWNER_FILE = "driver"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None if it is not running."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not ours to judge
    return started is None or _start_time(pid) in (None, started)


_removing = threading.Lock()

DRIVER_PID = "WORKBENCH_DRIVER_PID"
"""The environment variable that names a local rank's driver (the notebook's process): its parent, unless a
zygote forked it (`workbench.pool.zygote`)."""

def create() -> str:
    """A fresh private folder for this process's pool, after sweeping the folders of dead drivers."""
    sweep()
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
    (Path(path) / OWNER_FILE).write_text(f"{os.getpid()} {_start_time(os.getpid()) or ''}\n")
    return path


def sweep(root: str | None = None) -> list[str]:
    """Remove private folders (of this user) whose driver process is gone; returns what was removed."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            if not folder.is_dir() or folder.is_symlink() or folder.stat().st_uid != os.getuid():
                continue
            pid_text, _, started = (folder / OWNER_FILE).read_text().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            continue  # not one of ours, or being created right now
        if not _alive(pid, started.strip() or None):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed


def remove_if_driver_gone(path: str | None, driver_pid: int, wait_s: float = 1.0) -> None:
    """Called by a local rank on its way out: if its driver died, nobody else will remove the driver's folder now.

    A rank can see its connection or stdin end while the driver is still exiting (its files close before it
    is gone): so the driver counts as dead once its process is gone or a zombie, looked at for up to `wait_s`.
    """
    if not path:
        return
    deadline = time.monotonic() + wait_s
    while not _driver_gone(driver_pid):
        if time.monotonic() >= deadline:
            return  # alive: it closed on us on purpose, and removes its folder itself
        time.sleep(0.01)
    # One remover per process: a rank's threads all notice the death, and each exits the process once this returns.
    # Unserialized, one that found the owner file already gone (another thread removes the folder, owner file
    # last) returned and exited the process before that thread's rmdir: an empty folder that no sweep claims.
    with _removing:
        try:
            owner = int((Path(path) / OWNER_FILE).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        if owner == driver_pid:
            remove(path)


def remove(path: str) -> None:
    """Remove a private folder, its owner file last: a rank removing it at the same time (a session's ranks and
    the standby all notice their driver's death at once) still finds whose folder it is, instead of giving up
    on a folder another remover has half emptied, or that one cut short as its process exited."""
    folder = Path(path)
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    for entry in entries:
        if entry.name == OWNER_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    (folder / OWNER_FILE).unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass  # another remover is not done with it yet: it removes the folder itself


def _driver_gone(driver_pid: int) -> bool:
    # The driver's own state, not whether it is still our parent: a forked rank's parent is the zygote.
    try:
        state = Path(f"/proc/{driver_pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")
