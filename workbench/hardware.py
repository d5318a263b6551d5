"""Hardware profiles the estimator predicts for: datasheet figures for GPUs, a measured peak for this machine's CPU.

Pure data, no torch import: the notebook kernel reads these without loading
torch. Only `measure_cpu` imports torch, when it is called.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from dataclasses import dataclass
from typing import Literal

from workbench.machine import machine_fact, threads_per_rank

GB = 1e9
TB = 1e12
TFLOPS = 1e12


@dataclass(frozen=True)
class Hardware:
    """One device: peak dense FLOP/s by precision, memory size and bandwidth, the per-GPU link bandwidth, and what
    the estimator's efficiency model needs of it (GPU profiles: kernels' achieved fractions of peak, SMs)."""

    name: str
    peak_flops: dict[str, float]
    """Dense FLOP/s by precision ("fp32", "tf32", "bf16", "fp16", "fp8"; on Blackwell also "mxfp8" and "nvfp4",
    the block-scaled formats only it multiplies); absent where the device has none."""
    memory_bytes: float
    """Device memory, bytes."""
    mem_bw: float
    """Memory bandwidth, bytes/s."""
    link_bw: float
    """Bandwidth of one device's link to its peers, bytes/s per direction (NVLink within a node)."""
    measured: bool
    """True when the figures were measured on this machine rather than taken from a datasheet."""
    kind: Literal["gpu", "cpu"] = "gpu"
    """What the estimator models: "gpu", the run as CUDA kernels make it (flash attention, the caching
    allocator, NCCL); "cpu", this engine on CPU kernels (exact for the CPU runs the tests make)."""
    sms: int = 132
    """Streaming multiprocessors: how many GEMM output tiles run at once (wave quantization)."""
    gemm_efficiency: float = 0.0
    """Fraction of peak a large GEMM (every dim ≥ 4096) reaches; 0: the shared GEMM_EFFICIENCY."""
    low_precision_gemm_efficiency: dict[str, float] = dataclasses.field(default_factory=dict)
    """By 8-bit or 4-bit peak key ("fp8", "mxfp8", "nvfp4"): the fraction of that peak a large GEMM in the format
    reaches, measured on this device at 8192³; a format not here takes the share measured on Hopper's fp8
    (estimate.kernels.FP8_GEMM_EFFICIENCY)."""
    attention_efficiency: float = 0.0
    """Fraction of the bf16 peak flash attention reaches, forward + backward, causal; 0: no figure (CPU)."""
    cluster: str = "h100-ib"
    """The `workbench.links` preset of the nodes these devices sit in (links inside a node and between)."""
    gpus_per_node: int = 8
    rated_power_w: float = 0.0
    """The board power the datasheet rates the device at (its maximum TDP), watts: the power at which its GEMM and
    attention fractions of peak hold; 0: not stated (no power model)."""
    power_limit_w: float = 0.0
    """The board power limit the device runs under, watts, where it is set below the rating; 0: the rating."""
    shares_scale: float = 1.0
    """Where its shares of peak (GEMMs, attention) are those measured on another device with the same GPU: what its
    rates are of its peaks times those shares, (its maximum compute clock / that device's) / (its peak / that
    device's), since both run the same tensor cores, each at its own clock. 1: shares of its own peaks."""

    @property
    def power_scale(self) -> float:
        """The share of its rated-power rate a power-bound kernel (GEMMs, flash attention) keeps under
        `power_limit_w`, 1 at the rating: the rate in proportion to the power limit.

        Why: a large tensor-core GEMM is the most power-hungry thing a GPU runs and draws up to the board's limit;
        under a lower limit the GPU holds it by lowering the clock, and dynamic power (α·C·V²·f), at a voltage
        already at the floor of its range, falls in proportion to the clock, so the rate falls with the power.
        Measured: cuBLAS GEMM on a GB300 capped at 500 W ran ~617 TFLOP/s against 1,600-2,174 at its rated 1,400 W
        (facebookexperimental/triton PR 2023, Meta's benchmark denoising script): 0.28-0.39 of the rate at 0.36 of
        the power. Memory-bound kernels are not scaled: they draw well under the limit and run at the memory's own
        clock. Checked on published runs outside the test cases: torchtitan's June 2025 async-TP runs and its 2024
        context-parallel table on the same 500 W H100s (tests/test_published.py HELD_OUT)."""
        if not self.rated_power_w or not self.power_limit_w:
            return 1.0
        return min(1.0, self.power_limit_w / self.rated_power_w)

    @property
    def compute_scale(self) -> float:
        """What a compute-bound kernel's rate (GEMMs, flash attention) is of its peak times its share: the power
        limit's `power_scale` times `shares_scale`."""
        return self.power_scale * self.shares_scale

    def peak(self, precision: str) -> float:
        """Peak FLOP/s at `precision`; refuses one the device has no figure for. An fp8 recipe
        ("fp8_tensorwise", "fp8_rowwise") is the device's fp8 rate."""
        if precision.startswith("fp8"):
            precision = "fp8"
        try:
            return self.peak_flops[precision]
        except KeyError:
            raise ValueError(f"{self.name} has no {precision} peak; it has {sorted(self.peak_flops)}") from None

    def __str__(self) -> str:
        flops = ", ".join(f"{p} {si(v, 'FLOP/s')}" for p, v in self.peak_flops.items())
        how = "measured" if self.measured else "datasheet"
        power = (f"; run at {self.power_limit_w:.0f} W of its rated {self.rated_power_w:.0f} W"
                 if self.power_scale < 1 else "")
        return (f"{self.name} ({how}): {flops}; {si(self.memory_bytes, 'B')} at {si(self.mem_bw, 'B/s')}; "
                f"link {si(self.link_bw, 'B/s')}{power}")


GEMM_EFFICIENCY = 790 / 989.5
"""A bf16 8192³ matmul measured at ~790 TFLOP/s on this project's lent H200 (shared/FACTS.md, "The GPU machine"),
whose dense bf16 peak is the H100 SXM's 989.5: the fraction of peak a large GEMM reaches, for every GPU profile.
Smaller or oddly shaped GEMMs lose more (the estimator's wave quantization and memory roofline)."""
FLASH_ATTENTION_H100 = 3.5 / (1 / 284.1 + 2.5 / 287.1) / 989.5
"""FlashAttention-2 forward + backward on Hopper at the shape the Llama runs use, causal, head dim 128, sequence
8192: 284.1 TFLOP/s forward and 287.1 backward, as flash-attention's hopper/benchmark_attn.py printed them in
Dao-AILab/flash-attention PR 1791 (2025-07-31, "ABI stable fa3", the main branch's "Fav2" rows; causal FLOPs half
the square, the backward 2.5 forwards): 286 TFLOP/s together, 29% of the dense bf16 peak. The PR does not name
the GPU; its FlashAttention-3 rows (630 TFLOP/s forward, causal) are H100 SXM5-class figures. torch's SDPA flash
backend is FlashAttention-2. The same run's non-causal rows (370 and 291 TFLOP/s, 310 together) sit under the
FlashAttention-2 paper's best H100 figure, "up to 335 TFLOP/s" (Dao 2023, arXiv 2307.08691, section 4.1), which
is a larger, non-causal shape."""
FLASH_ATTENTION_A100 = 0.50
"""Dao 2023, "FlashAttention-2", abstract: 50-73% of the A100's peak; forward + backward sits at the low end
(the backward pass is the less efficient one), so the low end is taken."""


def si(value: float, unit: str) -> str:
    """`value` with an SI prefix and three significant digits: si(9.895e14, "FLOP/s") == "990 TFLOP/s"."""
    scaled, prefix = value, ""
    for bigger in "kMGTPE":
        # Compare the rounded figure, so 999.7 becomes "1 k", not "1e+03".
        if abs(float(f"{scaled:.3g}")) < 1000:
            break
        scaled, prefix = scaled / 1000, bigger
    return f"{scaled:.3g} {prefix}{unit}"


# Memory is the datasheet's "GB" read as 10^9 bytes: a little under what a process can allocate (an H100 80GB shows
# 81,559 MiB in nvidia-smi), so a configuration that "fits" here has a margin for the CUDA context and allocator.
# NVLink figures are NVIDIA's bidirectional totals halved, since a ring collective is limited by one direction.

H100 = Hardware(
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (nvidia.com/en-us/data-center/h100): tensor-core
    # figures there are quoted with 2:4 sparsity; dense is half (BF16 1,979 -> 989, TF32 989 -> 494).
    name="h100",
    peak_flops={"fp32": 67 * TFLOPS, "tf32": 494.5 * TFLOPS, "bf16": 989.5 * TFLOPS, "fp16": 989.5 * TFLOPS,
                "fp8": 1979 * TFLOPS},
    memory_bytes=80 * GB,
    mem_bw=3.35 * TB,
    link_bw=450 * GB,  # NVLink 4: 900 GB/s bidirectional per GPU
    measured=False,
    attention_efficiency=FLASH_ATTENTION_H100,
    rated_power_w=700,  # the datasheet's "Max thermal design power (TDP): Up to 700W (configurable)"
)

H100_96GB = Hardware(
    # The H100s of Meta's Grand Teton hosts that torchtitan's published runs used (torchtitan
    # benchmarks/llama3_h100_202412_torchtitan.md): SXM H100s with 96 GB of HBM2e at 2.4 TB/s, 8 per host on
    # NVLink, 400 Gb/s RDMA per GPU between hosts, run at "the default 500W power limit, although tuning it up to
    # 700W TDP can potentially provide further speedups". The SXM5 part's datasheet peaks (its footnote: "the
    # actual peak TFLOPs number is between SXM and NVL, and we don't know its exact value"); the 500 W limit is
    # modelled as what it is, a power limit on the 700 W part (`Hardware.power_scale`), not as a lower peak.
    name="h100-96gb",
    peak_flops=dict(H100.peak_flops),
    memory_bytes=96 * GB,
    mem_bw=2.4 * TB,
    link_bw=450 * GB,
    measured=False,
    attention_efficiency=FLASH_ATTENTION_H100,
    rated_power_w=700,
    power_limit_w=500,
)

H200 = Hardware(
    # NVIDIA H200 Tensor Core GPU datasheet, SXM column (nvidia.com/en-us/data-center/h200): the H100's compute
    # with 141 GB of HBM3e at 4.8 TB/s and the same NVLink 4.
    name="h200",
    peak_flops=dict(H100.peak_flops),
    memory_bytes=141 * GB,
    mem_bw=4.8 * TB,
    link_bw=450 * GB,
    measured=False,
    attention_efficiency=FLASH_ATTENTION_H100,
    rated_power_w=700,  # "Max TDP: Up to 700W (configurable)"
)

A100 = Hardware(
    # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column (nvidia.com/en-us/data-center/a100): FP32 19.5,
    # TF32 156 and BF16/FP16 312 TFLOP/s dense (312/624 with sparsity); HBM2e at 2,039 GB/s; no FP8; 108 SMs
    # (NVIDIA A100 Tensor Core GPU Architecture whitepaper).
    name="a100",
    peak_flops={"fp32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS, "bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS},
    memory_bytes=80 * GB,
    mem_bw=2.039 * TB,
    link_bw=300 * GB,  # NVLink 3: 600 GB/s bidirectional per GPU
    measured=False,
    sms=108,
    attention_efficiency=FLASH_ATTENTION_A100,
    cluster="a100-ib",
    rated_power_w=400,  # the 80GB SXM's "Max TDP Power: 400W"
)

# Blackwell. Dense figures (NVIDIA quotes FP4/FP8/FP16 tensor rates "with sparsity": dense is half). FP8 and MXFP8
# run at one rate, NVFP4 at the FP4 rate; fp32 is the non-tensor rate. NVLink 5: 1.8 TB/s bidirectional per GPU.
B200 = Hardware(
    # NVIDIA DGX B200 datasheet (nvidia.com/en-us/data-center/dgx-b200): 8 GPUs, "72 PFLOPS training (FP8), 144
    # PFLOPS inference (FP4)" with sparsity, "1,440GB total GPU memory, 64TB/s HBM3e bandwidth", "14.4 TB/s
    # aggregate NVLink bandwidth": per GPU 4.5 PFLOP/s FP8 and 9 FP4 dense, 180 GB at 8 TB/s, 1.8 TB/s NVLink;
    # BF16/FP16 2.25, TF32 1.1 PFLOP/s dense and FP32 80 TFLOP/s, the HGX B200 at its 1,000 W (NVIDIA Blackwell
    # datasheet, HGX B200 column); 148 SMs (NVIDIA Blackwell architecture technical brief).
    name="b200",
    peak_flops={"fp32": 80 * TFLOPS, "tf32": 1100 * TFLOPS, "bf16": 2250 * TFLOPS, "fp16": 2250 * TFLOPS,
                "fp8": 4500 * TFLOPS, "mxfp8": 4500 * TFLOPS, "nvfp4": 9000 * TFLOPS},
    memory_bytes=180 * GB,
    # The datasheet's 8 TB/s counts an 8,192-bit bus; the driver reports 7,680 bits (CUDA 13 and a device query),
    # at 3,996 MHz double data rate: 7.67 TB/s (pytorch/ao PR 4002, 2026, its B200 roofline figure).
    mem_bw=7680 / 8 * 3.996e9 * 2,
    link_bw=900 * GB,  # NVLink 5
    measured=False,
    sms=148,
    # cuBLAS on a B200 in June 2025 (torch nightly, the stack of torchao's B200 table): an 8192³ bf16 GEMM at
    # 1.42 PFLOP/s, 63.1% of peak, and an NVFP4 one at 5.37 PFLOP/s, 59.7% (pytorch/ao PR 2427,
    # benchmarks/float8/bench_matmul.py); the H100's bf16 share is 80%, its fp8 share 71%. vLLM's B200 bf16 GEMMs
    # agree (vllm-project/vllm PR 19566, 2025: 1,444 to 1,513 TFLOP/s, 64-67%, at 2,048 to 16,384 rows). cuBLAS's
    # MXFP8 GEMM (block-scaled, the kernel torchao's and Transformer Engine's MXFP8 linears call) on a B200 at its
    # default power, 8192³: 2,850 TFLOP/s, 63.3% of the fp8 peak (triton-lang/triton PR 9044, December 2025, cuBLAS
    # 13.1.0.3, torch 2.10.0.dev20251205: ten runs in 3,858 µs, kernel nvjet_sm100_qqhsh_128x256_..._Avec32UE8M0;
    # PR 9697, March 2026: 2,894.5 TFLOP/s at 8192³). No tensorwise or rowwise fp8 GEMM was measured on a B200 at a
    # large shape: "fp8" keeps Hopper's share.
    gemm_efficiency=2 * 8192**3 / 7.74e-4 / (2250 * TFLOPS),
    low_precision_gemm_efficiency={"nvfp4": 2 * 8192**3 / 2.05e-4 / (9000 * TFLOPS),
                                   "mxfp8": 2 * 8192**3 / (3858.095e-6 / 10) / (4500 * TFLOPS)},
    attention_efficiency=FLASH_ATTENTION_H100,
    cluster="b200-ib",
    rated_power_w=1000,
)

GB200 = Hardware(
    # NVIDIA GB200 NVL72 datasheet (nvidia.com/en-us/data-center/gb200-nvl72), the rack's 72 GPUs: FP4 1,440,
    # FP8/FP6 720, FP16/BF16 360, TF32 180 PFLOPS (sparse), FP32 6,480 TFLOPS; up to 13.4 TB HBM3e at 576 TB/s;
    # 130 TB/s of NVLink: per GPU 10 / 5 / 2.5 / 1.25 PFLOP/s dense, 90 TFLOP/s FP32, 186 GB at 8 TB/s, 1.8 TB/s
    # NVLink, the B200 at 1,200 W. All 72 GPUs share one NVLink domain (`links` preset "gb200-nvl72"). Its GPU is
    # the B200's, so cuBLAS's shares of peak measured on the B200 are its own (`B200` above). Its memory is what
    # the device reports, above the datasheet's 186 GB: nvidia-smi shows 189,471 MiB, torch "a total capacity of
    # 184.31 GiB" (its out-of-memory message on GB200s), and torchtitan's GB200 runs reserved up to 179.94 GiB,
    # "97.6%" (torchtitan PR 3914, 2026). Its rates are the B200's at the ratio of their clocks, not of their peaks
    # (`shares_scale`): nvidia-smi reports a maximum SM clock of 2,062 MHz on a GB200 and 1,965 on a B200
    # (stas00/ml-engineering, compute/accelerator/README.md, "Clock speed", 2026); the GB200's peaks are its 148 SMs
    # at 2,062 MHz (8,192 bf16 FLOP a clock each: 2.5 PFLOP/s), the B200's at 1,856 MHz (2.25). The best matmuls
    # measured on each (the same page's "Maximum Achievable Matmul FLOPS": bf16 1,822 against 1,745 TFLOP/s, fp8
    # 3,615.6 against 3,432.5) stand 4.4% and 5.3% apart, as the clocks' 4.9%, not the peaks' 11%.
    name="gb200",
    peak_flops={"fp32": 90 * TFLOPS, "tf32": 1250 * TFLOPS, "bf16": 2500 * TFLOPS, "fp16": 2500 * TFLOPS,
                "fp8": 5000 * TFLOPS, "mxfp8": 5000 * TFLOPS, "nvfp4": 10000 * TFLOPS},
    memory_bytes=round(184.31 * 2**30),
    mem_bw=8 * TB,
    link_bw=900 * GB,
    measured=False,
    sms=148,
    gemm_efficiency=B200.gemm_efficiency,
    low_precision_gemm_efficiency=B200.low_precision_gemm_efficiency,
    attention_efficiency=FLASH_ATTENTION_H100,
    shares_scale=(2062 / 1965) / (2500 / 2250),
    cluster="gb200-nvl72",
    gpus_per_node=72,
    rated_power_w=1200,
)

GB300 = Hardware(
    # NVIDIA GB300 NVL72 datasheet (nvidia.com/en-us/data-center/gb300-nvl72), the rack's 72 Blackwell Ultra GPUs:
    # FP4 1,440 (sparse) / 1,080 (dense), FP8/FP6 720, FP16/BF16 360, TF32 180 PFLOPS (sparse); 20.1 TB HBM3e at
    # 576 TB/s; 130 TB/s of NVLink: per GPU 15 PFLOP/s NVFP4, 5 FP8, 2.5 BF16, 1.25 TF32 dense, 279 GB at 8 TB/s,
    # 1.8 TB/s NVLink, 1,400 W; 160 SMs (NVIDIA technical blog, "Inside NVIDIA Blackwell Ultra", 2025).
    name="gb300",
    peak_flops={"fp32": 80 * TFLOPS, "tf32": 1250 * TFLOPS, "bf16": 2500 * TFLOPS, "fp16": 2500 * TFLOPS,
                "fp8": 5000 * TFLOPS, "mxfp8": 5000 * TFLOPS, "nvfp4": 15000 * TFLOPS},
    memory_bytes=279 * GB,
    mem_bw=8 * TB,
    link_bw=900 * GB,
    measured=False,
    sms=160,
    attention_efficiency=FLASH_ATTENTION_H100,
    cluster="gb300-nvl72",
    gpus_per_node=72,
    rated_power_w=1400,
)

DATASHEETS: dict[str, Hardware] = {h.name: h for h in (H100, H100_96GB, H200, A100, B200, GB200, GB300)}

GLOO_LOOPBACK_BW = 0.85 * GB
"""gloo all-reduce bus bandwidth between two ranks on one 2-core machine (16-64 MiB payloads), measured for this
project; the CPU profile's link, since ranks on one machine talk through loopback TCP."""


def profile(name: str, ranks: int | None = None) -> Hardware:
    """A profile by name: "h100" (SXM), "h100-96gb" (torchtitan's 500 W H100s), "h200", "a100", "b200", "gb200",
    "gb300" (datasheets), any of them under a power limit ("b200@750w": `Hardware.power_limit_w`), or "cpu"
    (measured here, once per process; with `ranks`, as each of that many local ranks sees it: `cpu_for`)."""
    key, _, limit = name.lower().partition("@")
    if key == "cpu" and not limit:
        return measure_cpu() if ranks is None else cpu_for(ranks)
    try:
        hw = DATASHEETS[key]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; use one of {sorted([*DATASHEETS, 'cpu'])} (a GPU's name "
                         "with @<watts>w for a power limit) or pass a Hardware(...)") from None
    if not limit:
        return hw
    watts = limit.removesuffix("w")
    if not watts.isdigit() or not 0 < int(watts) <= hw.rated_power_w:
        raise ValueError(f"hardware {name!r}: a power limit is @<watts>w, at most the {hw.name}'s rated "
                         f"{hw.rated_power_w:.0f} W (e.g. {hw.name}@{hw.rated_power_w * 3 / 4:.0f}w)")
    return dataclasses.replace(hw, name=f"{hw.name}@{watts}w", power_limit_w=float(watts))


GPU_PROFILES = ("gb300", "gb200", "b200", "h200", "h100", "a100")
"""Datasheet profiles a CUDA device is matched to by its name ("NVIDIA H100 80GB HBM3" -> "h100")."""


def profile_for(device: str, device_name: str = "") -> str | None:
    """The estimator's profile for ranks on `device` ("cpu", "cuda:0") named `device_name`; None for a GPU without
    one (then there is no prediction to show)."""
    if device.startswith("cpu"):
        return "cpu"
    name = device_name.lower()
    return next((p for p in GPU_PROFILES if p in name), None)


def cpu_with_peak(precision: str, peak_flops: float) -> Hardware:
    """This machine's CPU profile from a matmul peak the ranks already measured (StepMetrics' mfu basis), without
    measuring again or importing torch in the notebook; memory bandwidth is left unmeasured (0: the CPU model does
    not read it)."""
    return Hardware(name="cpu", peak_flops={precision: peak_flops},
                    memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), mem_bw=0.0,
                    link_bw=GLOO_LOOPBACK_BW, measured=True, kind="cpu", sms=1, cluster="", gpus_per_node=1)


def measure_cpu(budget_s: float = 0.3, threads: int | None = None) -> Hardware:
    """This machine's CPU at `threads` intra-op threads (torch's current count by default): matmul peak per
    precision and copy bandwidth, measured.

    Each precision gets about `budget_s` seconds; the peak is the best rate over square matmuls of growing size.
    Measured once per process and thread count; on local ranks once per machine: a restarted rank, and the ranks
    of the user's next pools and kernels, reuse it (`machine.machine_fact`).
    """
    import torch

    current = torch.get_num_threads()
    return _measured_cpu(budget_s, current if threads is None else threads)


@functools.cache
def _measured_cpu(budget_s: float, threads: int) -> Hardware:
    import torch

    current = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fields = machine_fact(f"cpu-{threads}threads-{budget_s}s",
                                   lambda: dataclasses.asdict(_measure_cpu(torch, budget_s)))
    finally:
        torch.set_num_threads(current)
    return Hardware(**fields)


def cpu_for(ranks: int) -> Hardware:
    """This machine's CPU as each of `ranks` local ranks sees it: on a rank (a process of a distributed world), at
    its own threads; elsewhere (the notebook) at the threads a local rank of a pool that size gets (the cores shared
    among the ranks, as the pool sets them), so that the notebook's estimate predicts its ranks, not itself."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return measure_cpu()
    return measure_cpu(threads=threads_per_rank(ranks))


def _measure_cpu(torch, budget_s: float) -> Hardware:
    peaks = {name: _matmul_peak(torch, dtype, budget_s)
             for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))}
    return Hardware(
        name="cpu",
        peak_flops=peaks,
        memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        mem_bw=_copy_bandwidth(torch),
        link_bw=GLOO_LOOPBACK_BW,
        measured=True,
        kind="cpu",
        sms=1,
        cluster="",
        gpus_per_node=1,
    )


def _matmul_peak(torch, dtype, budget_s: float) -> float:
    best, n, deadline = 0.0, 128, time.perf_counter() + budget_s
    while n <= 2048 and time.perf_counter() < deadline:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        start = time.perf_counter()
        a @ b  # warm-up: thread pool, kernel selection
        single = time.perf_counter() - start
        # Size the repeat count to a slice of the budget; a slow precision (fp16 without hardware support) stops
        # growing n before a single product could overrun the budget.
        reps = max(1, int(budget_s / 6 / max(single, 1e-9)))
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - start))
        if single * 8 > budget_s:
            break
        n *= 2
    return best


def _copy_bandwidth(torch, size: int = 64 << 20, reps: int = 4) -> float:
    src = torch.empty(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages first, so page faults are not timed
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    # A copy reads and writes every byte.
    return 2 * size * reps / (time.perf_counter() - start)
