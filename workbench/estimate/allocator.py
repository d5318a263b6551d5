"""What a GPU process holds beyond the tensors: the caching allocator's reserve, NCCL's buffers, the CUDA context.

torch's CUDA caching allocator keeps freed blocks for reuse; its reserved memory (what `torch.cuda.memory_stats`
calls reserved_bytes, and what torchtitan's published "Memory (GiB)" reads: max_reserved_gib) is the peak of what
tensors hold plus the free fragments between them. NCCL allocates its own buffers and the CUDA context its own
memory, outside torch's allocator: in nvidia-smi, not in reserved_bytes.
"""

from __future__ import annotations

from workbench.config import Config

FRAGMENTATION = 0.15
"""Share of the caching allocator's reserved memory that is free fragments at the peak of LLM training: 15% on
average over eight LLMs on A100 80 GB (Guo et al., "GMLake: Efficient and Transparent GPU Memory Defragmentation
for Large-scale DNN Training with Virtual Memory Stitching", ASPLOS 2024, abstract). One figure for every run."""

CUDA_CONTEXT_BYTES = 512 * 2**20
"""The CUDA context, cuBLAS and cuDNN workspaces with lazy module loading (the default since CUDA 12.2, CUDA
C++ Programming Guide, "Lazy Loading"): about half a GiB per process, the order of magnitude nvidia-smi shows
for a process that has run a matmul; not measured here."""

NCCL_BUFFSIZE = 4 * 2**20
"""NCCL's buffer per channel and peer for the Simple protocol (NCCL_BUFFSIZE, default 4 MiB: NCCL's environment
variables documentation)."""
NCCL_CHANNELS = 16
"""Channels NCCL opens per communicator inside a node (NVLink: NCCL's tuning picks 16 or more on H100 NVSwitch
systems; an assumption within NCCL_MAX_NCHANNELS' default of 32)."""


def with_fragments(allocated: int) -> int:
    """What the caching allocator holds when tensors hold `allocated` bytes at its peak, its free fragments
    (`FRAGMENTATION`) beside them, where the device has room for them."""
    return round(allocated / (1 - FRAGMENTATION))


def reserved(allocated: int, device_bytes: int | None = None) -> int:
    """What the caching allocator reserves when tensors hold `allocated` bytes at its peak, on a device of
    `device_bytes` (what the process may allocate beyond the CUDA context and NCCL; None: no limit).

    Never more than the device: when cudaMalloc fails, the allocator frees its cached blocks that no tensor uses
    and tries again (torch's CUDACachingAllocator, `release_cached_blocks`; memory_stats counts it in
    num_alloc_retries), so a peak whose tensors fit reserves at most the device, the fragments given back (a
    "tight" fit: `Estimate.tight`). A peak whose tensors alone do not fit is reported as the model prices it."""
    wanted = with_fragments(allocated)
    if device_bytes is None or allocated > device_bytes:
        return wanted
    return min(wanted, device_bytes)


def nccl_buffers(cfg: Config) -> int:
    """NCCL's own buffers: per communicator (one per mesh axis with more than one rank, plus the world), a send
    and a receive buffer per channel. The data-parallel groups are one communicator (dp, or dp·cp), or two under
    HSDP (the shard group and the replica group)."""
    groups = (cfg.dp * cfg.cp, cfg.dp_replicate if cfg.hsdp else 1, cfg.tp, cfg.pp, cfg.ep, cfg.cp)
    axes = sum(n > 1 for n in groups) + 1
    return axes * 2 * NCCL_CHANNELS * NCCL_BUFFSIZE


def runtime_bytes(cfg: Config) -> int:
    """Device memory outside torch's allocator: the CUDA context and NCCL's buffers (none with one rank)."""
    return CUDA_CONTEXT_BYTES + (nccl_buffers(cfg) if cfg.world_size > 1 else 0)
