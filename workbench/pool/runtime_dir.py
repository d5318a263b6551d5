"""The user's own folder for what outlives a notebook kernel: the standby's socket and key, the machine's facts.

$WORKBENCH_RUNTIME_DIR if set (tests point it at a folder of their own, so a test run never meets a user's
standby), else `workbench` in $XDG_RUNTIME_DIR (the per-user tmpfs a login session gets, emptied at logout),
else `workbench-UID` in the temporary folder. Created with mode 0700; a folder that is someone else's, a
symbolic link, or open to others is refused (then nothing outlives the kernel: `None`), since whoever can write
there could stand in for the standby.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

ENV = "WORKBENCH_RUNTIME_DIR"


class RuntimeDirError(RuntimeError):
    """The runtime folder exists but is not safely the user's own."""


def path() -> Path:
    """Where the folder is (whether or not it exists yet)."""
    if env := os.environ.get(ENV):
        return Path(env).expanduser()
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(xdg) / "workbench"
    return Path(tempfile.gettempdir()) / f"workbench-{os.getuid()}"


def ensure(sub: str | None = None) -> Path:
    """The folder (and `sub` inside it), created 0700 if missing; RuntimeDirError if it is not the user's alone."""
    folder = path()
    for target in (folder, folder / sub) if sub else (folder,):
        try:
            os.mkdir(target, 0o700)
        except FileExistsError:
            pass
        check(target)
    return folder / sub if sub else folder


def check(folder: Path) -> None:
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode):
        raise RuntimeDirError(f"{folder} is not a folder (a link or a file): remove it, or set ${ENV}")
    if info.st_uid != os.getuid():
        raise RuntimeDirError(f"{folder} belongs to user {info.st_uid}, not to you ({os.getuid()}): set ${ENV}")
    if info.st_mode & 0o077:
        raise RuntimeDirError(f"{folder} is open to other users (mode {oct(info.st_mode & 0o777)}): "
                              f"run chmod 700 {folder}")
