"""The CUDA telemetry library: compiled with nvcc whenever its sources or flags change, exercised on a GPU when
there is one.

Compiling needs only nvcc (no GPU, no CUDA build of torch), so a broken .cu
file fails here on any machine that has nvcc. The build is the cached one
(`cuda.build()`, which `make setup` runs too): its place is a digest of every
file in extensions/cuda and of the nvcc flags, so a changed source or flag is
compiled here, and an unchanged one is not compiled twice (~25 s on 2 cores).
Tests marked ``gpu`` need a CUDA device; the last one also a CUDA build of
torch with NCCL.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import pytest

from workbench.telemetry import cuda


@pytest.fixture(scope="module")
def fresh_library():
    """The library built by nvcc from the sources and flags as they are now (compiled here if they changed)."""
    if cuda.nvcc() is None:
        pytest.skip("nvcc not found (neither $CUDA_HOME/bin/nvcc nor on PATH): cannot compile the CUDA part")
    return cuda.build()  # a failed compile raises NativeBuildError with nvcc's output


def test_the_cached_build_is_keyed_by_every_source_file_and_every_flag(tmp_path, monkeypatch):
    # What lets fresh_library take the cached build: an edited source or flag is a build not made yet.
    flags = cuda._flags()
    base = cuda.library_path()
    copy = shutil.copytree(cuda.SOURCE_DIR, tmp_path / "cuda")
    monkeypatch.setattr(cuda, "SOURCE_DIR", copy)
    assert cuda.library_path() == base  # the same bytes: the same build
    (copy / "wb_cuda.h").write_text((copy / "wb_cuda.h").read_text() + "\n")
    edited = cuda.library_path()
    assert edited != base
    monkeypatch.setattr(cuda, "_flags", lambda: [*flags[:-1], "-O3"])
    assert cuda.library_path() not in (base, edited)


def test_compiles_and_exports_its_interface(fresh_library):
    lib = ctypes.CDLL(str(fresh_library))
    assert lib.wb_cuda_abi_version() == cuda.ABI_VERSION
    cuda._declare(lib)  # every declared function must exist in the build


def test_every_cu_file_is_compiled_and_every_exported_function_is_declared():
    sources = sorted(p.name for p in cuda.SOURCE_DIR.glob("*.cu"))
    assert {"marks.cu", "runtime.cu", "spin.cu", "quantize.cu"} <= set(sources)
    cmd = cuda.compile_command(cuda.SOURCE_DIR / "unused.so") if cuda.nvcc() else []
    if cmd:
        assert sorted(os.path.basename(a) for a in cmd if a.endswith(".cu")) == sources
    header = (cuda.SOURCE_DIR / "wb_cuda.h").read_text()
    exported = set(re.findall(r"^WB_API [^(]*?\b(wb_\w+)\(", header, flags=re.M))
    assert exported == set(cuda._signatures()), "wb_cuda.h and cuda._signatures() disagree"


def test_the_mark_reading_struct_matches_ctypes(tmp_path):
    # Compiled and run on the host (no CUDA call, so no GPU needed): the layout Python reads is the C one.
    if cuda.nvcc() is None:
        pytest.skip("nvcc not found")
    src = tmp_path / "layout.cu"
    src.write_text(
        '#include <stdio.h>\n#include <stddef.h>\n#include "wb_cuda.h"\n'
        'int main() { printf("%zu %zu %zu %zu %zu %zu", sizeof(wb_mark_reading), offsetof(wb_mark_reading, mark),'
        ' offsetof(wb_mark_reading, state), offsetof(wb_mark_reading, error),'
        ' offsetof(wb_mark_reading, anchor_ns), offsetof(wb_mark_reading, elapsed_ms)); return 0; }\n')
    exe = tmp_path / "layout"
    done = subprocess.run([cuda.nvcc(), f"-I{cuda.SOURCE_DIR}", str(src), "-o", str(exe)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, timeout=60).stdout.split()]
    r = cuda._MarkReading
    assert got == [ctypes.sizeof(r), r.mark.offset, r.state.offset, r.error.offset, r.anchor_ns.offset,
                   r.elapsed_ms.offset]


def test_marks_without_a_usable_gpu(fresh_library):
    try:
        if cuda.device_count() > 0:
            pytest.skip("a GPU is present; the gpu-marked tests cover it")
    except cuda.CudaError:
        pass
    # Unknown marks read as such (no CUDA call is needed for them); recording one fails with a readable error.
    readings = cuda.read_marks([7, 8])
    assert [readings[m].state for m in (7, 8)] == ["unknown", "unknown"]
    cuda.release_marks([7])
    assert cuda.live_marks() == 0
    with pytest.raises(cuda.CudaError, match="CUDA error"):
        cuda.mark(0, 0)
    assert cuda.live_marks() == 0
    mark_fn, release_fn = cuda.marker_addresses()
    assert mark_fn and release_fn and mark_fn != release_fn
def test_quantizer_kernels_are_compiled_in(fresh_library):
    # The compression quantisers (extensions/cuda/quantize.cu) are declared by their Python face.
    from workbench.engine.parallel import quantize

    lib = ctypes.CDLL(str(fresh_library))
    for name in quantize.CUDA_FUNCTIONS:
        assert hasattr(lib, name), name


def test_without_a_usable_gpu_errors_are_clean(fresh_library):
    try:
        n = cuda.device_count()
    except cuda.CudaError as e:
        # no driver: a readable error, not a crash
        assert "CUDA error" in str(e) and "(" in str(e)
        with pytest.raises(cuda.CudaError):
            cuda.memory(0)
        return
    if n > 0:
        pytest.skip("a GPU is present; the gpu-marked tests cover it")


@pytest.fixture(scope="module")
def gpu():
    try:
        n = cuda.device_count()
    except (cuda.CudaError, OSError) as e:
        pytest.skip(f"no usable CUDA device: {e}")
    if n == 0:
        pytest.skip("no CUDA device")


@pytest.mark.gpu
def test_memory_counters(gpu):
    free, total = cuda.memory(0)
    assert 0 < free <= total
