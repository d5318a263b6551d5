"""What each choice means, in a sentence the controls, the notebooks and the docs show beside it.

Keyed by the field's values (`SCHEDULE_HELP["1f1b"]`), so a table of controls
can offer exactly the choices that have a text; importable as
`workbench.config.SCHEDULE_HELP` and friends.
"""

from __future__ import annotations

SCHEDULE_HELP = {
    "gpipe": "GPipe: all forwards, then all backwards; simple, holds every micro-batch's activations",
    "1f1b": "1F1B: one forward, one backward in steady state; same bubble as GPipe, at most pp micro-batches of activations",
    "interleaved_1f1b": "interleaved 1F1B: several smaller stages per rank; the bubble shrinks by that factor",
    "interleaved_zb": "interleaved zero bubble (ZB1P): each backward split into its input-gradient half (I), "
                      "which the stage before waits for, and its weight-gradient half (W), run later in what "
                      "would be the bubble: (p−1)(F+B−2W) instead of (p−1)(F+B)",
    "zbv": "ZB-V: two stages per rank in a V (rank r holds stages r and 2p−1−r), split backwards; near zero "
           "bubble when F, I and W take about the same time, at 1F1B's activation memory",
    "dualpipev": "DualPipeV (DeepSeek-V3): two stages per rank in a V, a forward of one paired with a full backward "
                 "of the other in steady state, split backwards at the edges; needs ≥ 2·pp micro-batches",
}
ZERO_HELP = {
    0: "ZeRO 0 = DDP: every rank holds all parameters, gradients and optimizer state; gradients all-reduced",
    1: "ZeRO 1 = DDP + ZeroRedundancyOptimizer: optimizer state sharded across dp ranks",
    2: "ZeRO 2 = FSDP2 without resharding after forward: gradients and optimizer state sharded",
    3: "ZeRO 3 = FSDP2: parameters, gradients and optimizer state sharded; parameters gathered per layer",
}
COMPRESSION_HELP = {
    "none": "no compression: gradients all-reduced (zero 0/1) or reduce-scattered (zero 2/3) in fp32",
    "fp16": "gradients sent in fp16: half the bytes (DDP's fp16_compress_hook; FSDP2's reduce_dtype)",
    "bf16": "gradients sent in bf16: half the bytes, fp32's range (DDP's bf16_compress_hook; FSDP2's reduce_dtype)",
    "powersgd": "PowerSGD (zero 0/1): each gradient matrix sent as a rank-r product, with error feedback",
    "int8": "int8 with a scale per 256 values (zero 0/1): about 1/4 of the bytes, with error feedback",
    "1bit": "signs with a scale per 2048 values (zero 0/1): about 1/32 of the bytes, with error feedback",
}
OFFLOAD_HELP = (
    "ZeRO-Offload: AdamW's moments live in host memory and the optimizer step runs on the host. zero 0/1: a "
    "host AdamW over fp32 master copies, parameters copied back to the device; zero 2/3: FSDP2's "
    "CPUOffloadPolicy, which also keeps the parameter and gradient shards on the host between uses"
)
RECOMPUTE_HELP = {
    "none": "no activation checkpointing: every activation kept for backward",
    "selective": "checkpoint every other transformer block: less memory, some recomputation",
    "full": "checkpoint every transformer block: least activation memory, one extra forward",
    "op": "per op in every block (torchtitan's selective op policy): keep every other matmul's output and "
          "attention's, recompute the rest (norms, rotary, wk/wo/w3, SwiGLU) in backward",
}
MIXED_PRECISION_HELP = {
    "autocast": "bf16 by autocast: fp32 parameters, each weight cast to bf16 where it is used",
    "fsdp": "FSDP2 mixed precision (ZeRO 2/3): bf16 parameters gathered for compute, fp32 shards, gradients and "
            "optimizer state, gradients reduced in fp32; the residual stream and norms run in bf16",
}
OPTIMIZER_HELP = {
    "adamw": "AdamW: two fp32 moments per parameter (8 B of optimizer state per parameter)",
    "lion": "Lion: one fp32 moment and a sign update (4 B per parameter, half of AdamW's); every element moves "
            "by lr, so use an lr about 3-10x smaller than AdamW's",
    "sgd": "SGD with momentum 0.9: one fp32 buffer per parameter (4 B, half of AdamW's); usually a larger lr",
}
PRECISION_HELP = {
    "fp32": "fp32: every operation in 32-bit floats",
    "bf16": "bf16 autocast: matmuls in bfloat16 (fp32's range), parameters and optimizer state fp32",
    "fp16": "fp16 autocast with dynamic loss scaling: a step whose gradients overflow is skipped everywhere",
    "fp8_tensorwise": "fp8 (torchao Float8, one scale per tensor): linear layers' matmuls in float8, bf16 elsewhere; "
                      "with zero 2/3 FSDP2 gathers the weights in fp8; needs a GPU with fp8 (sm_89 or newer)",
    "fp8_rowwise": "fp8 (torchao Float8, one scale per row): more accurate than tensorwise, a little slower; "
                   "needs a GPU with fp8 (sm_89 or newer)",
    "mxfp8": "MXFP8 (torchao MX formats, OCP microscaling: one 8-bit scale per 32 elements, cuBLAS kernels): "
             "linear layers' matmuls in float8, bf16 elsewhere, weights gathered in bf16; Blackwell only (sm_100)",
}
ASYNC_TP_HELP = (
    "async TP (torch's micro-pipelined tensor parallel, torchtitan's enable_async_tensor_parallel): under "
    "torch.compile each sequence-parallel all-gather is fused with the matmul that reads it and each "
    "reduce-scatter with the matmul that feeds it, in tp chunks over CUDA symmetric memory, so the transfers run "
    "beside the chunks' matmuls; needs tp > 1, compile, and CUDA GPUs joined by NVLink"
)
COMPILE_HELP = (
    "torch.compile each transformer block (inductor; C++ on the CPU, Triton on GPUs): fused kernels, the same "
    "losses within float rounding. The first step of a layout compiles (shown as its own span); a layout seen "
    "before in this session compiles nothing"
)
CUDA_GRAPHS_HELP = (
    "CUDA Graphs (torch.compile mode=\"reduce-overhead\"): each compiled block's kernels captured once and replayed, "
    "without the per-kernel launch cost; needs a CUDA device, compile=True, zero 0/1, no offload, no pipeline"
)
