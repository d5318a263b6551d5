"""Published training runs, each a Config as it was launched, and the estimator's error on each.

TORCHTITAN is every row of torchtitan's published Llama 3.1 tables (the runs tests/test_published.py holds to its
bounds); HELD_OUT is a set of other published runs of the same kind, predicted by the same model and reported,
never fitted (what they run differently is said with each). Print both, predicted beside published:

    .venv/bin/python -m tests.published_runs

Sources (each row names its table):
- titan-2412: torchtitan benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, torch 1963fc8, Dec 2024):
  Grand Teton hosts of 8 H100 (96 GB HBM2e at 2.4 TB/s, 500 W power limit) on NVLink, 400 Gb/s RDMA per GPU;
  seq_len 8192; "Memory" is torch's max reserved memory; FSDP2 mixed precision (bf16 parameters, fp32 reduce);
  selective AC is the per-op policy ("op"); loss parallel with TP (torchtitan's default); torch.compile per block,
  the loss not compiled ("compiling loss function causes CUDA errors, turning off for now"); Float8 is torchao's
  tensorwise recipe with the float8 FSDP all-gather and precomputed scales (the 405B job file's [float8]), whose
  linears then saved fp8 copies of their inputs (`Features.float8_saves_fp8_inputs`); with a
  pipeline, FSDP keeps the gathered weights from forward to backward (parallelize_llama.py:
  `reshard_after_forward = not pp_enabled`: zero 2), 126 layers split by `generate_split_points` (the first and last
  stages one block lighter), pp micro-batches (`pipeline_parallel_microbatches` unset).
- titan-2506-asynctp: torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md at 8b6770a (torch 38410cf9,
  torchtitan 820504e, June 2025): the same hosts; compile (model and loss: components/loss.py), llama3 job files
  whose [float8] has enable_fsdp_float8_all_gather = false; TPS only.
- titan-2506-h200: torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md (torchtitan e7c0cae): hosts of 8
  H200 (700 W), 400 Gb/s CX-7 per GPU; compile (model and loss), Float8 with the FSDP float8 all-gather.
- ao-mx-b200: torchao torchao/prototype/mx_formats/README.md, "Training e2e benchmarks on NVIDIA B200" (torch
  2.9.0.dev20250815, torchao 0.13.0+gite4e681be6, torchtitan 6fc499f; torchtitan's docs/mxfp8.md copies it): "8x
  power limited B200", Llama3-8B, batch 1, seq 8192, compile (model and loss), FSDP2, per-op SAC. The limit is
  750 W: the torchao team's B200s ("Surprisingly the % efficiency is actually better on 750W limited device",
  pytorch/ao PR 3566). "Peak Memory (GB)" is torchtitan's max reserved, which it logs in GiB. That commit calls
  SDPA's cuDNN kernel first on compute capability 10.0 (models/attention.py), and its per-op `_save_list`
  (models/llama3/infra/parallelize.py) names the flash and efficient kernels only: attention recomputed.
- titan-2608-nvfp4: torchtitan components/quantization/nvfp4.md, "Llama 3 8B 200M-Token Evidence" (torchtitan PR
  3914, bcc09297a, August 2026; torch 2.14.0a0+gitd9abf9e, CUDA 13.3, torchao 0.18): "4× NVIDIA GB200, 184.3 GiB
  HBM each" (the PR), FSDP 4, local batch 32, seq 2048, compile (the model only: `CompileConfig(components=
  ["model"])`), the per-op selective policy (`SelectiveAC`, llama3_8b's default; its save list names SDPA's cuDNN
  kernel since torchtitan 114151ad4, March 2026), the loss chunked in 8 (`ChunkedLossWrapper`, llama3_8b's loss,
  uncompiled), q, k and v one linear (`fuse_qkv=True`, the llama3 models' default from 3396a4b37, June 2026); BF16,
  MXFP8 (`llama3_8b_mxfp8`, bf16 all-gather; its converter, given no module names, converts the LM head too:
  `Features.low_precision_head`) and NVFP4 with the last 15% of blocks in bf16
  (`llama3_8b_first_85_pct_layers_nvfp4`). "Memory" is torchtitan's max reserved GiB. The doc's figures, not the PR
  description's earlier NVFP4 run (31,758 tokens/s, 103.00 GiB).
- ao-f8-h100 (held out): torchao docs/source/workflows/training.md, "NVIDIA H100" (first published in
  torchao/float8/README.md by pytorch/ao PR 1793, March 2025; torch 2.7.0a0+gitb98af95, torchao 0.10.0+git890e0ac8
  of 2025-02-28, torchtitan 0.0.2): 8 H100s, Llama3-8B, batch 1, seq 8192, compile, FSDP2, per-op SAC; bf16,
  tensorwise with the float8 all-gather, rowwise with the bf16 all-gather. The hosts are torchtitan's 96 GB H100s
  (`h100-96gb`): the same team's run of that benchmark script logs "memory: 47.79GiB(50.30%)" (pytorch/ao PR 1802),
  a 95 GiB device. torchtitan compiled no loss then (components/loss.py from 3aff9bd9e, Feb 2025: "compiling loss
  function causes CUDA errors, turning off for now"; compiled again from bbb1b616e, 2 April 2025), and torchao's
  linears saved bf16 inputs (PR 1461, January 2025): the default Features.
- titan-2608-qwen3 (held out): the same doc's "Qwen3 8B 200M-Token Evidence", random initialization: FSDP 4, local
  batch 16, seq 2048, on the same GB200s (its "42.67%" of 78.63 GiB is their 184.3 GiB); BF16, MXFP8, NVFP4 with
  layers 30-35 in bf16. Launched from configs the doc does not give (the NVFP4 one, qwen3_8b_first_85_pct_layers_nvfp4,
  is sft_qwen3_8b_math's: per-op SAC, the loss in 8 chunks, compile of the model, varlen attention), and expressed
  with transformers' Qwen3 built from Qwen/Qwen3-8B's config.json shape and traced: q, k and v apart, where
  torchtitan's qwen3 fuses them.
- bridge-2511: Megatron-Bridge docs/performance-summary-archive.md, "25.11 NeMo Container", pre-training (DGX-H100,
  DGX-B200, DGX-GB200, DGX-GB300): Megatron-Core with Transformer Engine, FP8 current scaling (per tensor, as
  torchao's tensorwise) or MXFP8, seq 8192, TP with sequence parallel; no recomputation; Megatron's distributed
  optimizer (FSDP 0: written zero=1 at tp = 1, zero=2 under tp·pp, the same gradient reduce-scatter and one
  parameter gather a step) or Megatron-FSDP (FSDP > 0: zero=3); fused kernels (compile=True stands for TE's).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

import workbench as wb
from workbench.estimate import Features

GiB = 2**30
# titan-2412's torchao (December 2024): the tensorwise Float8 linear saved fp8 copies of its inputs.
DEC_2024 = Features(float8_saves_fp8_inputs=True)
DEC_2024_TP = Features(loss_parallel=True, float8_saves_fp8_inputs=True)  # torchtitan's default with tp
COMPILED_LOSS = Features(compile_loss=True)
COMPILED_LOSS_TP = Features(compile_loss=True, loss_parallel=True)
# torchtitan 6fc499f on Blackwell: SDPA's cuDNN kernel first, which its per-op save list does not name; from
# 83e694105 (July 2025) the embedding and [norm, output] are FSDP units of their own.
COMPILED_LOSS_CUDNN = Features(compile_loss=True, op_keeps_attention=False, fsdp_edge_units=True)
# torchtitan of August 2026: the loss (uncompiled) in 8 chunks; its llama3 with q, k and v in one linear.
CHUNKED_LOSS = Features(loss_chunks=8, fsdp_edge_units=True)
TITAN_2608 = Features(loss_chunks=8, fused_qkv=True, fsdp_edge_units=True)


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    cfg: wb.Config
    hardware: str
    tokens_per_s_per_gpu: float
    memory_gib: float | None = None
    features: Features = Features()

    def predict(self) -> tuple[float, float]:
        """(tokens/s per GPU, GiB reserved) as the estimator predicts this run."""
        est = wb.estimate(self.cfg, self.hardware, features=self.features)
        return est.tokens_per_s / self.cfg.world_size, est.memory.reserved / GiB


def titan(preset: str, gpus: int, local_batch: int, recompute: str, *, tp: int = 1, pp: int = 1, cp: int = 1,
          seq_len: int = 8192, compile: bool = True, precision: str = "bf16", async_tp: bool = False,
          fp8_all_gather: bool = True, schedule: str = "1f1b", model: wb.HFModel | None = None) -> wb.Config:
    """A torchtitan llama3 run as launched: FSDP over dp·cp (zero 3, or 2 under a pipeline), FSDP2's bf16 mixed
    precision, local batch `local_batch` per dp rank, pp micro-batches and torchtitan's split of the layers.
    `model`: another architecture than the llama3 `preset`, traced."""
    if model is None:
        model = wb.ModelConfig.preset(preset)
        if seq_len > model.max_seq_len:
            model = dataclasses.replace(model, max_seq_len=seq_len)
    dp = gpus // (tp * pp * cp)
    stages = pp * (2 if schedule == "interleaved_1f1b" else 1)
    split = wb.lighter_ends(model.n_layers, stages) if pp > 1 and model.n_layers % stages else ()
    return wb.Config(model=model, dp=dp, tp=tp, pp=pp, cp=cp, zero=2 if pp > 1 else 3, precision=precision,
                     mixed_precision="fsdp", activation_checkpointing=recompute, seq_len=seq_len,
                     batch_size=local_batch * dp, micro_batches=pp, schedule=schedule, stages_per_rank=2,
                     stage_layers=split, compile=compile, async_tp=async_tp, fp8_all_gather=fp8_all_gather)


def bridge(preset: str, gpus: int, precision: str, gbs: int, mbs: int, *, tp: int = 1, pp: int = 1, cp: int = 1,
           vp: int = 1, fsdp: bool = False) -> wb.Config:
    """A Megatron-Bridge pre-training row: GBS sequences of 8192 in micro-batches of MBS, layers split with the
    first and last stages lighter where they do not divide (Megatron's account_for_embedding/loss)."""
    model = wb.ModelConfig.preset(preset)
    dp = gpus // (tp * pp * cp)
    stages = pp * vp
    split = wb.lighter_ends(model.n_layers, stages) if pp > 1 and model.n_layers % stages else ()
    zero = 3 if fsdp else (1 if tp == 1 and pp == 1 else 2)
    return wb.Config(model=model, dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, precision=precision,
                     mixed_precision="fsdp" if zero >= 2 else "autocast", seq_len=8192, batch_size=gbs,
                     micro_batches=gbs // (mbs * dp), schedule="interleaved_1f1b" if vp > 1 else "1f1b",
                     stages_per_rank=vp, stage_layers=split, compile=True, fp8_all_gather=False)


H100 = "h100-96gb"
FP8, ROW, MX = "fp8_tensorwise", "fp8_rowwise", "mxfp8"

TORCHTITAN = (
    # titan-2412 Table 1: 8B, 8 GPUs, FSDP 8, local batch 2, per-op SAC.
    Run("8B FSDP 8", "titan-2412 T1", titan("8b", 8, 2, "op", compile=False), H100, 5762, 82.4, DEC_2024),
    Run("8B FSDP 8 + compile", "titan-2412 T1", titan("8b", 8, 2, "op"), H100, 6667, 77.0, DEC_2024),
    Run("8B FSDP 8 + compile + Float8", "titan-2412 T1", titan("8b", 8, 2, "op", precision=FP8), H100, 8532,
        76.8, DEC_2024),
    # Table 2: 8B, 8 GPUs, FSDP × CP, local batch 1, full AC, compile + Float8.
    Run("8B FSDP 8 CP 1, 32K", "titan-2412 T2", titan("8b", 8, 1, "full", seq_len=32768, precision=FP8), H100,
        3890, 83.9, DEC_2024),
    Run("8B FSDP 4 CP 2, 64K", "titan-2412 T2", titan("8b", 8, 1, "full", cp=2, seq_len=65536, precision=FP8), H100,
        2540, 84.2, DEC_2024),
    Run("8B FSDP 2 CP 4, 128K", "titan-2412 T2", titan("8b", 8, 1, "full", cp=4, seq_len=131072, precision=FP8),
        H100, 1071, 84.0, DEC_2024),
    Run("8B FSDP 1 CP 8, 256K", "titan-2412 T2", titan("8b", 8, 1, "full", cp=8, seq_len=262144, precision=FP8),
        H100, 548, 84.5, DEC_2024),
    # Table 3: Table 1 on 128 GPUs.
    Run("8B FSDP 128", "titan-2412 T3", titan("8b", 128, 2, "op", compile=False), H100, 5605, 67.0, DEC_2024),
    Run("8B FSDP 128 + compile", "titan-2412 T3", titan("8b", 128, 2, "op"), H100, 6514, 62.0, DEC_2024),
    Run("8B FSDP 128 + compile + Float8", "titan-2412 T3", titan("8b", 128, 2, "op", precision=FP8), H100, 8380,
        61.8, DEC_2024),
    # Table 4: 70B, 256 GPUs, FSDP 32 × TP 8, local batch 16, full AC, compile + Float8.
    Run("70B FSDP 32 TP 8", "titan-2412 T4", titan("70b", 256, 16, "full", tp=8, precision=FP8), H100, 829, 71.9,
        DEC_2024_TP),
    Run("70B FSDP 32 TP 8 + async TP", "titan-2412 T4",
        titan("70b", 256, 16, "full", tp=8, precision=FP8, async_tp=True), H100, 876, 67.6, DEC_2024_TP),
    # Table 5: 405B, 512 GPUs, FSDP 8 × TP 8 × PP 8, local batch 32, full AC, compile + Float8 + async TP.
    Run("405B PP 8 1F1B", "titan-2412 T5",
        titan("405b", 512, 32, "full", tp=8, pp=8, precision=FP8, async_tp=True), H100, 100, 82.5, DEC_2024_TP),
    Run("405B PP 8 interleaved 1F1B", "titan-2412 T5",
        titan("405b", 512, 32, "full", tp=8, pp=8, precision=FP8, async_tp=True, schedule="interleaved_1f1b"),
        H100, 128, 72.7, DEC_2024_TP),
    # Table 6: 405B, 512 GPUs, TP 8 × PP 8 (1F1B) × FSDP × CP, local batch 8, full AC, compile + Float8 + async TP.
    *[Run(f"405B FSDP {8 // cp} CP {cp}, {seq // 1024}K", "titan-2412 T6",
          titan("405b", 512, 8, "full", tp=8, pp=8, cp=cp, seq_len=seq, precision=FP8, async_tp=True), H100, tps,
          gib, DEC_2024_TP)
      for cp, seq, tps, gib in ((1, 32768, 76, 75.3), (2, 65536, 47, 75.9), (4, 131072, 31, 77.1),
                                (8, 262144, 16, 84.9))],
    # titan-2506-asynctp: 70B on 256 GPUs (FSDP 32 × TP 8, full AC, local batch 16) and 8B on 64 GPUs (FSDP 8 ×
    # TP 8, per-op SAC, local batch 12); bf16, Float8 tensorwise and rowwise, vanilla and async TP.
    *[Run(f"{name} {label}{' + async TP' * a}", "titan-2506-asynctp",
          titan(preset, gpus, batch, ac, tp=8, precision=precision, async_tp=a, fp8_all_gather=False), H100, tps,
          None, COMPILED_LOSS_TP)
      for name, preset, gpus, batch, ac, rows in (
          ("70B FSDP 32 TP 8", "70b", 256, 16, "full",
           (("bf16", "bf16", 597.3, 652.4), ("Float8", FP8, 809.8, 942.4), ("Float8 rowwise", ROW, 599.6, 624.8))),
          ("8B FSDP 8 TP 8", "8b", 64, 12, "op",
           (("bf16", "bf16", 4378, 4809.4), ("Float8", FP8, 5078.1, 5570.1), ("Float8 rowwise", ROW, 3708.5, 3914.9))))
      for label, precision, vanilla, fused in rows for a, tps in ((False, vanilla), (True, fused))],
    # titan-2506-h200: 8B, FSDP 32 and 64 on H200s, local batch 2, per-op SAC, compile + Float8.
    Run("8B FSDP 32 on H200 + Float8", "titan-2506-h200", titan("8b", 32, 2, "op", precision=FP8), "h200", 10938,
        47.96, COMPILED_LOSS),
    Run("8B FSDP 64 on H200 + Float8", "titan-2506-h200", titan("8b", 64, 2, "op", precision=FP8), "h200", 10753,
        46.97, COMPILED_LOSS),
    # ao-mx-b200: 8B, FSDP 8 on 750 W B200s, batch 1, per-op SAC, compile.
    *[Run(f"8B FSDP 8 on B200 {label}", "ao-mx-b200",
          titan("8b", 8, 1, "op", precision=precision, fp8_all_gather=gather), "b200@750w", tps, gib,
          COMPILED_LOSS_CUDNN)
      for label, precision, gather, tps, gib in (
          ("bf16", "bf16", False, 8307.5, 33.71), ("Float8 (fp8 all-gather)", FP8, True, 10417.0, 33.38),
          ("mxfp8_cublas", MX, False, 9969.0, 33.88), ("mxfp8_cublas_rceil", MX, False, 9642.0, 33.88),
          ("Float8 rowwise", ROW, False, 8640.5, 33.72))],
    # titan-2608-nvfp4: 8B, FSDP 4 on GB200s, local batch 32 at seq 2048, per-op SAC, compile, loss in 8 chunks.
    *[Run(f"8B FSDP 4 on GB200 {label}", "titan-2608-nvfp4",
          titan("8b", 4, 32, "op", seq_len=2048, precision=precision, fp8_all_gather=False), "gb200", tps, gib,
          features)
      for label, precision, features, tps, gib in (
          ("bf16", "bf16", TITAN_2608, 21919, 174.49),
          ("MXFP8", MX, dataclasses.replace(TITAN_2608, low_precision_head=True), 28084, 179.94),
          ("NVFP4, last 15% bf16", "bf16", dataclasses.replace(TITAN_2608, nvfp4=0.85), 30040, 110.95))],
)


def qwen3_8b() -> wb.HFModel:
    """Qwen/Qwen3-8B's architecture (its config.json), built by transformers offline and traced by the estimator."""
    from transformers import Qwen3Config

    return wb.HFModel(Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                  tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1e6,
                                  rms_norm_eps=1e-6))

HELD_OUT = (
    # torchtitan docs/performance.md before Dec 2024 (commit d4c86e3): 64 A100 80 GB, 8B, local batch 1, per-op SAC.
    Run("torchtitan 8B FSDP 64 on A100", "titan-2408", titan("8b", 64, 1, "op", compile=False), "a100", 2973),
    # titan-2608-qwen3: Qwen3 8B, FSDP 4 on GB200s, local batch 16 at seq 2048, per-op SAC, compile, loss in 8 chunks.
    *[Run(f"torchtitan Qwen3 8B FSDP 4 on GB200 {label}", "titan-2608-qwen3",
          titan("8b", 4, 16, "op", seq_len=2048, precision=precision, fp8_all_gather=False, model=qwen3_8b()),
          "gb200", tps, gib, features)
      for label, precision, features, tps, gib in (
          ("bf16", "bf16", CHUNKED_LOSS, 20913, 112.88), ("MXFP8", MX, CHUNKED_LOSS, 27587, 112.63),
          ("NVFP4, layers 30-35 bf16", "bf16", dataclasses.replace(CHUNKED_LOSS, nvfp4=30 / 36), 26732, 78.63))],
    # ao-f8-h100: 8B, FSDP 8 on torchtitan's 96 GB H100s, batch 1, per-op SAC, compile (not the loss).
    *[Run(f"torchao 8B FSDP 8 (H100) {label}", "ao-f8-h100",
          titan("8b", 8, 1, "op", precision=precision, fp8_all_gather=gather), H100, tps, gib)
      for label, precision, gather, tps, gib in (
          ("bf16", "bf16", False, 6150, 47.65), ("Float8 (fp8 all-gather)", FP8, True, 7689.5, 47.77),
          ("Float8 rowwise", ROW, False, 6768, 47.79))],
    # bridge-2511, DGX-H100 (700 W).
    Run("Bridge 8B FP8 FSDP 8 (H100)", "bridge-2511", bridge("8b", 8, FP8, 128, 1, fsdp=True), "h100", 14451),
    Run("Bridge 70B FP8 TP4 PP8 VP5 (H100)", "bridge-2511", bridge("70b", 64, FP8, 128, 1, tp=4, pp=8, vp=5),
        "h100", 1602),
    Run("Bridge 405B FP8 TP8 PP8 CP2 VP8 (H100)", "bridge-2511",
        bridge("405b", 1024, FP8, 512, 1, tp=8, pp=8, cp=2, vp=8), "h100", 292),
    # DGX-B200 (1,000 W).
    Run("Bridge 8B FP8 DP 8 (B200)", "bridge-2511", bridge("8b", 8, FP8, 128, 2), "b200", 30624),
    Run("Bridge 8B MXFP8 DP 8 (B200)", "bridge-2511", bridge("8b", 8, MX, 128, 2), "b200", 29521),
    Run("Bridge 405B FP8 TP4 PP8 CP2 VP8 (B200)", "bridge-2511",
        bridge("405b", 128, FP8, 64, 1, tp=4, pp=8, cp=2, vp=8), "b200", 661),
    Run("Bridge 405B MXFP8 TP4 PP8 CP2 VP8 (B200)", "bridge-2511",
        bridge("405b", 128, MX, 64, 1, tp=4, pp=8, cp=2, vp=8), "b200", 624),
    # DGX-GB200 (NVL72).
    Run("Bridge 8B FP8 DP 8 (GB200)", "bridge-2511", bridge("8b", 8, FP8, 128, 2), "gb200", 31508),
    Run("Bridge 8B MXFP8 DP 8 (GB200)", "bridge-2511", bridge("8b", 8, MX, 128, 2), "gb200", 29789),
    Run("Bridge 70B FP8 FSDP 64 (GB200)", "bridge-2511", bridge("70b", 64, FP8, 256, 2, fsdp=True), "gb200", 4312),
    Run("Bridge 405B FP8 TP4 PP16 VP4 (GB200)", "bridge-2511", bridge("405b", 256, FP8, 1536, 1, tp=4, pp=16, vp=4),
        "gb200", 813),
    # DGX-GB300 (NVL72).
    Run("Bridge 8B FP8 DP 8 (GB300)", "bridge-2511", bridge("8b", 8, FP8, 128, 2), "gb300", 37556),
    Run("Bridge 8B MXFP8 DP 8 (GB300)", "bridge-2511", bridge("8b", 8, MX, 128, 2), "gb300", 36108),
    Run("Bridge 70B FP8 FSDP 64 (GB300)", "bridge-2511", bridge("70b", 64, FP8, 256, 2, fsdp=True), "gb300", 4520),
    Run("Bridge 405B FP8 TP2 PP8 CP2 VP4 (GB300)", "bridge-2511",
        bridge("405b", 256, FP8, 1536, 1, tp=2, pp=8, cp=2, vp=4), "gb300", 999),
)


def errors(runs: tuple[Run, ...]) -> list[tuple[Run, float, float | None, float, float | None]]:
    """Each run with (predicted tokens/s, predicted GiB or None, throughput error, memory error or None)."""
    out = []
    for run in runs:
        tps, gib = run.predict()
        mem = None if run.memory_gib is None else gib / run.memory_gib - 1
        out.append((run, tps, gib if run.memory_gib is not None else None, tps / run.tokens_per_s_per_gpu - 1, mem))
    return out


def summary(rows) -> dict[str, float]:
    """Mean and worst |error| of throughput and of memory over the rows."""
    tput = [abs(r[3]) for r in rows]
    mem = [abs(r[4]) for r in rows if r[4] is not None]
    return {"tput_mean": statistics.mean(tput), "tput_worst": max(tput),
            "mem_mean": statistics.mean(mem) if mem else 0.0, "mem_worst": max(mem) if mem else 0.0}


def table(title: str, runs: tuple[Run, ...]) -> str:
    rows = errors(runs)
    lines = [title, f"{'run':<52} {'source':<19} {'tok/s/GPU':>9} {'published':>9} {'err':>7}   "
                    f"{'GiB':>5} {'published':>9} {'err':>7}"]
    for run, tps, gib, e_t, e_m in rows:
        mem = (f"{gib:5.1f} {run.memory_gib:9.2f} {e_m:+7.1%}" if gib is not None else f"{'':5} {'—':>9} {'':7}")
        lines.append(f"{run.name:<52} {run.source:<19} {tps:9,.0f} {run.tokens_per_s_per_gpu:9,.1f} {e_t:+7.1%}   "
                     + mem)
    s = summary(rows)
    lines.append(f"throughput |error|: mean {s['tput_mean']:.1%}, worst {s['tput_worst']:.1%} ({len(rows)} rows); "
                 f"memory |error|: mean {s['mem_mean']:.1%}, worst {s['mem_worst']:.1%} "
                 f"({sum(r[4] is not None for r in rows)} rows)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table("torchtitan's published runs", TORCHTITAN))
    print()
    print(table("held out (reported, never fitted)", HELD_OUT))
