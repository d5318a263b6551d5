"""Startup benches measure imports, so they refuse to run where torch's modules have no bytecode.

`make setup` installs with pip's --no-compile (compiling ~17,000 modules took most of the set-up) and many
containers set PYTHONDONTWRITEBYTECODE=1: there, every fresh interpreter compiles what it imports from source.
Measured on this machine (2026-12-07): `import torch, torch._dynamo` 6.2-7.1 s without bytecode, 1.0-1.5 s with
it, and the first cell's cold start 7.4 s instead of ~2. No user meets that (`make lab` compiles everything
first, and pip compiles by default), so a figure taken so would measure the compiler, not workbench.
"""

from __future__ import annotations

import importlib.util
import sys
import sysconfig
from pathlib import Path

# Modules every rank imports at start, from torch's largest import chains (torch itself, torch._dynamo).
PROBES = ("torch/__init__.py", "torch/_dynamo/convert_frame.py", "torch/distributed/tensor/_ops/_math_ops.py")


def missing_bytecode(site: Path | None = None) -> list[str]:
    """The probe modules installed in `site` (this interpreter's site-packages) whose compiled bytecode is absent."""
    site = site or Path(sysconfig.get_paths()["purelib"])
    return [probe for probe in PROBES
            if (site / probe).exists() and not Path(importlib.util.cache_from_source(str(site / probe))).exists()]


def require_compiled(bench: str) -> None:
    """Exit with a clear message, before measuring anything, where startup would compile torch from source."""
    if missing := missing_bytecode():
        sys.exit(f"{bench}: torch's modules have no bytecode in this environment ({', '.join(missing)} not "
                 "compiled), so every interpreter would compile them from source, seconds of each start that "
                 "no user waits for. Compile them first: `make .venv/.compiled` (what `make lab` and `make bench` "
                 "do), then run this again.")
