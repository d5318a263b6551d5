"""The estimator held to published runs: every row of torchtitan's published Llama 3.1 tables as launched
(tests/published_runs.py: each row's source and conditions), a held-out set of other published runs reported
beside them, FLOPs within 1%, and the model-state and activation arithmetic of ZeRO's paper, DeepSpeed,
Megatron-LM and Korthikanti et al.

    .venv/bin/python -m tests.published_runs      # every row, predicted beside published, with its error

Guard against tuning: every constant of the GPU model is cited in the code (hardware.py, links.py,
estimate/kernels.py, estimate/low_precision.py, estimate/allocator.py), none is fitted to a row; a cause is
changed only when a row shows it and its citation says it (git log of workbench/estimate/).

The bounds: the four rows issue 18 held at 10% keep that bound. The whole table's mean and worst errors are held
at what this model reaches (a regression shows); issue 34's target, a mean of 3% and every row within 8% on
throughput and memory, is not reached: docs/estimator.md gives the figures and what misses and why.
"""

from __future__ import annotations

import math

import pytest

import workbench as wb
from tests.published_runs import HELD_OUT, TORCHTITAN, Run, errors, summary, titan
from workbench.estimate import ENGINE_STATE_BYTES, Features, StateBytes, model_state_memory, zero_paper_memory

GB, GiB = 1e9, 2**30
TOLERANCE = 0.10
ISSUE_18 = ("8B FSDP 8", "8B FSDP 8 + compile", "8B FSDP 8 + compile + Float8", "70B FSDP 32 TP 8")
"""torchtitan's Table 1 and Table 4 runs issue 18 held to 10%."""


def _runs(names: tuple[str, ...]) -> list[Run]:
    return [r for r in TORCHTITAN if r.name in names]


def test_every_published_torchtitan_run_is_a_config_as_launched():
    # 40 rows: tables 1-6 of December 2024 (18), the June 2025 async-TP runs (12), the H200 runs (2), the MXFP8 B200
    # table (5), the NVFP4 GB200 table of August 2026 (3).
    assert len(TORCHTITAN) == 40 and len({r.name for r in TORCHTITAN}) == 40
    for run in TORCHTITAN:
        # No stand-ins: what the estimator models beyond the Config is torchtitan's own code, which this engine
        # does not run: its loss (parallel under tp, compiled since 2025), on Blackwell its per-op save list that
        # does not name the cuDNN attention it calls there, the December 2024 torchao's fp8 input copies, and in
        # 2026 its loss in chunks, its fused q, k and v projections, NVFP4 linears and an MXFP8 head; from July 2025
        # its FSDP units for the embedding and the head.
        allowed = {"none", "loss_parallel", "compile_loss", "op_recomputes_attention", "float8_saves_fp8_inputs",
                   "loss in 8 chunks", "fused qkv", "nvfp4 85% of blocks", "8-bit head", "FSDP edge units"}
        assert set(run.features.describe().split("+")) <= allowed, run.name
        assert run.features.op_keeps_attention or run.hardware.startswith("b200"), run.name
        assert run.features.float8_saves_fp8_inputs == (run.source.startswith("titan-2412")), run.name
        assert not run.features.loss_parallel or run.cfg.tp > 1
        titan_2026 = run.source.startswith("titan-2608")
        assert bool(run.features.loss_chunks) == run.features.fused_qkv == titan_2026, run.name
        # torchtitan 83e694105 (July 2025): the B200 table's 6fc499f has it, the June 2025 tables' e7c0cae and
        # 820504e do not.
        assert run.features.fsdp_edge_units == (titan_2026 or run.source == "ao-mx-b200"), run.name
    by_name = {r.name: r.cfg for r in TORCHTITAN}
    # The 405B pipelines cut as torchtitan's generate_split_points cut them: the first and last stages lighter.
    assert by_name["405B PP 8 1F1B"].stage_layers == (15, 16, 16, 16, 16, 16, 16, 15)
    assert by_name["405B PP 8 interleaved 1F1B"].stage_layers == (7,) + (8,) * 14 + (7,)
    # FSDP 1 × CP 8: ZeRO 3 over the eight cp ranks; async TP and Float8 under tensor parallel as launched.
    cp8 = by_name["405B FSDP 1 CP 8, 256K"]
    assert (cp8.dp, cp8.cp, cp8.zero, cp8.async_tp, cp8.precision) == (1, 8, 2, True, "fp8_tensorwise")
    assert by_name["8B FSDP 1 CP 8, 256K"].zero == 3
    assert by_name["70B FSDP 32 TP 8 Float8 + async TP"].fp8_all_gather is False
    assert by_name["8B FSDP 8 on B200 mxfp8_cublas"].precision == "mxfp8"


@pytest.mark.parametrize("run", _runs(ISSUE_18), ids=lambda r: r.name)
def test_torchtitan_memory(run):
    est = wb.estimate(run.cfg, run.hardware, features=run.features)
    predicted = est.memory.reserved / GiB  # what torchtitan reads: the caching allocator's max reserved
    print(f"{run.name}: {predicted:.1f} GiB vs {run.memory_gib} ({predicted / run.memory_gib - 1:+.1%}), "
          f"peak at {est.memory.peak_at}")
    assert math.isclose(predicted, run.memory_gib, rel_tol=TOLERANCE)
    assert est.fits  # the planner must accept what ran


@pytest.mark.parametrize("run", _runs(ISSUE_18), ids=lambda r: r.name)
def test_torchtitan_throughput(run):
    predicted, _ = run.predict()
    print(f"{run.name}: {predicted:,.0f} tokens/s/GPU vs {run.tokens_per_s_per_gpu:,} "
          f"({predicted / run.tokens_per_s_per_gpu - 1:+.1%})")
    assert math.isclose(predicted, run.tokens_per_s_per_gpu, rel_tol=TOLERANCE)


REACHED = {"tput_mean": 0.199, "tput_worst": 1.15, "mem_mean": 0.070, "mem_worst": 0.140}
"""What this model reaches over TORCHTITAN (mean and worst |error|), rounded up: 19.9%, 114.1%, 7.0%, 14.0% (40
rows; 21.5%, 114.3%, 7.4%, 17.0% before the B200's measured MXFP8 GEMM share, the GB200 MXFP8 run's head converted
as launched, the GB200's rates at the B200's times their clocks' ratio, torchtitan's FSDP units of July 2025 and
the root gathered in bf16 beside the fp8 all-gather;
the 37 before the GB200 table of August 2026 joined them: 21.0%, 114.3%, 8.0%, 17.0%). Issue 34 asks 3% mean and
8% worst for both; the rows that miss most (the B200 runs, +55-114%; the GB200 MXFP8 run, +33%; the Float8 rowwise
runs under TP, a known torchao slowdown, +17-35%) are named in docs/estimator.md with what is known of why."""

HELD_OUT_REACHED = {"tput_mean": 0.082, "tput_worst": 0.21, "mem_mean": 0.035, "mem_worst": 0.086}
"""The same over HELD_OUT, rounded up: 8.1%, 20.6%, 3.5%, 8.6% (22 rows; 10.4%, 41.0%, 3.6%, 6.8% before this
model's Blackwell changes of 2026-12-07; torchtitan's FSDP units of July 2025, priced from 2026-12-08, moved the
Qwen3 runs' memory from +4.6%, +4.8%, -6.8% to +3.4%, +3.6%, -8.5%). Reported as they came, never fitted;
ratcheted so that a regression shows."""


def test_the_whole_published_table_does_not_regress():
    rows = errors(TORCHTITAN)
    for run, tps, gib, e_t, e_m in rows:
        print(f"{run.name}: {e_t:+.1%}" + (f", memory {e_m:+.1%}" if e_m is not None else ""))
    reached = summary(rows)
    print(reached)
    for key, bound in REACHED.items():
        assert reached[key] <= bound, (key, reached[key])
    # The memory figures the planner must accept: every published memory fits its device.
    for run in TORCHTITAN:
        if run.memory_gib is not None:
            assert wb.estimate(run.cfg, run.hardware, features=run.features).fits, run.name


def test_held_out_runs():
    # Other people's engines mostly (Megatron-Core with Transformer Engine's fused kernels, CUDA graphs and tp
    # overlap): -21% to +16% today; torchao's H100 float8 table (torchtitan's stack) +5.5% to +13.1%, its memory
    # within 2.2%; torchtitan's Qwen3 on GB200s traced from transformers' Qwen3, +6% to +20%, memory within 8.5%.
    # (issue 18's held-out rows are torchtitan's own and sit in TORCHTITAN now, under REACHED.)
    rows = errors(HELD_OUT)
    for run, tps, gib, e_t, e_m in rows:
        print(f"{run.name}: {tps:,.0f} tokens/s/GPU vs {run.tokens_per_s_per_gpu:,} ({e_t:+.1%})"
              + (f", {gib:.1f} GiB vs {run.memory_gib} ({e_m:+.1%})" if e_m is not None else ""))
    reached = summary(rows)
    print(reached)
    for key, bound in HELD_OUT_REACHED.items():
        assert reached[key] <= bound, (key, reached[key])


def test_torchtitan_flops_per_token():
    # torchtitan's num_flop_per_token (6·(params − embedding) + 12·layers·heads·head_dim·seq) is the
    # estimator's: 57.9 GFLOP/token for the 8B at 8192, within 1%; and its MFU of the 8B run (33.7% of 989.5
    # TFLOP/s at 5,762 tokens/s) follows from it.
    for preset, params in (("8b", 8.03e9), ("70b", 70.55e9)):
        m = wb.ModelConfig.preset(preset)
        embedding = m.vocab_size * m.dim
        theirs = 6 * (m.num_params - embedding) + 12 * m.n_layers * m.n_heads * m.head_dim * 8192
        assert wb.estimate(titan(preset, 8 * (1 + (preset == "70b")), 1, "op"), "h100").flops_per_token == \
            pytest.approx(theirs, rel=0.01)
        assert m.num_params == pytest.approx(params, rel=1e-3)
    assert 5762 * wb.estimate(TORCHTITAN[0].cfg).flops_per_token / 989.5e12 == pytest.approx(0.337, abs=0.001)


# --- model states: ZeRO's paper and DeepSpeed's estimators -------------------------------------------------


def test_zero_paper_model_state_memory():
    # Rajbhandari et al. 2020, Figure 1: a 7.5B-parameter model on 64 GPUs with mixed-precision Adam (2+2 bytes
    # of fp16 parameters and gradients, K = 12 bytes of optimizer state per parameter) needs 120 GB (baseline),
    # 31.4 GB (P_os), 16.6 GB (P_os+g) and 1.9 GB (P_os+g+p) of model states per GPU. The estimator's own
    # per-category arithmetic (model_state_memory, which every estimate uses), with the paper's bytes.
    predicted = zero_paper_memory(7_500_000_000, dp=64)
    published = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}  # GB, printed to three significant digits
    for zero, gb in published.items():
        assert abs(predicted[zero] / GB - gb) <= 0.05 + 1e-12, (zero, predicted[zero] / GB, gb)
    assert model_state_memory(7_500_000_000, 64, 0, ENGINE_STATE_BYTES) == (30 * GB, 30 * GB, 60 * GB)


DEEPSPEED_ZERO2_BYTES = StateBytes(parameters=2, gradients=2 + 4, optimizer=4 + 8)
"""DeepSpeed's ZeRO-2 convention (deepspeed/runtime/zero/stage_1_and_2.py, estimate_zero2_model_states_mem_needs):
a 16-bit copy of every parameter whole on every GPU; 16-bit and fp32 gradients, fp32 master parameters and two
Adam moments sharded: "2 = params_16bit, 18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit + 8_optimizer"."""
DEEPSPEED_ZERO3_BYTES = StateBytes(parameters=2, gradients=4, optimizer=4 + 8)
"""DeepSpeed's ZeRO-3 convention (deepspeed/runtime/zero/stage3.py, estimate_zero3_model_states_mem_needs): 18 B
per parameter, all sharded, plus the largest layer's 16-bit parameters and gradients gathered (4 B each)."""


@pytest.mark.parametrize("gpus_per_node, nodes", [(8, 1), (8, 4)])
def test_deepspeed_model_state_estimators(gpus_per_node, nodes):
    zero2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2",
                                reason="DeepSpeed is the peers extra: pip install -e '.[peers]'")
    zero3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    model = wb.ModelConfig.preset("8b")
    params, gpus = model.num_params, gpus_per_node * nodes
    # Its largest layer, as DeepSpeed's own model-based estimator would find it: the embedding (or the head).
    largest = model.vocab_size * model.dim
    # ZeRO-2 without offload: DeepSpeed's 2P + 18P/N is the estimator's arithmetic with DeepSpeed's bytes (the
    # 16-bit parameters whole, everything else sharded: its stage 2 keeps the 16-bit gradients sharded too).
    _, ds_gpu = zero2.estimate_zero2_model_states_mem_needs(params, gpus_per_node, nodes, cpu_offload=False)
    assert sum(model_state_memory(params, gpus, 2, DEEPSPEED_ZERO2_BYTES)) == pytest.approx(ds_gpu, rel=1e-6)
    # With offload DeepSpeed keeps only the 16-bit parameters on the GPU: the engine's ZeRO-2 offload
    # (FSDP2's CPUOffloadPolicy) keeps them gathered in bf16 from forward to backward, the same 2P.
    _, ds_offload = zero2.estimate_zero2_model_states_mem_needs(params, gpus_per_node, nodes, cpu_offload=True)
    cfg = wb.Config(model=model, dp=gpus, zero=2, precision="bf16", mixed_precision="fsdp", offload=True,
                    seq_len=512, batch_size=gpus)
    assert wb.estimate(cfg, "h100").stages[0].memory.buffers >= ds_offload
    # ZeRO-3: DeepSpeed's 4·L (the largest layer's 16-bit parameters and gradients, gathered) + 18P/N against the
    # estimator with DeepSpeed's bytes: the same sharding arithmetic; the engine itself keeps no 16-bit shard
    # (FSDP2 casts when it gathers), 16 B/parameter where DeepSpeed says 18.
    _, ds3, ds_largest = zero3.estimate_zero3_model_states_mem_needs(params, largest, gpus_per_node, nodes,
                                                                     cpu_offload=False)
    assert ds_largest == 4 * largest
    assert ds_largest + sum(model_state_memory(params, gpus, 3, DEEPSPEED_ZERO3_BYTES)) == pytest.approx(ds3, rel=1e-6)
    engine = wb.estimate(cfg.replace(zero=3, offload=False), "h100").stages[0].memory
    assert engine.parameters + engine.gradients + engine.optimizer == pytest.approx(16 * params / gpus, rel=1e-3)


# --- activations: Korthikanti et al. 2022 and Megatron-LM's theoretical memory -------------------------------


def _block_bytes(cfg: wb.Config, features: Features = Features()) -> int:
    """The estimator's bytes one block keeps for one micro-batch, without recomputation (GPU kernels)."""
    from workbench.estimate.options import dtypes
    from workbench.estimate.saved_gpu import whole_block
    from workbench.estimate.stage import stage_shapes

    return whole_block(stage_shapes(cfg)[0], dtypes(cfg, features), features)


# Korthikanti et al. 2022, Table 3: GPT-3 22B (64 heads, hidden 6144, 48 layers, t = 8, micro-batch 4) and 175B
# (96 heads, hidden 12288, 96 layers, t = 8, p = 8, micro-batch 1), sequence 2048.
KORTHIKANTI = {"22B": (6144, 64, 48, 4, 8, 1), "175B": (12288, 96, 96, 1, 8, 8)}


@pytest.mark.parametrize("name", KORTHIKANTI)
def test_korthikanti_activations_per_layer(name):
    h, a, layers, b, t, p = KORTHIKANTI[name]
    s = 2048
    # Their GPT layer, as our block can take its shape: multi-head attention (kv heads = heads), and SwiGLU with
    # hidden 2h, whose four saved tensors (8·2h bytes per token) are exactly GeLU's two of width 4h (16h).
    model = wb.ModelConfig(dim=h, n_layers=layers, n_heads=a, ffn_dim=2 * h, vocab_size=51200, max_seq_len=s)
    sbh = s * b * h
    for tp in (1, t):
        cfg = wb.Config(model=model, dp=2, tp=tp, zero=3, precision="bf16", mixed_precision="fsdp", seq_len=s,
                        batch_size=2 * b)
        ours = _block_bytes(cfg)
        # Table 2, "tensor + sequence parallel + selective recomputation": 34·sbh/t bytes per layer (with t = 1,
        # selective recomputation alone). Flash attention is their selective recomputation done by the kernel: it
        # keeps no score matrix (the 5·a·s²·b/t term of their baseline) and recomputes it in backward.
        theirs = 34 * sbh / tp
        if tp == 1:
            # Same accounting but for their two dropout masks (1 byte each), which a model without dropout lacks.
            assert ours == pytest.approx(theirs, rel=TOLERANCE)
        # Term by term, what differs: Megatron's sequence parallel keeps the two projection inputs (the layer
        # norms' outputs) sharded and all-gathers them again in backward, torch's DTensor keeps them gathered
        # (4·sbh·(1 - 1/t) more); their two dropout masks (2·sbh/t) are not in our model. The rest, to 0.2%
        # (the norms' 1/rms and attention's log-sum-exp, a few bytes per token).
        assert ours == pytest.approx(theirs + 4 * sbh * (1 - 1 / tp) - 2 * sbh / tp, rel=0.002)


def test_korthikanti_pipeline_first_stage():
    # Korthikanti et al. 2022, section 4.2.3: under 1F1B the first stage holds p micro-batches of L/p layers, i.e.
    # L layers' activations whatever p; interleaved with m chunks per rank, (1 + (p - 1)/(p·m)) times that. The
    # estimator walks torch's own schedules (175B, t = 8, p = 8, 64 micro-batches; m = 3 chunks of 4 layers).
    from workbench.estimate.options import dtypes
    from workbench.estimate.pipeline import peak_in_flight
    from workbench.estimate.saved_gpu import stage_saved
    from workbench.estimate.stage import stage_shapes

    h, a, layers, b, t, p = KORTHIKANTI["175B"]
    model = wb.ModelConfig(dim=h, n_layers=layers, n_heads=a, ffn_dim=2 * h, vocab_size=51200, max_seq_len=2048)
    for schedule, chunks in (("1f1b", 1), ("interleaved_1f1b", 3)):
        cfg = wb.Config(model=model, tp=t, pp=p, schedule=schedule, stages_per_rank=chunks, micro_batches=64,
                        batch_size=64, precision="bf16", seq_len=2048)
        first = stage_shapes(cfg)[0]
        held = peak_in_flight(first, stage_saved(first, dtypes(cfg), Features()))
        theirs = 1 + (p - 1) / (p * chunks) if chunks > 1 else 1.0
        # 1%: the first stage's token ids, and torch's interleaved warm-up (measured 1.2883 against 1.2917).
        assert held / (layers * _block_bytes(cfg)) == pytest.approx(theirs, rel=0.01)


def test_megatron_theoretical_memory():
    # Megatron-LM, megatron/training/theoretical_memory_usage.py, restated (not run): a Llama-3-8B-shaped model
    # (GQA, SwiGLU, RMSNorm, untied embeddings), t = 4, data parallel 8, micro-batch 1, sequence 8192.
    model = wb.ModelConfig.preset("8b")
    h, f, v, layers, t, d, s, b = model.dim, model.hidden_dim, model.vocab_size, model.n_layers, 4, 8, 8192, 1
    kv = model.kv_heads * model.head_dim
    # compute_weight_and_optimizer_memory: attention 2h²(1 + groups/heads)(query projection / h), MLP 2·h·ffn·3/2
    # (SwiGLU), one weight per RMSNorm, 2·V·h untied embeddings; most-loaded shard with p = 1: everything ÷ t but
    # the norms; bytes per parameter 18 (bf16 parameter, fp32 gradient, fp32 master and two moments), or
    # 6 + 12/d with the distributed optimizer.
    attention = 2 * h * h * (1 + model.kv_heads / model.n_heads)
    per_layer = attention + 2 * h * f * 3 / 2 + 2 * h
    megatron_params = layers * per_layer + 2 * v * h + h
    assert megatron_params == model.num_params  # the one parameter count agrees with theirs
    sharded = (megatron_params - layers * 2 * h - h) / t
    replicated = layers * 2 * h + h
    for distributed, zero in ((False, 0), (True, 1)):
        bytes_per = 6 + 12 / d if distributed else 18
        theirs = (sharded + replicated) * bytes_per
        ours = sum(model_state_memory(round(sharded + replicated), d, zero, StateBytes(2, 4, 12)))
        assert ours == pytest.approx(theirs, rel=1e-6)
    # compute_activation_memory (sequence parallel; Korthikanti's Table 2): s·b·h·(18 + 4·ffn/h) per layer ÷ t.
    # Our block, term by term against theirs: their 18·sbh counts K and V as wide as Q (no GQA: 4(h - kv) more)
    # and two dropout masks (2h, absent here); their MLP term 4·ffn counts GeLU's two tensors, SwiGLU keeps four
    # (8·ffn); torch's sequence parallel keeps the two gathered projection inputs whole (4h·(1 - 1/t) more).
    cfg = wb.Config(model=model, dp=d, tp=t, zero=3, precision="bf16", mixed_precision="fsdp", seq_len=s,
                    batch_size=d * b)
    theirs = s * b * (18 * h + 4 * f) / t
    restated = theirs + s * b * (-4 * (h - kv) / t - 2 * h / t + 4 * f / t + 4 * h * (1 - 1 / t))
    assert _block_bytes(cfg) == pytest.approx(restated, rel=0.002)
