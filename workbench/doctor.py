"""Check (and with --build, prepare) what the workbench needs on this machine.

    python -m workbench.doctor           # report
    python -m workbench.doctor --build   # also build the compiled telemetry extension and the data cache

The set-up (`make setup`) runs the --build form once, so no test session or
notebook ever pays for a compile.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import time


def _step(name: str, fn) -> bool:
    t = time.perf_counter()
    try:
        detail = fn()
    except Exception as e:  # noqa: BLE001 - report every failure, then exit non-zero
        print(f"  ✗ {name}: {type(e).__name__}: {e}")
        return False
    print(f"  ✓ {name} ({time.perf_counter() - t:.1f} s){': ' + detail if detail else ''}")
    return True


def _torch() -> str:
    import torch

    cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "CPU only"
    return f"torch {torch.__version__}, {cuda}"


def _extension() -> str:
    native = importlib.import_module("workbench.telemetry.native")
    if native.main(["--build"]) != 0:  # also compiles the CUDA library where nvcc is
        raise RuntimeError("the telemetry extension did not build (see above)")
    return str(native.extension_path())


def _data() -> str:
    data = importlib.import_module("workbench.shards")
    return data.prepare_default_corpus()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workbench.doctor")
    p.add_argument("--build", action="store_true", help="build the extension and the data cache")
    a = p.parse_args(argv)
    print(f"workbench doctor — Python {sys.version.split()[0]}")
    ok = _step("torch", _torch)
    print(f"  · nvcc: {shutil.which('nvcc') or 'not found (the CUDA part of the extension is compiled where it is)'}")
    if a.build:
        ok &= _step("telemetry extension", _extension)
        ok &= _step("data cache", _data)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
