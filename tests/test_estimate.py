"""The estimator against hand-computed figures and against the real model (parameters, saved activations, FLOPs)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from workbench import links
from workbench.config import Config, ModelConfig
from workbench.models.transformer import build_model, loss_fn
from workbench.estimate import ASSUMPTIONS, GPU_ASSUMPTIONS, Estimate, Role, estimate, flops_per_token
from workbench.hardware import H100, cpu_with_peak

TINY = ModelConfig.preset("tiny")
EIGHT_B = ModelConfig.preset("8b")


def _forward_backward(model, tokens):
    loss_fn(model(tokens[:, :-1].contiguous()), tokens[:, 1:]).backward()


# --- FLOPs ---------------------------------------------------------------------------------------------------


def _counted_flops(cfg: ModelConfig, batch: int, seq: int, backend: SDPBackend | None) -> float:
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(backend) if backend is not None else torch.enable_grad(), counter:
        _forward_backward(model, tokens)
    return counter.get_total_flops() / (batch * seq)


@pytest.mark.parametrize("seq", [128, 256])
def test_flops_per_token_agrees_with_flop_counter(seq):
    # The math backend runs attention as matmuls the counter sees; tiny's attention is 14% of its FLOPs at 128.
    counted = _counted_flops(TINY, batch=2, seq=seq, backend=SDPBackend.MATH)
    predicted = flops_per_token(TINY, seq)
    assert abs(predicted - counted) / counted < 0.05
    assert predicted == counted  # in fact exact: 5,701,632 FLOP/token at seq 128


def test_matmul_flops_agree_with_flop_counter_on_the_default_cpu_kernels():
    # CPU's fused attention kernel has no FlopCounterMode formula, so only the weight matmuls are counted there.
    counted = _counted_flops(TINY, batch=2, seq=128, backend=None)
    attention = 12 * TINY.n_layers * 128 * TINY.dim
    assert counted == flops_per_token(TINY, 128) - attention


def test_flops_per_token_by_hand():
    # tiny: per block wq,wo 128·128, wk,wv 128·64, w1,w2,w3 128·384; head 128·256.
    matmul = 4 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384) + 128 * 256
    assert flops_per_token(TINY, 128) == 6 * matmul + 12 * 4 * 128 * 128
    cfg = Config(batch_size=8, seq_len=64)
    assert estimate(cfg).model_flops == flops_per_token(TINY, 64) * 8 * 64


# --- parameters and the ZeRO / TP / PP splits -----------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_parameter_bytes_are_the_real_models(preset):
    model_cfg = ModelConfig.preset(preset)
    numel = sum(p.numel() for p in build_model(model_cfg, seed=0).parameters())
    mem = estimate(Config(model=model_cfg)).memory
    assert mem.parameters == mem.gradients == 4 * numel
    assert mem.optimizer == 8 * numel
    assert mem.buffers == 0


def test_zero_stages_shrink_per_rank_bytes_by_dp():
    base = Config(dp=4, batch_size=16)
    ddp, z1, z2, z3 = (estimate(base.replace(zero=z), "cpu").memory for z in range(4))
    numel = TINY.num_params
    assert (ddp.parameters, ddp.gradients, ddp.optimizer) == (4 * numel, 4 * numel, 8 * numel)
    assert (z1.parameters, z1.gradients, z1.optimizer) == (4 * numel, 4 * numel, 8 * numel // 4)
    assert (z2.parameters, z2.gradients, z2.optimizer) == (4 * numel, 4 * numel // 4, 8 * numel // 4)
    assert (z3.parameters, z3.gradients, z3.optimizer) == (4 * numel // 4, 4 * numel // 4, 8 * numel // 4)
    # DDP's buckets copy the gradients. ZeRO-2 holds every parameter gathered, ZeRO-3 the root unit (embedding,
    # final norm, head) and two blocks; both hold the largest unit's full gradient until it is reduce-scattered.
    root = 2 * 256 * 128 + 128
    block = (numel - root) // TINY.n_layers
    assert block > root
    assert ddp.buffers == z1.buffers == 4 * numel
    assert z2.buffers == 4 * numel + 4 * block
    assert z3.buffers == 4 * (root + 2 * block) + 4 * block
    assert z3.total < z2.total < z1.total < ddp.total


def test_tensor_parallel_splits_the_weight_matrices_not_the_norms():
    model = build_model(TINY, seed=0)
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    norms = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    for tp in (1, 2):
        stage = estimate(Config(tp=tp)).stages[0]
        assert stage.params == matrices // tp + norms


def test_pipeline_stages_hold_their_layers_embedding_first_head_last():
    model = build_model(TINY, seed=0)

    def numel(prefixes):
        return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefixes))

    est = estimate(Config(pp=2, micro_batches=2))
    first, last = est.stages
    assert first.layers == (0, 1) and last.layers == (2, 3)
    assert first.params == numel(("tok_embeddings", "layers.0.", "layers.1."))
    assert last.params == numel(("layers.2.", "layers.3.", "norm", "output"))
    assert est.peak_stage.memory.total == max(first.memory.total, last.memory.total)
    interleaved = estimate(Config(model=dataclasses.replace(TINY, n_layers=8), pp=2, micro_batches=2,
                                  schedule="interleaved_1f1b"))
    assert [s.layers for s in interleaved.stages] == [(0, 1, 4, 5), (2, 3, 6, 7)]


# --- activations ------------------------------------------------------------------------------------------------


def _saved_bytes(model, tokens, precision: str) -> int:
    """Bytes of the distinct storages autograd saves for backward, parameters and buffers excluded."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        loss_fn(model(tokens[:, :-1].contiguous()), tokens[:, 1:])
    return sum(saved.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_formula_matches_the_tensors_autograd_saves(precision):
    cfg = Config(batch_size=4, seq_len=256, precision=precision)
    tokens = torch.randint(0, 256, (4, 257), generator=torch.Generator().manual_seed(0))
    measured = _saved_bytes(build_model(TINY, seed=0), tokens, precision)
    predicted = estimate(cfg, "cpu").memory.activations
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)


def test_checkpointing_keeps_block_inputs_and_rebuilds_one_block():
    none, selective, full = (estimate(Config(batch_size=4, seq_len=256, activation_checkpointing=ac), "cpu").memory
                             for ac in ("none", "selective", "full"))
    tokens, d, kv_dim, hidden, vocab = 4 * 256, TINY.dim, TINY.kv_heads * TINY.head_dim, TINY.hidden_dim, 256
    # Bytes per token, fp32: norms 16d + 8, projection inputs 8d, attention 4(2d + 2kv_dim) + 4·heads, MLP 16·hidden.
    block = tokens * (16 * d + 8 + 8 * d + 4 * (2 * d + 2 * kv_dim) + 4 * TINY.n_heads + 16 * hidden)
    # Token ids; final norm 8d + 4, head input 4d, log-probs 4·vocab, targets 8.
    edges = tokens * (8 + 8 * d + 4 + 4 * d + 4 * vocab + 8)
    block_input = 4 * tokens * d
    assert none.activations == 4 * block + edges
    # 'selective' recomputes blocks 0 and 2, 'full' all four; either rebuilds one block at a time in backward, a
    # transient of backward beside the logits, not something forward saved.
    assert selective.activations == 2 * block + 2 * block_input + edges
    assert full.activations == 4 * block_input + edges
    logits = 4 * tokens * vocab
    assert none.other == logits and selective.other == full.other == logits + block


def test_pipeline_schedules_hold_their_in_flight_micro_batches():
    base = Config(pp=2, micro_batches=8, batch_size=16)
    gpipe, one_f_one_b = estimate(base.replace(schedule="gpipe"), "cpu"), estimate(base, "cpu")
    # GPipe keeps all 8 micro-batches on both stages; 1F1B keeps pp - stage of them.
    ratio = gpipe.stages[0].memory.activations / one_f_one_b.stages[0].memory.activations
    assert ratio == pytest.approx(8 / 2, rel=1e-6)
    assert gpipe.stages[1].memory.activations / one_f_one_b.stages[1].memory.activations == pytest.approx(8)


# --- communication ----------------------------------------------------------------------------------------------


def _by_kind(est: Estimate, axis: str, kind: str):
    (found,) = [c for c in est.comm if c.axis == axis and c.kind == kind]
    return found


def test_ddp_all_reduces_the_gradients_once_per_step():
    est = estimate(Config(dp=4, batch_size=16, micro_batches=2), hardware=H100)
    ar = _by_kind(est, "dp", "all_reduce")
    grads = 4 * TINY.num_params
    assert ar.bytes == grads and ar.wire_bytes == round(2 * 3 / 4 * grads)
    # Priced by the one link model: each bucket's all-reduce among 4 GPUs of one NVLink node.
    node = links.preset("h100-ib", nodes=1, gpus_per_node=4)
    assert ar.time_s == pytest.approx(ar.calls * links.collective_time("all_reduce", grads / ar.calls, range(4), node))
    assert [c.kind for c in est.comm] == ["all_reduce"]


def test_zero_collectives():
    grads = 4 * TINY.num_params
    z1 = estimate(Config(dp=2, zero=1))
    # Between two ranks every broadcast byte crosses the one link (nccl-tests: busbw = algbw for broadcast).
    assert _by_kind(z1, "dp", "broadcast").bytes == _by_kind(z1, "dp", "broadcast").wire_bytes == grads
    assert _by_kind(z1, "dp", "broadcast").exposed_s == _by_kind(z1, "dp", "broadcast").time_s
    z3 = estimate(Config(dp=2, zero=3, micro_batches=2, batch_size=16))
    gather, scatter = _by_kind(z3, "dp", "all_gather"), _by_kind(z3, "dp", "reduce_scatter")
    root = 4 * (2 * 256 * 128 + 128)
    # Every micro-batch gathers all units for forward and the blocks again for backward, each rank receiving half;
    # the payload is the gathered output, as nccl-tests and the telemetry count it.
    assert gather.bytes == 2 * (2 * grads - root)
    assert gather.wire_bytes == round(2 * (2 * grads - root) / 2)
    assert gather.calls == 2 * (2 * 5 - 1)
    assert scatter.wire_bytes == round(2 * grads / 2) and scatter.calls == 2 * 5


def test_tensor_parallel_collectives_per_block():
    cfg = Config(tp=2, batch_size=4, seq_len=64)
    est = estimate(cfg)
    act = 4 * 64 * TINY.dim  # elements of one (micro-batch, seq, dim) activation
    layers = TINY.n_layers
    gather = _by_kind_what(est, "all_gather", "sequence-parallel activations")
    # Forward gathers 2 fp32 norm outputs per block, backward 2 fp32 gradients of reduce-scattered outputs;
    # plus the head's input (forward) and the embedding's output gradient (backward), each on the wire 1/2.
    assert gather.wire_bytes == round((layers * 2 * (4 + 4) + 2 * 4) * act / 2)
    logits = _by_kind_what(est, "all_gather", "logits for the loss")
    assert logits.wire_bytes == round(4 * 64 * 256 * 4 / 2)
    assert all(c.exposed_s == c.time_s for c in est.comm if c.axis == "tp")


def _by_kind_what(est: Estimate, kind: str, what: str):
    (found,) = [c for c in est.comm if c.kind == kind and c.what == what]
    return found


def test_pipeline_sends_activations_each_micro_batch():
    est = estimate(Config(pp=2, micro_batches=4, batch_size=8, seq_len=32))
    for stage in est.stages:
        (send,) = stage.comm
        # Each micro-batch of 2 × 32 tokens: a forward send from stage 0, its gradient back from stage 1.
        assert send.kind == "send_recv" and send.calls == 4
        assert send.wire_bytes == 4 * 2 * 32 * TINY.dim * 4


# --- whole estimates ------------------------------------------------------------------------------------------------


def test_8b_on_8_h100():
    cfg = Config(model=EIGHT_B, dp=8, zero=3, precision="bf16", batch_size=8, seq_len=8192,
                 activation_checkpointing="full")
    est = estimate(cfg, "h100")
    assert est.stages[0].params == EIGHT_B.num_params
    assert round(EIGHT_B.num_params / 1e7) == 803  # 8.03e9, Llama-3-8B
    # 6 · 7.50e9 matmul parameters + 12 · 32 · 8192 · 4096 attention = 5.79e10 FLOP/token.
    assert est.flops_per_token == pytest.approx(5.79e10, rel=2e-3)
    mem = est.memory
    # FSDP2 shards the fp32 parameters and AdamW's moments over the 8 ranks.
    assert mem.parameters == pytest.approx(4 * 8.03e9 / 8, rel=1e-3)
    assert mem.optimizer == pytest.approx(8 * 8.03e9 / 8, rel=1e-3)
    # The peak follows the step: less than every category at its own peak together, and then what the caching
    # allocator reserves for it and what lives outside it (the CUDA context, NCCL).
    assert mem.allocated < mem.categories and mem.peak_at == "loss backward"
    assert mem.reserved == round(mem.allocated / 0.85) and mem.total == mem.reserved + mem.runtime > mem.reserved
    assert est.fits and 30e9 < mem.total < 80e9
    # The step is its kernels: the compute split adds up to the rank's compute; the collectives hide behind it.
    (stage,) = est.stages
    assert sum(t for _, t in stage.compute_split) == pytest.approx(stage.compute_s)
    assert est.compute_s == pytest.approx(stage.compute_s) and est.exposed_comm_s < 0.01 * est.step_time_s
    assert 0.25 < est.mfu < 0.6
    assert est.tokens_per_s == pytest.approx(8 * 8192 / est.step_time_s)
    # Without checkpointing a micro-batch of 8192 tokens needs far more than an H100 has; an H200 has more room.
    bigger = estimate(cfg.replace(activation_checkpointing="none"), "h100")
    assert not bigger.fits and bigger.headroom < 0 < est.headroom
    assert estimate(cfg, "h200").hardware.memory_bytes > est.hardware.memory_bytes


def test_the_compute_an_nccl_collective_hides_runs_slower_by_the_cited_share_of_its_time():
    """GPU: the step is the compute, the exposed collectives, and NCCL_CONTENTION (pytorch PR 179937: matmuls 30-40%
    slower beside an NCCL collective) of every collective's hidden time on the critical stage; the CPU model,
    measured on this machine's gloo, has no such term."""
    from workbench.estimate.collectives import NCCL_CONTENTION

    cfg = Config(model=EIGHT_B, dp=8, zero=3, precision="bf16", batch_size=8, seq_len=8192,
                 activation_checkpointing="full")
    est = estimate(cfg, "h100")
    hidden = sum(c.time_s - c.exposed_s for c in est.critical_stage.comm)
    assert hidden > 0.02 and NCCL_CONTENTION == 0.35
    assert est.contention_s == pytest.approx(0.35 * hidden)
    assert est.step_time_s == pytest.approx(est.compute_s + est.exposed_comm_s + 0.35 * hidden)
    assert "compute slowed beside hidden comm" in str(est)
    # Async TP hides TP's collectives behind its matmuls: what it saves is what they cost exposed, less what they
    # slow the matmuls beside them by.
    tp = Config(model=EIGHT_B, dp=2, tp=4, zero=3, precision="bf16", batch_size=4, seq_len=8192, compile=True)
    vanilla, fused = estimate(tp, "h100"), estimate(tp.replace(async_tp=True), "h100")
    assert fused.contention_s > vanilla.contention_s and fused.step_time_s < vanilla.step_time_s
    cpu = estimate(Config(dp=2, zero=3, batch_size=8), "cpu")
    assert cpu.contention_s == 0 and cpu.step_time_s == cpu.compute_s + cpu.exposed_comm_s


def test_table_reads_in_a_notebook():
    est = estimate(Config(dp=2, zero=3, precision="bf16", batch_size=16), "a100")
    text = est.table()
    assert str(est) == text
    for needle in ("dp2·zero3·bf16", "a100", "parameters", "activations", "total", "fits", "all_gather",
                   "reduce_scatter", "MFU", "tokens/s", "allocated", "reserved", "gemm", "attention"):
        assert needle in text

    class Printer:
        def __init__(self):
            self.out = ""

        def text(self, value):
            self.out += value

    printer = Printer()
    est._repr_pretty_(printer, False)
    assert printer.out == text
    # Each model states what it assumes: the GPU model for a GPU profile, this engine on CPU kernels for "cpu".
    assert est.assumptions == GPU_ASSUMPTIONS and len(GPU_ASSUMPTIONS) > 5
    assert estimate(Config(dp=2), "cpu").assumptions == ASSUMPTIONS and len(ASSUMPTIONS) > 5


def test_efficiency_scales_compute_time():
    cfg = Config(model=ModelConfig.preset("125m"), batch_size=8, seq_len=1024, precision="bf16")
    slow, fast = estimate(cfg, efficiency=0.2), estimate(cfg, efficiency=0.4)
    assert slow.compute_s == pytest.approx(2 * fast.compute_s)
    assert fast.mfu == pytest.approx(0.4)  # one rank, no recompute, no communication
    with pytest.raises(ValueError, match="efficiency"):
        estimate(cfg, efficiency=1.5)


def test_pipeline_bubble():
    cfg = Config(pp=2, micro_batches=2, batch_size=8)
    cpu = cpu_with_peak("fp32", 1e10)  # one CPU for both ("cpu" is measured at each world's threads per rank)
    single = estimate(Config(batch_size=8, micro_batches=2), cpu)
    piped = estimate(cfg, cpu)
    # Two stages share the work, but (m + pp - 1) / m = 3/2 slots pass: the step takes 3/4 of the single rank's.
    head_share = piped.stages[1].flops / (piped.stages[0].flops + piped.stages[1].flops)
    assert piped.compute_s == pytest.approx(single.compute_s * head_share * 3 / 2)


# --- estimate without torch --------------------------------------------------------------------------------------


def test_estimate_imports_without_torch():
    code = ("import sys, workbench; before = 'torch' in sys.modules; import workbench.estimate, workbench.hardware; "
            "print(before, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    before, after = result.stdout.split()
    assert after == before  # estimate and hardware pull in no torch of their own


# --- compression and offload ----------------------------------------------------------------------------------


def test_compression_changes_the_gradient_sync_bytes_by_formula():
    import workbench as wb

    from workbench.estimate import grad_sync_bytes_per_step, quantized_bucket_bytes

    base = wb.Config(dp=4, batch_size=8, seq_len=32)
    grads = 4 * base.model.num_params
    ring = 2 * 3 / 4  # all-reduce bus factor on 4 ranks
    none = grad_sync_bytes_per_step(base)
    assert none == round(grads * ring)
    assert grad_sync_bytes_per_step(base.replace(compression="fp16")) == round(none / 2)
    assert grad_sync_bytes_per_step(base.replace(compression="bf16", zero=2)) == round(grads / 2 * 3 / 4)
    # int8: 1 byte per value + 4 per 256, both phases (3/4 each), per bucket padded to dp·256 values
    first, rest = 2**18, base.model.num_params - 2**18
    int8 = quantized_bucket_bytes(first, 4, "int8") + quantized_bucket_bytes(rest, 4, "int8")
    assert int8 == (first + rest + 4 * (first + rest) / 256) + ((-rest) % 1024) * (1 + 4 / 256)
    assert grad_sync_bytes_per_step(base.replace(compression="int8")) == pytest.approx(2 * 3 / 4 * int8, abs=1)
    onebit = grad_sync_bytes_per_step(base.replace(compression="1bit"))
    assert onebit / none == pytest.approx((1 / 32) * (1 + 32 / 2048), rel=0.02)
    # PowerSGD rank r: (m + n)·r per matrix, the vectors whole
    assert grad_sync_bytes_per_step(base.replace(compression="powersgd", powersgd_rank=1)) < none / 20


def test_offload_moves_optimizer_state_to_a_host_figure():
    import workbench as wb

    base = wb.Config(dp=2, zero=1, batch_size=8, seq_len=32)
    on, off = wb.estimate(base.replace(offload=True), "cpu").memory, wb.estimate(base, "cpu").memory
    assert on.optimizer == 0 and off.host == 0
    assert on.host == off.optimizer + 2 * off.parameters // 2  # moments + fp32 master + pinned grads, 1/dp share
    assert on.total == off.total - off.optimizer
    z3 = wb.estimate(base.replace(zero=3, offload=True), "cpu").memory
    assert z3.parameters == z3.gradients == z3.optimizer == 0 and z3.host > 0


def test_v_placement_puts_the_embedding_and_the_head_on_rank_0_and_split_backwards_shrink_the_bubble():
    from workbench.estimate.predict import bubble_slots
    from workbench.estimate.stage import stage_shapes

    cfg = Config(pp=2, dp=2, zero=2, schedule="zbv", micro_batches=4, model=ModelConfig(n_layers=4))
    shapes = stage_shapes(cfg)
    assert shapes[0].stages == (0, 3) and shapes[0].first and shapes[0].last
    assert shapes[1].stages == (1, 2) and not shapes[1].first and not shapes[1].last
    assert shapes[0].params > shapes[1].params  # the embedding and the head
    # The schedules' formulas at F = I = W, in micro-batch slots of a rank: 1F1B p-1, interleaved (p-1)/v,
    # ZB-V (p-1)(F+B-2W)/(v(F+B)), DualPipeV (p-1)(F+2B-3W)/(v(F+B)).
    slots = {s: bubble_slots(Config(pp=4, schedule=s, micro_batches=8, model=ModelConfig(n_layers=8)))
             for s in ("1f1b", "interleaved_1f1b", "zbv", "dualpipev")}
    assert slots == {"1f1b": 3.0, "interleaved_1f1b": 1.5, "zbv": 0.5, "dualpipev": 1.0}
    assert estimate(cfg).compute_s < estimate(dataclasses.replace(cfg, schedule="1f1b", zero=0)).compute_s


def test_zero_shards_over_the_context_parallel_ranks_with_one_data_parallel_rank():
    # torchtitan's "FSDP 1, CP 8": FSDP2 over dp_shard·cp, so with dp = 1 the 8 cp ranks shard everything.
    model = ModelConfig.preset("8b")
    model = dataclasses.replace(model, max_seq_len=65536)
    cfg = Config(model=model, dp=1, cp=8, zero=3, precision="bf16", mixed_precision="fsdp", seq_len=65536,
                 batch_size=1, activation_checkpointing="full")
    memory = estimate(cfg, "h100").memory
    assert memory.parameters == pytest.approx(4 * model.num_params / 8, rel=1e-6)
    assert memory.optimizer == pytest.approx(8 * model.num_params / 8, rel=1e-6)
    gathers = [c for c in estimate(cfg, "h100").comm if c.role is Role.PARAMETER_GATHER]
    assert gathers and all(c.axis == "dp" for c in gathers)
