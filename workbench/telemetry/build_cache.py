"""Where the compiled telemetry code is kept: one cache, shared by every checkout, for the C++ extension
(`workbench.telemetry.native`) and the CUDA library (`workbench.telemetry.cuda`), and the error both raise when a
build fails."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

STALE_AFTER_DAYS = 30
"""A cached build no process has loaded for this long is removed by the next `--build`."""


class NativeBuildError(RuntimeError):
    """The extension could not be built or loaded; the message says why and what to do."""


def cache_root() -> Path:
    """``$WORKBENCH_CACHE``, else ``$XDG_CACHE_HOME/workbench``, else ``~/.cache/workbench``."""
    if env := os.environ.get("WORKBENCH_CACHE"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "workbench"


def mark_used(folder: Path) -> None:
    """Stamp a build folder as loaded now: its modification time is what pruning reads."""
    with contextlib.suppress(OSError):
        os.utime(folder)


def prune_stale_builds(keep: Iterable[Path], max_age_days: float = STALE_AFTER_DAYS) -> list[Path]:
    """Remove cached builds not loaded for `max_age_days` (every source version leaves one); never those in `keep`.

    Other checkouts share the cache, so a build is judged by when it was last
    used, not by whether it is this checkout's.
    """
    keep = {Path(k).resolve() for k in keep}
    cutoff = time.time() - max_age_days * 86400
    removed = []
    for folder in sorted((cache_root() / "extensions").glob("*-*")):
        try:
            if folder.resolve() in keep or not folder.is_dir() or folder.stat().st_mtime >= cutoff:
                continue
            shutil.rmtree(folder)
        except OSError:
            continue  # in use or not ours to remove: leave it
        removed.append(folder)
    return removed
