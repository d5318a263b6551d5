"""The compiled telemetry extension, as ranks use it.

It is built once (``python -m workbench.telemetry.native --build``) into a
persistent cache keyed by its sources and the torch version, and loaded from
there by every rank; nothing falls back to a Python measure if it is missing,
because numbers from another clock or another method would silently differ.

What it offers: the rank's monotonic clock (``now_ns``, the same clock as
``time.monotonic_ns``), a recorder of timed spans that compute probes and
the recording communication backend (``workbench.telemetry.comm``) write into,
the flight recorder, the emulation's pacing and the quantisers. The arithmetic
over what it records is plain Python (``workbench.telemetry.analysis``), since
the notebook, which never imports torch, needs it too.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType

from workbench.telemetry.events import Interval, IntervalKind

SOURCE_DIR = Path(__file__).resolve().parents[2] / "extensions" / "telemetry"
_CFLAGS = ["-O2"]  # torch adds its own -std (C++20 for 2.13); never override it
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


def _sources() -> list[Path]:
    found = sorted(SOURCE_DIR.glob("*.cpp"))
    if not found:
        raise NativeBuildError(
            f"no C++ sources in {SOURCE_DIR}: the telemetry extension ships with the "
            "workbench source tree (extensions/telemetry); install workbench from it"
        )
    return found


@functools.cache
def build_key() -> str:
    """Hash of everything the binary depends on: sources, headers, flags, torch and Python."""
    import torch

    h = hashlib.sha256()
    for path in sorted(SOURCE_DIR.glob("*.[ch]*")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{sys.platform}|{_CFLAGS}".encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    return cache_root() / "extensions" / f"telemetry-{build_key()}"


def _module_name() -> str:
    return f"wb_telemetry_{build_key()}"


def extension_path() -> Path:
    return build_dir() / f"{_module_name()}.so"


def is_built() -> bool:
    return extension_path().is_file()


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


def build(verbose: bool = False) -> Path:
    """Compile the extension into the cache if it is not there yet; return the .so path."""
    if is_built():
        return extension_path()
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise NativeBuildError(
            "cannot build the telemetry extension: no C++ compiler "
            f"({os.environ.get('CXX', 'c++')}) on PATH; install g++ (apt-get install g++)"
        )
    import torch.distributed  # noqa: F401  (registers c10d types the sources use)
    from torch.utils import cpp_extension

    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError as e:
        raise NativeBuildError(f"cannot build the telemetry extension: {e} (pip install ninja)") from e
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    try:
        # torch's load() takes a file lock in `out`, so ranks starting together
        # build once and the others wait.
        cpp_extension.load(
            name=_module_name(),
            sources=[str(p) for p in _sources()],
            build_directory=str(out),
            extra_cflags=_CFLAGS,
            verbose=verbose,
        )
    except Exception as e:
        raise NativeBuildError(
            f"building the telemetry extension from {SOURCE_DIR} into {out} failed: {e}\n"
            "Rerun `python -m workbench.telemetry.native --build --verbose` to see the compiler output."
        ) from e
    return extension_path()


_lock = threading.Lock()
_module: ModuleType | None = None


def load() -> ModuleType:
    """The extension module, built first if the cache does not hold it yet."""
    global _module
    with _lock:
        if _module is None:
            path = build()
            import torch.distributed  # noqa: F401  (the module's signatures name c10d types)

            name = _module_name()
            loader = importlib.machinery.ExtensionFileLoader(name, str(path))
            spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
            if spec is None:
                raise NativeBuildError(f"cannot load the telemetry extension from {path}")
            module = importlib.util.module_from_spec(spec)
            try:
                loader.exec_module(module)
            except ImportError as e:
                raise NativeBuildError(
                    f"the telemetry extension at {path} does not load ({e}); delete "
                    f"{path.parent} and rebuild with `python -m workbench.telemetry.native --build`"
                ) from e
            _module = module
            mark_used(path.parent)
        return _module


# --- clock and recorder -----------------------------------------------------------


def now_ns() -> int:
    """The rank's monotonic clock in ns (steady_clock; equal to ``time.monotonic_ns()``)."""
    return load().now_ns()


@functools.cache
def recorder():
    """The rank's recorder (one per process): ``begin``/``end``/``drain``, ``set_enabled``,
    ``enabled``, ``open_count``, ``dropped``. The recording backend writes into it too."""
    return load().recorder()


def begin(kind: IntervalKind, name: str, stream: str = "main") -> int:
    """Open a span stamped now; returns the token for :func:`end` (0 while disabled)."""
    return recorder().begin(kind, name, stream)


def end(token: int) -> None:
    recorder().end(token)


@contextlib.contextmanager
def span(kind: IntervalKind, name: str, stream: str = "main") -> Iterator[None]:
    """Record the body as one span; on an exception the span is still closed."""
    rec = recorder()
    token = rec.begin(kind, name, stream)
    try:
        yield
    finally:
        rec.end(token)


# Drained from the recorder but not yet taken: host-stamped spans (drain) and CUDA collectives with marks
# (drain_marked), each in the order the recorder gave them.
_host: list[Interval] = []
_marked: list = []


def _pull() -> None:
    for row in recorder().drain():
        if row[8]:  # start_mark: a CUDA collective timed by CUDA events, resolved later
            from workbench.telemetry.gpu_timeline import MarkedSpan

            kind, name, _, _, nbytes, group_size, stream, group, start_mark, end_mark, queue = row
            _marked.append(MarkedSpan(kind, name, start_mark, end_mark, bytes=nbytes, group_size=group_size,
                                      stream=stream, group=group, queue=queue))
        else:
            _host.append(Interval(*row[:8]))


def drain() -> list[Interval]:
    """Every finished host-stamped span since the last drain, in the order they ended.

    CUDA collectives carry CUDA event marks instead of host times; they are set
    aside for :func:`drain_marked` (``gpu_timeline`` resolves them).
    """
    _pull()
    taken = list(_host)
    _host.clear()
    return taken


def drain_marked() -> list:
    """CUDA collectives recorded with marks since the last call (``gpu_timeline.MarkedSpan``), in issue order."""
    _pull()
    taken = list(_marked)
    _marked.clear()
    return taken


# --- command line -----------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workbench.telemetry.native", description="Build the telemetry extension."
    )
    parser.add_argument("--build", action="store_true", help="build into the cache if needed")
    parser.add_argument("--verbose", action="store_true", help="show compiler output")
    parser.add_argument("--path", action="store_true", help="print where the binary is (or goes)")
    args = parser.parse_args(argv)
    if args.path:
        print(extension_path())
    if args.build:
        cold = not is_built()
        t0 = time.perf_counter()
        try:
            path = build(verbose=args.verbose)
            load()
        except NativeBuildError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        took = time.perf_counter() - t0
        print(f"{'built' if cold else 'already built'}: {path} ({took:.1f} s)")
        code = _build_cuda(args.verbose)
        if code == 0:
            from workbench.telemetry import cuda

            stale = prune_stale_builds(keep=[build_dir(), cuda.library_path().parent])
            if stale:
                print(f"removed {len(stale)} cached build(s) unused for {STALE_AFTER_DAYS} days: "
                      + ", ".join(p.name for p in stale))
        return code
    return 0


def _build_cuda(verbose: bool) -> int:
    # The CUDA library needs only nvcc, so it is built wherever nvcc exists,
    # GPU or not; without nvcc, ranks simply cannot use CUDA telemetry.
    from workbench.telemetry import cuda

    if cuda.nvcc() is None:
        print("CUDA telemetry library: skipped (no nvcc; set CUDA_HOME to build it)")
        return 0
    t0 = time.perf_counter()
    try:
        path = cuda.build(verbose=verbose)
    except NativeBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"CUDA telemetry library: {path} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
