"""The estimator on the layouts torchtitan's published runs need: uneven pipeline stages, async TP, Float8 under
tensor parallel, Blackwell profiles with MXFP8 and NVFP4, ZeRO over dp·cp. Pure arithmetic, no processes."""

from __future__ import annotations

import dataclasses

import pytest

import workbench as wb
from workbench.estimate import Features, Role
from workbench.estimate.options import dtypes
from workbench.estimate.stage import chunk_shapes, stage_shapes
from workbench.hardware import B200, GB200, GB300, profile
from workbench import links

EIGHT_B = wb.ModelConfig.preset("8b")


def _tp8(**changes) -> wb.Config:
    base = wb.Config(model=EIGHT_B, dp=8, tp=8, zero=3, precision="bf16", mixed_precision="fsdp", compile=True,
                     activation_checkpointing="op", seq_len=8192, batch_size=96)
    return base.replace(**changes)


def _sequence_parallel(est: wb.Estimate) -> list:
    return [c for c in est.comm if c.role is Role.SEQUENCE_PARALLEL]


def test_async_tp_hides_the_fused_collectives_and_leaves_backwards_reduce_scatters():
    plain, fused = (wb.estimate(_tp8(async_tp=a), "h100") for a in (False, True))
    # Same bytes: async TP moves what plain TP moves, in tp chunks beside the matmuls.
    assert sum(c.bytes for c in _sequence_parallel(plain)) == sum(c.bytes for c in _sequence_parallel(fused))
    assert sum(c.exposed_s for c in _sequence_parallel(plain)) == pytest.approx(
        sum(c.time_s for c in _sequence_parallel(plain)))  # plain TP: every collective blocks
    unfused = [c for c in _sequence_parallel(fused) if "unfused" in c.what]
    assert unfused and all(c.exposed_s == pytest.approx(c.time_s) for c in unfused)
    fused_calls = [c for c in _sequence_parallel(fused) if "unfused" not in c.what]
    assert sum(c.exposed_s for c in fused_calls) < 0.2 * sum(c.time_s for c in fused_calls)
    assert fused.step_time_s < plain.step_time_s
    # The chunked matmuls cost a little more than whole ones: the compute alone is not faster.
    assert fused.compute_s >= plain.compute_s


def test_float8_under_tensor_parallel_gathers_one_byte_an_element_and_runs_at_the_fp8_rate():
    bf16, fp8 = (wb.estimate(_tp8(precision=p), "h100") for p in ("bf16", "fp8_tensorwise"))
    gathers = [next(c for c in e.comm if c.kind == "all_gather" and c.role is Role.SEQUENCE_PARALLEL)
               for e in (bf16, fp8)]
    # torchao's Float8 styles cast before they gather; the rowwise recipe keeps torch's styles (bf16 gathers).
    assert gathers[1].bytes < 0.6 * gathers[0].bytes
    rowwise = wb.estimate(_tp8(precision="fp8_rowwise"), "h100")
    assert next(c for c in rowwise.comm if c.kind == "all_gather" and c.role is Role.SEQUENCE_PARALLEL).bytes \
        == gathers[0].bytes
    assert dict(fp8.critical_stage.compute_split)["gemm"] < 0.75 * dict(bf16.critical_stage.compute_split)["gemm"]


def test_fp8_all_gather_is_the_configs_choice():
    cfg = wb.Config(model=EIGHT_B, dp=8, zero=3, precision="fp8_tensorwise", mixed_precision="fsdp", seq_len=8192,
                    batch_size=16)
    assert dtypes(cfg).gathered == 1 and dtypes(cfg.replace(fp8_all_gather=False)).gathered == 2
    on, off = (wb.estimate(c, "h100") for c in (cfg, cfg.replace(fp8_all_gather=False)))
    gather = lambda e: next(c for c in e.comm if c.role is Role.PARAMETER_GATHER).bytes  # noqa: E731
    # Only the blocks' Float8 weights travel in fp8: the embedding, final norm and head (the root, R elements,
    # gathered once a step) are no Float8 linears and travel in bf16 either way, the blocks (P − R) twice a step.
    st = stage_shapes(cfg)[0]
    assert dtypes(cfg).gathered_root == 2
    assert gather(off) - gather(on) == pytest.approx(2 * (st.params - st.root) * (2 - 1), rel=1e-9)
    assert gather(on) == pytest.approx(2 * (st.params - st.root) + 2 * st.root, rel=1e-9)
    # Held: two blocks gathered (bf16 or fp8) beside the root in bf16 at the peak.
    assert off.memory.allocated - on.memory.allocated == 2 * st.block_params * (2 - 1)


def test_uneven_stages_give_each_rank_its_own_blocks_and_the_schedule_its_own_times():
    model = dataclasses.replace(EIGHT_B, n_layers=30)
    cfg = wb.Config(model=model, dp=2, pp=4, zero=2, precision="bf16", mixed_precision="fsdp", micro_batches=8,
                    batch_size=16, seq_len=4096, stage_layers=wb.lighter_ends(30, 4))
    assert cfg.stage_layers == (7, 8, 8, 7)
    shapes = stage_shapes(cfg)
    assert [len(s.layers) for s in shapes] == [7, 8, 8, 7]
    assert shapes[0].layers == tuple(range(7)) and shapes[3].layers == tuple(range(23, 30))
    est = wb.estimate(cfg, "h100")
    # The middle ranks hold more blocks (more matmuls); the ends hold the embedding or the head besides.
    gemm = [dict(s.compute_split)["gemm"] for s in est.stages]
    assert gemm[1] == pytest.approx(gemm[2]) and gemm[1] > gemm[0] and gemm[1] == pytest.approx(8 / 7 * gemm[0])
    # Interleaved: each chunk its own shape, in the rank's stage order.
    looped = cfg.replace(schedule="interleaved_1f1b", stages_per_rank=2, stage_layers=wb.lighter_ends(30, 8))
    chunks = chunk_shapes(stage_shapes(looped)[0])
    assert [c.stages for c in chunks] == [(0,), (4,)]
    assert [len(c.layers) for c in chunks] == [looped.stage_layers[0], looped.stage_layers[4]]
    assert chunks[0].first and not chunks[1].first
    # The schedule run in time with its hops: a heavier middle slows the step against an even split would.
    even = cfg.replace(model=dataclasses.replace(model, n_layers=32), stage_layers=())
    assert wb.estimate(even, "h100").compute_s > est.compute_s


def test_blackwell_profiles_are_their_datasheets_and_mxfp8_and_nvfp4_are_theirs_only():
    assert (B200.peak("bf16"), B200.peak("fp8"), B200.peak("mxfp8"), B200.peak("nvfp4")) == (2.25e15, 4.5e15,
                                                                                             4.5e15, 9e15)
    assert (GB200.peak("bf16"), GB300.peak("nvfp4"), GB300.memory_bytes) == (2.5e15, 15e15, 279e9)
    assert GB200.gpus_per_node == GB300.gpus_per_node == 72  # one NVLink domain per NVL72 rack
    assert links.preset(GB200.cluster, nodes=2).gpus_per_node == 72
    limited = profile("b200@750w")
    assert limited.power_limit_w == 750 and limited.power_scale == pytest.approx(0.75)
    with pytest.raises(ValueError, match="a power limit is @<watts>w"):
        profile("b200@2000w")
    cfg = wb.Config(model=EIGHT_B, dp=8, zero=3, precision="mxfp8", mixed_precision="fsdp", seq_len=8192,
                    batch_size=8, activation_checkpointing="op", compile=True)
    mx, bf16 = (wb.estimate(c, "b200") for c in (cfg, cfg.replace(precision="bf16")))
    assert mx.step_time_s < bf16.step_time_s
    with pytest.raises(ValueError, match="h200 has no mxfp8 peak"):
        wb.estimate(cfg, "h200")
    # NVFP4 (an estimator option): the first 85% of the blocks at the FP4 rate, the rest and the head in bf16.
    fp4 = wb.estimate(cfg.replace(precision="bf16"), "b200", features=Features(nvfp4=0.85))
    assert fp4.step_time_s < bf16.step_time_s
    with pytest.raises(ValueError, match="only Blackwell multiplies; h100 has no nvfp4 rate"):
        wb.estimate(cfg.replace(precision="bf16"), "h100", features=Features(nvfp4=0.85))
    with pytest.raises(ValueError, match="share of the blocks"):
        Features(nvfp4=1.5)


def test_an_op_policy_that_does_not_keep_attention_recomputes_its_forward_and_keeps_none_of_it():
    # torchtitan 6fc499f on Blackwell calls SDPA's cuDNN kernel, which its per-op save list does not name: backward
    # runs attention's forward again (flash attention's backward is 2.5 forwards: 3.5 → 4.5) and the block keeps
    # neither its output (a·D bytes a token, bf16) nor its log-sum-exp (4 bytes a head), on every block.
    cfg = wb.Config(model=EIGHT_B, dp=8, zero=3, precision="bf16", mixed_precision="fsdp", compile=True,
                    activation_checkpointing="op", seq_len=8192, batch_size=8)
    kept, recomputed = (wb.estimate(cfg, "b200", features=Features(op_keeps_attention=k)) for k in (True, False))
    attention = [dict(e.stages[0].compute_split)["attention"] for e in (kept, recomputed)]
    assert attention[1] / attention[0] == pytest.approx(4.5 / 3.5)
    tokens = 8192  # one sequence per dp rank
    per_block = tokens * (2 * EIGHT_B.dim + 4 * EIGHT_B.n_heads)
    assert kept.memory.activations - recomputed.memory.activations == EIGHT_B.n_layers * per_block
    assert recomputed.step_time_s > kept.step_time_s
    assert "op_recomputes_attention" in str(recomputed)
    # Policies that keep every activation, or only the block's input, are untouched by it.
    for mode in ("none", "full"):
        plain = cfg.replace(activation_checkpointing=mode)
        a, b = (wb.estimate(plain, "b200", features=Features(op_keeps_attention=k)) for k in (True, False))
        assert a.step_time_s == b.step_time_s and a.memory.activations == b.memory.activations


def test_rowwise_backward_reads_and_writes_every_gemm_output_again_as_torchao_rescales_it():
    # torchao runs backward's rowwise GEMMs as tensorwise cuBLAS ones and scales their outputs after
    # (low_precision.py): one more read and write of each input gradient and weight gradient. Their elements,
    # counted by the estimator, against the gradients a real block's backward produces.
    import torch

    from workbench.estimate.low_precision import _rescaled_outputs, converted_linears
    from workbench.models.transformer import Block, rotary_table
    from workbench.tracing.estimate import traced_profile

    m = wb.ModelConfig.preset("tiny")
    st = stage_shapes(wb.Config(model=m, precision="fp8_rowwise", seq_len=64, batch_size=2))[0]
    block = Block(m)
    linears = [mod for mod in block.modules() if isinstance(mod, torch.nn.Linear)]
    input_gradients = []
    for linear in linears:
        linear.register_full_backward_hook(lambda mod, grad_in, grad_out: input_gradients.append(grad_in[0].numel()))
    x = torch.randn(2, 64, m.dim, requires_grad=True)
    block(x, rotary_table(m.head_dim, 64, m.rope_theta)).sum().backward()
    assert len(input_gradients) == len(linears) == 7
    measured = sum(input_gradients) + sum(linear.weight.grad.numel() for linear in linears)
    assert _rescaled_outputs(st, converted_linears(st)) * st.tokens == measured
    # A traced model's linears give the same count, whole and under tensor parallel.
    gemms = traced_profile(m, 64, "fp32").kinds[0].gemms
    for tp in (1, 2):
        sharded = stage_shapes(wb.Config(model=m, precision="fp8_rowwise", seq_len=64, batch_size=2, tp=tp))[0]
        assert _rescaled_outputs(sharded, [(g.count, *g.fans(tp)) for g in gemms]) == pytest.approx(
            _rescaled_outputs(sharded, converted_linears(sharded)))


@pytest.mark.parametrize(("shared_expert", "precision", "ffn_dim"),
                         [(True, "fp8_tensorwise", None), (False, "fp8_tensorwise", None),
                          # 336 is a multiple of 16, not of 32: Float8 converts the FFN, MX keeps it in bf16.
                          (True, "fp8_tensorwise", 336), (True, "mxfp8", 336), (False, "mxfp8", 336)])
def test_the_linears_the_estimator_runs_in_low_precision_are_those_the_engine_converts(shared_expert, precision,
                                                                                      ffn_dim):
    # engine/parallel/float8.py converts every nn.Linear but the head and a mixture of experts' router and routed
    # experts, whose dims are multiples of 16 (32 for MX); the estimator's casts (and the shared expert's GEMMs)
    # follow the same list, block by block.
    import torch

    from workbench.engine.parallel.float8 import converts
    from workbench.estimate.low_precision import cast_bytes, converted_linears
    from workbench.models.transformer import Transformer

    model = dataclasses.replace(wb.ModelConfig.preset("tiny"), n_layers=2, n_experts=4, moe_every=2,
                                shared_expert=shared_expert, ffn_dim=ffn_dim)
    with torch.device("meta"):
        built = Transformer(model)
    experts = built.routed_experts()
    cfg = wb.Config(model=model, precision=precision, seq_len=64, batch_size=2)
    st = stage_shapes(cfg)[0]
    recipe = dtypes(cfg).recipe
    for layer in range(model.n_layers):
        engine = sorted((mod.in_features, mod.out_features) for fqn, mod in built.named_modules()
                        if fqn.startswith(f"layers.{layer}.") and converts(mod, fqn, "output", experts, recipe))
        estimated = sorted((fan_in, fan_out) for n, fan_in, fan_out
                           in converted_linears(st, model.is_moe_layer(layer), recipe) for _ in range(n))
        assert estimated == engine, f"block {layer}"
    # The built-in formula of the casts agrees with the list, linear by linear, where no input is shared (eager).
    dt = dtypes(wb.Config(model=model, precision="fp8_rowwise", seq_len=64, batch_size=2))
    for moe in (False, True):
        assert cast_bytes(st, dt, "rowwise", moe=moe) == pytest.approx(
            cast_bytes(st, dt, "rowwise", converted_linears(st, moe, "rowwise")))


def test_a_model_whose_linears_the_engine_keeps_out_of_low_precision_is_priced_in_bf16():
    # Dims that are not multiples of 16 (engine/parallel/float8.py): every linear stays in bf16, so a Float8 run
    # multiplies as the bf16 one does and casts nothing.
    model = dataclasses.replace(wb.ModelConfig.preset("tiny"), dim=72, ffn_dim=200)
    cfg = wb.Config(model=model, dp=2, zero=3, precision="bf16", mixed_precision="fsdp", seq_len=1024,
                    batch_size=16, compile=True)
    bf16, fp8 = (dict(wb.estimate(c, "h100").stages[0].compute_split)
                 for c in (cfg, cfg.replace(precision="fp8_tensorwise")))
    assert fp8["gemm"] == bf16["gemm"] and fp8["memory-bound"] == bf16["memory-bound"]
    converted = dict(wb.estimate(cfg.replace(model=dataclasses.replace(model, dim=64, ffn_dim=192),
                                             precision="fp8_tensorwise"), "h100").stages[0].compute_split)
    wider = dict(wb.estimate(cfg.replace(model=dataclasses.replace(model, dim=64, ffn_dim=192)), "h100")
                 .stages[0].compute_split)
    assert converted["memory-bound"] > wider["memory-bound"]  # where it converts, its casts are priced



@pytest.mark.parametrize("precision", ["fp8_tensorwise", "fp8_rowwise", "mxfp8"])
def test_a_block_of_8_bit_linears_saves_what_its_bf16_self_saves(precision):
    # torchao's Float8 and MX linears save their bf16 input and weight and cast again in backward
    # (`save_for_backward(input_hp, weight_hp...)` in torchao >= 0.13, which the engine installs): no fp8 copies.
    from workbench.estimate.saved_gpu import layer_saved

    moe = wb.ModelConfig.preset("tiny-moe")
    for model in (dataclasses.replace(moe, n_experts=0), moe, dataclasses.replace(moe, shared_expert=True)):
        cfg = wb.Config(model=model, dp=2, zero=3, precision="bf16", mixed_precision="fsdp", seq_len=256,
                        batch_size=4, compile=True)
        bf16, low = (layer_saved(stage_shapes(c)[0], dtypes(c), Features(), 0)
                     for c in (cfg, cfg.replace(precision=precision)))
        assert dtypes(cfg.replace(precision=precision)).float8 and low == bf16, model


def test_a_chunked_loss_holds_one_chunks_logits_and_leaves_the_blocks_an_fp32_gradient():
    # torchtitan's ChunkedLossWrapper (2026): head and loss over 1/8 of the tokens at a time, each chunk's backward
    # at once; what it leaves for the blocks' backward is GradAccumulator's fp32 gradient of the hidden states, not
    # the head's input (a·D) and the loss's fp32 log-probabilities (4·V).
    from workbench.estimate.saved_gpu import loss_transients
    cfg = wb.Config(model=EIGHT_B, dp=4, zero=3, precision="bf16", mixed_precision="fsdp", compile=True,
                    activation_checkpointing="op", seq_len=2048, batch_size=16)
    whole, chunked = Features(), Features(loss_chunks=8)
    tokens, d, v = 4 * 2048, EIGHT_B.dim, EIGHT_B.vocab_size
    a, b = (wb.estimate(cfg, "h200", features=f) for f in (whole, chunked))
    assert a.memory.activations - b.memory.activations == tokens * (2 * d + 4 * v - 4 * d)
    last = stage_shapes(cfg)[-1]
    (fwd, bwd), (c_fwd, c_bwd) = (loss_transients(last, dtypes(cfg, f), f) for f in (whole, chunked))
    chunk = tokens // 8
    # bf16 logits and their fp32 copy forward, two fp32 gradients backward: one chunk's, beside the hidden states
    # and their chunked copy, and the chunk's head input and log-probabilities.
    assert (fwd, bwd) == (tokens * 6 * v, tokens * 8 * v)
    held = 2 * tokens * 2 * d + chunk * (2 * d + 4 * v)
    assert (c_fwd, c_bwd) == (held + chunk * 6 * v, held + chunk * 8 * v)
    assert b.memory.allocated < a.memory.allocated and b.step_time_s == a.step_time_s
    assert "loss in 8 chunks" in str(b)
    with pytest.raises(ValueError, match="loss_chunks is a number of chunks"):
        Features(loss_chunks=-1)


def test_the_caching_allocator_reserves_no_more_than_the_device():
    # A peak whose tensors fit: the allocator frees its unused cached blocks and retries rather than fail, so it
    # reserves at most the device; one whose tensors do not fit is priced as the model prices it.
    from workbench.estimate.allocator import FRAGMENTATION, reserved
    assert reserved(85, None) == round(85 / (1 - FRAGMENTATION)) == 100
    assert reserved(85, 95) == 95 and reserved(85, 120) == 100 and reserved(96, 95) == round(96 / 0.85)
    # torchtitan's GB200 bf16 run reserved 174.49 GiB of the 184.31 a GB200 reports: it fits, at the device.
    cfg = wb.Config(model=EIGHT_B, dp=4, zero=3, precision="bf16", mixed_precision="fsdp", compile=True,
                    activation_checkpointing="op", seq_len=2048, batch_size=128)
    est = wb.estimate(cfg, "gb200", features=Features(loss_chunks=8))
    assert est.memory.allocated < est.memory.reserved == GB200.memory_bytes - est.memory.runtime
    # It fits, tight: not beside the fragments the model prices, so a plan ranks it after any layout with room.
    assert est.fits and est.tight and "fits, tight" in str(est)
    roomy = wb.estimate(cfg.replace(batch_size=64), "gb200", features=Features(loss_chunks=8))
    assert roomy.fits and not roomy.tight and roomy.memory.reserved < roomy.hardware.memory_bytes
    assert GB200.memory_bytes == round(184.31 * 2**30) and GB200.gemm_efficiency == B200.gemm_efficiency


def test_fused_qkv_keeps_one_projection_output_and_recomputes_wo_and_w3_only():
    # torchtitan's wqkv (2026): the per-op policy's alternation over wqkv, wo, w1, w3, w2 keeps wqkv's whole output
    # (q and both k and v: one kv width more than wq's and wv's) and recomputes wo and w3 (not wk): backward runs
    # K·D fewer multiply-adds a token.
    cfg = wb.Config(model=EIGHT_B, dp=8, zero=3, precision="bf16", mixed_precision="fsdp", compile=True,
                    activation_checkpointing="op", seq_len=8192, batch_size=8)
    apart, fused = (wb.estimate(cfg, "h100", features=Features(fused_qkv=f)) for f in (False, True))
    kv = EIGHT_B.kv_heads * EIGHT_B.head_dim
    assert fused.memory.activations - apart.memory.activations == EIGHT_B.n_layers * 8192 * 2 * kv
    executed = [e.stages[0].flops for e in (apart, fused)]
    assert executed[0] - executed[1] == pytest.approx(EIGHT_B.n_layers * 8192 * 2 * EIGHT_B.dim * kv, rel=1e-9)
    assert dict(fused.stages[0].compute_split)["gemm"] < dict(apart.stages[0].compute_split)["gemm"]
    assert "fused qkv" in str(fused)
    with pytest.raises(ValueError, match="fused_qkv fuses the built-in block"):
        from workbench.estimate import estimate as estimate_from
        from workbench.tracing.estimate import traced_profile
        estimate_from(cfg, "h100", features=Features(fused_qkv=True),
                      traced=traced_profile(EIGHT_B, 8192, "bf16_params"))


def test_an_8bit_head_multiplies_at_the_formats_rate_and_casts_its_input_and_the_logits_gradient():
    # torchtitan's MXFP8 converter, given no module names, converts every Linear.Config, the LM head's included
    # (llama3_8b_mxfp8, 2026): the head's three GEMMs at the MXFP8 rate (1-byte operands) instead of bf16, and its
    # input (D a token) and the logits' gradient (V) each cast once along its rows and once along the tokens, a
    # + 1 bytes and a scale byte per 32 elements each pass.
    from workbench.estimate.kernels import linear_time, memory_time
    from workbench.estimate.step_gpu import micro_batch_compute

    cfg = wb.Config(model=EIGHT_B, dp=4, zero=3, precision="mxfp8", mixed_precision="fsdp", compile=True,
                    activation_checkpointing="op", seq_len=2048, batch_size=128)
    st = stage_shapes(cfg)[0]
    dt = dtypes(cfg, Features())
    bf16_head, mx_head = (micro_batch_compute(st, dt, Features(low_precision_head=h), GB200) for h in (False, True))
    t, d, v = st.tokens, EIGHT_B.dim, EIGHT_B.vocab_size
    assert bf16_head.gemm - mx_head.gemm == pytest.approx(
        linear_time(GB200, "bf16", t, d, v, 2) - linear_time(GB200, "mxfp8", t, d, v, 1), rel=1e-9)
    assert mx_head.memory_bound - bf16_head.memory_bound == pytest.approx(
        memory_time(GB200, t * 2 * (d + v) * (2 + 1 + 1 / 32)), rel=1e-9)
    faster = wb.estimate(cfg, "gb200", features=Features(low_precision_head=True))
    assert faster.step_time_s < wb.estimate(cfg, "gb200").step_time_s and "8-bit head" in str(faster)
    with pytest.raises(ValueError, match="low_precision_head runs the head in the Config's 8-bit format"):
        wb.estimate(cfg.replace(precision="bf16"), "gb200", features=Features(low_precision_head=True))


def test_fsdp_edge_units_free_the_embeddings_copy_during_backward_and_gather_it_twice():
    # torchtitan from July 2025 shards the embedding and [norm, head] as FSDP units of their own. Counted from the
    # tensors' sizes (bf16 gathers, fp32 reduce-scatter inputs; E = H = V·D, the norm D, a block B):
    # - to the loss: the embedding is not held gathered (the root kept it);
    # - through the blocks' backward: neither is the head's unit, resharded after its backward, which leaves its
    #   fp32 reduce-scatter input (4·(H + D)) where the root held the head's bf16 gradient (2·H) and itself;
    # - at backward's end: the embedding gathered again with its gradient (bf16 and fp32) and the first block's
    #   reduce-scatter input, where the root held all three with theirs.
    from workbench.estimate.timeline import gpu_memory

    cfg = wb.Config(model=EIGHT_B, dp=8, zero=3, precision="bf16", mixed_precision="fsdp", compile=True,
                    activation_checkpointing="op", seq_len=8192, batch_size=8)
    st = stage_shapes(cfg)[0]
    root, edges = (gpu_memory(st, dtypes(cfg, Features()), Features(compile_loss=True, fsdp_edge_units=e)).moments
                   for e in (False, True))
    d, v, b = EIGHT_B.dim, EIGHT_B.vocab_size, st.block_params
    e = h = v * d
    assert root.loss_backward - edges.loss_backward == 2 * e
    assert root.first_block_backward - edges.first_block_backward == 2 * e + 2 * (h + d) + 2 * h - 4 * (h + d)
    assert root.backward_end - edges.backward_end == (2 * (e + h + d + 2 * b) + 6 * (e + h + d)) - (
        2 * e + 6 * e + 4 * b)
    assert root.optimizer_step == edges.optimizer_step
    # Under a pipeline each end keeps its own: the first stage stops holding the embedding, the last the head's
    # bf16 gradient and gathered copy, for its fp32 reduce-scatter input.
    piped = cfg.replace(dp=4, pp=2, micro_batches=2)
    first, last = ([gpu_memory(s, dtypes(piped, Features()), Features(compile_loss=True, fsdp_edge_units=x)).moments
                    for x in (False, True)] for s in stage_shapes(piped))
    assert first[0].first_block_backward - first[1].first_block_backward == 2 * e
    assert last[0].first_block_backward - last[1].first_block_backward == 2 * (h + d) + 2 * h - 4 * (h + d)
    assert last[0].loss_backward == last[1].loss_backward
    # Gathers: the root once a step, every block twice; apart, the embedding twice and the head's unit once.
    ests = {x: wb.estimate(cfg, "b200", features=Features(compile_loss=True, fsdp_edge_units=x)) for x in (0, 1)}
    gathers = {x: next(c for c in est.comm if c.role is Role.PARAMETER_GATHER) for x, est in ests.items()}
    assert (gathers[0].calls, gathers[1].calls) == (2 * EIGHT_B.n_layers + 1, 2 * EIGHT_B.n_layers + 3)
    assert gathers[1].bytes - gathers[0].bytes == pytest.approx(2 * e, rel=1e-6)
    assert ests[0].memory.reserved > ests[1].memory.reserved and "FSDP edge units" in str(ests[1])
    # DDP and replicate have no such units: nothing moves, neither memory nor the all-reduces (one per block
    # and the root under tp).
    for ddp in (cfg.replace(zero=0, mixed_precision="autocast"), cfg.replace(zero=0, mixed_precision="autocast",
                                                                            dp=4, tp=2)):
        on, off = (wb.estimate(ddp, "b200", features=Features(fsdp_edge_units=x)) for x in (True, False))
        assert on.memory == off.memory and on.comm == off.comm


def test_an_nvfp4_block_under_the_op_policy_keeps_its_input_and_attention_and_recomputes_all_but_w2():
    # torchao's NVFP4 linear multiplies with aten._scaled_mm_v2, which the per-op policy's save list does not name
    # (torch's compute-intensive ops: aten.mm, aten._scaled_mm), and compile recomputes what the policy does not
    # save: such a block keeps its input (bf16, D) and attention's output and log-sum-exp, and backward runs wq, wk,
    # wv, wo, w1 and w3 again (w2's output only joins the residual sum).
    from torch._functorch.partitioners import get_default_op_list
    import torch
    saved = get_default_op_list().compute_intensive_ops
    assert torch.ops.aten._scaled_mm in saved and torch.ops.aten._scaled_mm_v2 not in saved
    cfg = wb.Config(model=EIGHT_B, dp=4, zero=3, precision="bf16", mixed_precision="fsdp", compile=True,
                    activation_checkpointing="op", seq_len=2048, batch_size=16)
    bf16, fp4 = (wb.estimate(cfg, "b200", features=Features(nvfp4=n)) for n in (0.0, 1.0))
    tokens, d, kv, f = 4 * 2048, EIGHT_B.dim, EIGHT_B.kv_heads * EIGHT_B.head_dim, EIGHT_B.hidden_dim
    # bf16 keeps wq's, wv's, w1's and w2's outputs beside those; NVFP4 none of them.
    assert bf16.memory.activations - fp4.memory.activations == EIGHT_B.n_layers * tokens * 2 * (2 * d + kv + f)
    # Executed: wq, wv, w1 again beside wk, wo, w3 (2 FLOPs a weight a token).
    again = d * d + d * kv + d * f
    assert fp4.stages[0].flops - bf16.stages[0].flops == pytest.approx(EIGHT_B.n_layers * tokens * 2 * again,
                                                                       rel=1e-9)
    assert "nvfp4 100% of blocks" in str(fp4)


def test_nvfp4_casts_take_torchaos_measured_kernel_times():
    # pytorch/ao PR 4369 timed its Triton kernels on a GB200 at four shapes; two make each line, the other two
    # (the 70B's) lie on it within 6%; a linear's forward runs an amax and a quantize on its input and quantizes
    # its weight, its backward an amax and a stochastic-rounding quantize on its output gradient.
    from workbench.estimate.low_precision import (NVFP4_AMAX, NVFP4_QUANTIZE, NVFP4_QUANTIZE_SR, NVFP4_WEIGHT,
                                                  nvfp4_cast_time)
    measured = {NVFP4_AMAX: (25.600, 46.048), NVFP4_QUANTIZE: (43.776, 117.296),
                NVFP4_QUANTIZE_SR: (60.128, 166.624), NVFP4_WEIGHT: (78.304, 232.160)}
    for (fixed, each), times in measured.items():
        for elements, us in zip((2048 * 8192, 2048 * 28672), times):
            assert (fixed + each * elements) * 1e6 == pytest.approx(us, rel=0.07)
    # w1 of the 8B over 2048 tokens: its input is the hidden-state shape, its weight the 70B mlp.down input's size,
    # its output gradient the 8B mlp.down input's shape.
    forward, backward = nvfp4_cast_time([(1, 4096, 14336)], 2048)
    assert forward * 1e6 == pytest.approx(19.488 + 31.072 + 232.160, rel=0.025)
    assert backward * 1e6 == pytest.approx(31.744 + 91.168, rel=1e-6)
