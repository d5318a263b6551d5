"""The notebook kernel a Workbench lives in: whether this code runs in one, the kernel's one live Workbench, and
every Workbench made in it.

A Workbench made in a kernel is exclusive unless told otherwise (`Workbench(exclusive=...)`): making a new one
closes the previous one first, so that two pools never share the cores and an old dashboard never drives old
ranks. Outside a kernel (scripts, tests) nothing is closed for you.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workbench.workbench import Workbench

_live: "weakref.ref[Workbench] | None" = None
_made: "weakref.WeakValueDictionary[int, Workbench]" = weakref.WeakValueDictionary()


def in_kernel() -> bool:
    """True inside a Jupyter kernel (an IPython shell with a kernel), without importing IPython otherwise."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


def live() -> "Workbench | None":
    """The kernel's exclusive Workbench, if one is alive."""
    return _live() if _live is not None else None


def made(bench: "Workbench") -> None:
    """`bench` was made in this process (every Workbench says so as it starts)."""
    _made[id(bench)] = bench


def is_workbench(value: object) -> bool:
    """Whether `value` is a Workbench made in this process (`%%ranks` looks for them among a notebook's
    variables; asked here, the magic does not import the facade that opens the screen it is registered from)."""
    return _made.get(id(value)) is value


def claim(bench: "Workbench") -> None:
    """`bench` is now the kernel's exclusive Workbench."""
    global _live
    _live = weakref.ref(bench)


def close_previous() -> None:
    """Close the kernel's exclusive Workbench, if one is open, and say so (the warning points at the caller's
    caller: the cell that makes the new Workbench)."""
    global _live
    previous, _live = live(), None
    if previous is None or previous.closed:
        return
    what = (f"{previous.pool.world_size} ranks, layout {previous.config.layout if previous.config else 'none'}, "
            f"{len(previous.history)} steps trained")
    previous.close()
    warnings.warn(f"closed the previous Workbench ({what}) before starting this one: one live Workbench per "
                  "kernel, so that two pools never share the cores and an old dashboard never drives old ranks "
                  "(its runs stay readable). Workbench(..., exclusive=False) keeps both.", stacklevel=3)
