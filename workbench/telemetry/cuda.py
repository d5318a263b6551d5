"""The CUDA part of the telemetry: marks (CUDA events read back without waiting), device memory counters, and the
quantisers of gradient compression.

Built from ``extensions/cuda/*.cu`` with nvcc alone (CUDA runtime API only,
no torch CUDA libraries needed to compile) into a shared library in the same
persistent cache as the C++ extension, and loaded with ctypes. Streams are
passed as integers (``torch.cuda.Stream.cuda_stream``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

from workbench.telemetry.build_cache import NativeBuildError, cache_root, mark_used

SOURCE_DIR = Path(__file__).resolve().parents[2] / "extensions" / "cuda"
ABI_VERSION = 3
# Cubins for A100 and H100/H200, plus PTX for compute 7.5 that the driver
# compiles for any newer GPU; WORKBENCH_CUDA_ARCHS="80;90" overrides.
_DEFAULT_GENCODE = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_75,code=compute_75",
]


class CudaError(RuntimeError):
    """A CUDA runtime call failed; the message carries cudaGetErrorString's text."""


def nvcc() -> str | None:
    """Path of nvcc: ``$CUDA_HOME/bin/nvcc``, else the one on PATH, else None."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _gencode() -> list[str]:
    archs = os.environ.get("WORKBENCH_CUDA_ARCHS")
    if not archs:
        return list(_DEFAULT_GENCODE)
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs.replace(",", ";").split(";") if a]


def _flags() -> list[str]:
    return ["--shared", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden", "-O2", "-std=c++17", *_gencode()]


def compile_command(output: Path) -> list[str]:
    """The nvcc command line that builds the library into ``output``."""
    compiler = nvcc()
    if compiler is None:
        raise NativeBuildError("cannot build the CUDA telemetry library: nvcc not found (set CUDA_HOME)")
    sources = sorted(str(p) for p in SOURCE_DIR.glob("*.cu"))
    return [compiler, *_flags(), *sources, "-o", str(output)]


def library_path() -> Path:
    """Where the build of these sources with these flags lives: either changed, a new build (tests rely on it to
    compile only what changed)."""
    h = hashlib.sha256()
    for path in sorted(SOURCE_DIR.glob("*")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(" ".join(_flags()).encode())
    key = h.hexdigest()[:16]
    return cache_root() / "extensions" / f"cuda-{key}" / "libwbcuda.so"


def build(verbose: bool = False) -> Path:
    """Compile the library into the cache unless it is there; return its path."""
    out = library_path()
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside and rename: ranks building at once never load half a file.
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = compile_command(tmp)
    done = subprocess.run(cmd, capture_output=not verbose, text=True)
    if done.returncode != 0:
        raise NativeBuildError(
            f"nvcc failed ({done.returncode}) building the CUDA telemetry library:\n"
            f"{' '.join(cmd)}\n{done.stderr or ''}"
        )
    os.replace(tmp, out)
    return out


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def load() -> ctypes.CDLL:
    """The library, built first if needed, with argument types declared."""
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL(str(build()))
            if lib.wb_cuda_abi_version() != ABI_VERSION:
                raise NativeBuildError(f"stale CUDA telemetry library at {library_path()}: delete it")
            _declare(lib)
            _lib = lib
            mark_used(library_path().parent)
        return _lib


class _MarkReading(ctypes.Structure):
    # wb_mark_reading in wb_cuda.h, field for field.
    _fields_ = [("mark", ctypes.c_int64), ("state", ctypes.c_int32), ("error", ctypes.c_int32),
                ("anchor_ns", ctypes.c_int64), ("elapsed_ms", ctypes.c_float)]


_MARK_STATES = ("done", "pending", "error", "unknown")  # WB_MARK_* in wb_cuda.h


def _signatures() -> dict[str, tuple[list, object]]:
    """``name -> (argtypes, restype)`` of every function wb_cuda.h exports (a test holds the two equal)."""
    c_int, p = ctypes.c_int, ctypes.POINTER
    return {
        "wb_cuda_abi_version": ([], c_int),
        "wb_cuda_error_string": ([c_int], ctypes.c_char_p),
        "wb_cuda_device_count": ([p(c_int)], c_int),
        "wb_cuda_mem_info": ([c_int, p(ctypes.c_size_t), p(ctypes.c_size_t)], c_int),
        "wb_mark": ([c_int, ctypes.c_size_t], ctypes.c_int64),
        "wb_mark_again": ([ctypes.c_int64, ctypes.c_size_t], c_int),
        "wb_marks_read": ([p(ctypes.c_int64), c_int, p(_MarkReading), c_int], c_int),
        "wb_marks_release": ([p(ctypes.c_int64), c_int], c_int),
        "wb_marks_live": ([], c_int),
        "wb_cuda_spin": ([ctypes.c_size_t, ctypes.c_int64], c_int),
    }


def _declare(lib: ctypes.CDLL) -> None:
    for name, (args, res) in _signatures().items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res


def _check(err: int, what: str) -> None:
    if err != 0:
        text = load().wb_cuda_error_string(err).decode()
        raise CudaError(f"{what}: CUDA error {err} ({text})")


def device_count() -> int:
    """GPUs visible to the CUDA runtime; raises CudaError when there is no usable driver."""
    n = ctypes.c_int()
    _check(load().wb_cuda_device_count(ctypes.byref(n)), "cudaGetDeviceCount")
    return n.value


def memory(device: int = 0) -> tuple[int, int]:
    """``(free_bytes, total_bytes)`` of the device, counting every process on it."""
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    _check(load().wb_cuda_mem_info(device, ctypes.byref(free), ctypes.byref(total)), "cudaMemGetInfo")
    return free.value, total.value


def marker_addresses() -> tuple[int, int]:
    """Addresses of ``wb_mark`` and ``wb_marks_release``, for the recording backend to mark NCCL collectives."""
    lib = load()
    return (ctypes.cast(lib.wb_mark, ctypes.c_void_p).value,
            ctypes.cast(lib.wb_marks_release, ctypes.c_void_p).value)


def mark(device: int, stream: int) -> int:
    """Record a mark (a CUDA event) on ``stream`` of ``device`` now; returns its id."""
    mid = load().wb_mark(device, stream)
    if mid <= 0:
        _check(-mid, f"recording a mark on stream {stream:#x}")
    return mid


def mark_again(mark_id: int, stream: int) -> None:
    """Re-record a mark on ``stream``: it now stands for this later point (e.g. the latest gradient)."""
    _check(load().wb_mark_again(mark_id, stream), f"re-recording mark {mark_id}")


def read_marks(ids: list[int]) -> dict:
    """Readings (``gpu_timeline.MarkReading``) of ``ids`` now, never waiting; done and failed marks are released."""
    from workbench.telemetry.gpu_timeline import MarkReading

    n = len(ids)
    if n == 0:
        return {}
    arr, out = (ctypes.c_int64 * n)(*ids), (_MarkReading * n)()
    _check(load().wb_marks_read(arr, n, out, 1), "reading marks")
    return {r.mark: MarkReading(r.mark, _MARK_STATES[r.state], anchor_ns=r.anchor_ns,
                                elapsed_ms=r.elapsed_ms, error=r.error) for r in out}


def release_marks(ids: list[int]) -> None:
    """Forget marks (their spans were dropped); unknown ids are ignored."""
    if ids:
        load().wb_marks_release((ctypes.c_int64 * len(ids))(*ids), len(ids))


def live_marks() -> int:
    """Marks recorded and not yet read done or released (a leak shows here)."""
    return load().wb_marks_live()


def spin(stream: int, ns: int) -> None:
    """Enqueue a kernel that keeps the GPU busy for about ``ns`` nanoseconds (tests, calibration)."""
    _check(load().wb_cuda_spin(stream, ns), "spin kernel launch")
