"""What every estimate assumes, printed with it (`Estimate.assumptions`)."""

ASSUMPTIONS = (
    "fp32 parameters and gradients (4 B each) and two fp32 AdamW moments (8 B) per parameter; bf16/fp16 run "
    "through autocast, so the fp32 parameters are the master copy and there is no other",
    "ZeRO 0 = DDP (its buckets a second copy of the gradients, as gradient_as_bucket_view is off; with tp > 1 "
    "FSDP2's replicate, one all-reduce per block), 1 = + ZeroRedundancyOptimizer, 2 = FSDP2 without resharding "
    "after forward, 3 = FSDP2; FSDP2 units are the blocks, and the rest of a stage is the root",
    "gradients are synchronised once per step (DDP no_sync, pipeline schedules); FSDP2 without a pipeline "
    "reduce-scatters after every micro-batch; within a pipeline it accumulates full gradients, and ZeRO-2 then "
    "gathers parameters once per step; ZeRO-3 gathers each unit for every forward and backward",
    "tensor parallel is Megatron-style with sequence parallel (DTensor plans): attention and MLP weights, the "
    "embedding (vocab-parallel) and the head split across tp, norms replicated; the logits are gathered for the "
    "loss (no loss parallel)",
    "activations are the tensors autograd saves for backward, term by term as torch's CPU kernels save them for "
    "this model (a fused GPU RMSNorm may save less), each storage once however many ops save it; under autocast "
    "each in-flight micro-batch also holds the 2-byte copies of the weights it used",
    "checkpointed blocks keep only their input; the one block backward rebuilds at a time is a transient, counted "
    "under other with the logits: activations are what forward leaves saved, as the telemetry measures them",
    "a pipeline rank holds the micro-batches its schedule has run forward and not yet backward, in the order torch "
    "runs that rank's actions, and peaks at the end of the forward that leaves most saved; each stage's input and "
    "its output's gradient arrive in receive buffers torch allocates once per micro-batch and keeps between steps, "
    "counted under buffers (the input its first block saves is not counted again); not counted: the stage output "
    "(on the last stage the logits) that torch keeps for each micro-batch until its backward",
    "peak memory is the sum of every category, with no credit for freeing before the peak",
    "model FLOPs count attention over the full seq² square (causal masking not halved), like PaLM's MFU and "
    "torch's FlopCounterMode; recomputation is executed but not model FLOPs",
    "every collective's bus bandwidth (as nccl-tests defines it) is the profile's link bandwidth, no latency term; "
    "ranks are in one NVLink domain",
    "gradient syncs hide behind the backward they follow, FSDP all-gathers behind the rest of the compute; "
    "tensor-parallel collectives, pipeline sends and ZeRO-1's parameter broadcast are exposed",
    "mixture of experts: the router balances perfectly (each expert and each ep rank gets its even share of the "
    "assignments, capped by capacity), so every figure that depends on routing is its mean over ranks; "
    "activations exact in fp32, the autocast copies of routed tokens and expert weights approximate; the "
    "expert-parallel all-to-alls block (exposed), expert gradients are all-reduced over edp per micro-batch "
    "under ZeRO-0 and sharded over edp by FSDP2 under ZeRO-2/3; with tp > 1 a MoE FFN is whole on every tp rank "
    "and computes the gathered sequence there (replicated), its output sliced back to the rank's shard",
)

GPU_ASSUMPTIONS = (
    "the run as CUDA kernels make it, for this engine's model: flash attention (SDPA) keeps its output and "
    "log-sum-exp, never the seq² scores; RMSNorm is one fused kernel keeping its input and 1/rms; under tensor "
    "parallel the projections keep their gathered inputs (DTensor's sequence parallel; Megatron re-gathers them)",
    "precision: autocast keeps fp32 parameters, an fp32 residual stream and a 2-byte copy of every weight per "
    "micro-batch in flight; FSDP2 mixed precision (Config.mixed_precision 'fsdp') gathers 2-byte parameters, "
    "keeps fp32 shards and moments, runs the residual in 2 bytes, reduces in fp32 (or the compression's dtype)",
    "recomputation: 'selective' and 'full' checkpoint whole blocks (their input kept); 'op' is torchtitan's "
    "per-op policy (every other matmul output and the attention output kept; wk, wo, w3 and every elementwise "
    "op recomputed, and under tp the sequence-parallel gathers)",
    "memory peaks at the largest of five moments of the step (forward end, loss backward, first block's "
    "backward, backward end, optimizer step), not at the sum of the categories; each category is reported at "
    "its own peak; FSDP2 shards the parameters at rest at ZeRO 2 too",
    "device memory: the caching allocator reserves its peak plus 15% free fragments (GMLake, ASPLOS 2024); the "
    "CUDA context (~0.5 GiB) and NCCL's buffers (2 × 16 channels × 4 MiB per communicator) sit outside it",
    "compute: every GEMM by shape (wave quantization over the SMs, a memory roofline) at the large-GEMM rate "
    "measured on an H200 (790 of 989.5 TFLOP/s); flash attention at FlashAttention-2's measured rate for causal "
    "head-dim-128 sequences of 8192 on an H100 (286 TFLOP/s); under a power limit below the rating (the 500 W "
    "h100-96gb) both in proportion to the power, memory-bound kernels not; norms, rotary, activations, casts, the "
    "loss, FSDP2's copies and AdamW by the bytes they move at 90% of HBM bandwidth; kernel launches and the host "
    "are taken to keep up",
    "communication: every collective priced by workbench.links (NVLink inside a node, the network between, "
    "ranks in mesh order); FSDP2's gathers and reduce-scatters hide behind their neighbouring unit's compute "
    "(the first gather and the last reduce-scatter exposed); DDP's all-reduce behind the last backward; tensor "
    "parallel, pipeline sends, expert all-to-alls and ZeRO-1's broadcast exposed; NCCL's kernels take nothing "
    "from the compute they overlap",
    "mixture of experts as on CPU: perfectly balanced routing, the expert GEMMs at their even share of tokens",
    "not modelled: context parallel, async tensor parallel, CUDA graphs, activation offload, the tail of "
    "fragmentation (a run can reserve more), NCCL's SM and memory-bandwidth contention with overlapped compute",
)
