"""Context parallel: the ring is attention over the whole sequence, every layout with cp trains like one process,
and the K/V exchange is what the recording backend sees on the cp group.

Tolerance: as every layout (test_parity), fp32 losses within 1e-5 relative of one process (measured ≤ 2.6e-7).
The ring against whole-sequence SDPA: fp32 within 1e-5 of the largest value (measured ≤ 2.9e-7; the online softmax
sums the blocks in another order), bf16 within 2e-2 (measured ≤ 6.0e-3: each block's output is rounded to bf16
before the merge, where SDPA rounds once).
"""

from __future__ import annotations

import pytest
import torch

from workbench.config import Config
from workbench.engine.parallel.context import balanced_positions

from tests.engine import context_rank_fns as cfns
from tests.engine import rank_fns as fns
from tests.engine.test_parity import assert_parity

STEPS = 4
BASE = Config(batch_size=8, seq_len=64)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return fns.reference_run(BASE, STEPS)["losses"]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_balanced_chunks_cover_the_sequence_once_and_share_the_causal_work(cp):
    seq = 16 * cp
    held = [balanced_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))
    c = seq // (2 * cp)
    for r, positions in enumerate(held):
        assert positions.tolist() == [*range(r * c, (r + 1) * c), *range((2 * cp - 1 - r) * c, (2 * cp - r) * c)]
    # Causal work of a rank: the keys each of its queries sees. The head-tail pairing makes it equal on every rank.
    assert len({int((positions + 1).sum()) for positions in held}) == 1


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_the_ring_is_attention_over_the_whole_sequence(pool, dtype, tol):
    for r in pool.run(cfns.ring_against_whole_attention, 2, 32, dtype):
        assert r["dtype"] == f"torch.{dtype}"
        assert max(r["out"], r["dq"], r["dk"], r["dv"]) < tol, r


def test_a_ring_of_four_passes_every_block_and_brings_every_gradient_home(pool4):
    # cp=4: each rank sees earlier and later ranks' keys, and the key gradients travel three hops before home.
    results = pool4.run(cfns.ring_against_whole_attention, 4, 64, "float32")
    for r in results:
        assert max(r["out"], r["dq"], r["dk"], r["dv"]) < 1e-5, r
    assert sorted(p for r in results for p in r["positions"]) == list(range(64))


# ZeRO shards over the dp·cp ranks whenever there are more than one, dp = 1 included (torchtitan's FSDP over
# dp_shard·cp: its "FSDP 1, CP 8" runs).
@pytest.mark.parametrize("layout", [dict(cp=2), dict(cp=2, zero=3, activation_checkpointing="full"),
                                    dict(cp=2, zero=1), dict(cp=2, zero=2)],
                         ids=["cp2", "cp2 zero3 ac full", "cp2 zero1 (dp 1)", "cp2 zero2 (dp 1)"])
def test_context_parallel_trains_like_one_process(pool, reference, layout):
    assert_parity(pool.run(fns.train, BASE.replace(**layout), STEPS), reference)


FOUR_RANKS = {
    "cp2·dp2 zero1": dict(cp=2, dp=2, zero=1),
    "cp2·tp2 (replicate over cp)": dict(cp=2, tp=2),
    "cp2·pp2 1f1b": dict(cp=2, pp=2, micro_batches=2),
}


@pytest.mark.parametrize("name", FOUR_RANKS)
def test_context_parallel_composes_with_dp_tp_and_pp(pool4, reference, name):
    assert_parity(pool4.run(fns.train, BASE.replace(**FOUR_RANKS[name]), STEPS), reference)


def test_the_key_value_exchange_is_recorded_on_the_cp_group(pool):
    cfg = BASE.replace(cp=2)
    m = cfg.model
    layers, cp = m.n_layers, cfg.cp
    # One exchange: keys and values of this rank's seq/cp positions, (2, batch, kv_heads, seq/cp, head_dim) fp32.
    message = 2 * cfg.batch_size * m.kv_heads * (cfg.seq_len // cp) * m.head_dim * 4
    # Per layer: forward passes K/V on cp-1 times; backward passes them again and their gradients cp times.
    exchanges = layers * ((cp - 1) + (cp - 1) + cp)
    for r in pool.run(cfns.train_recording, cfg):
        on_cp = [(name, nbytes) for name, nbytes, group in r["comm"] if group == "mesh_cp"]
        assert sorted(on_cp) == sorted([("recv", message)] * exchanges + [("send", message)] * exchanges)
        # Everything else is the gradient sync over dp·cp (the world here) and the step's vote.
        assert {name for name, _, group in r["comm"] if group != "mesh_cp"} <= {"all_reduce", "broadcast"}
        # The cp ranks average their gradients (DDP over dp·cp): every fp32 gradient once, bus factor 1 at 2 ranks.
        assert r["grad_sync_bytes"] == 4 * m.num_params


@pytest.mark.parametrize("causal, rows, cols", [(True, slice(None), slice(None)), (False, slice(16, None), slice(None)),
                                                (False, slice(None), slice(0, 16))])
def test_the_plain_block_kernels_are_torchs_flash_kernels(causal, rows, cols):
    # The matmul kernels run where torch has no flash-attention op with a log-sum-exp to call (CUDA here): the
    # same numbers as the CPU flash kernels on every kind of block the ring computes.
    from workbench.engine.parallel import context

    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(2, 4, 32, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 2, 32, 8, generator=g) for _ in range(2))
    q, dout, k, v = q[:, :, rows], dout[:, :, rows], k[:, :, cols], v[:, :, cols]
    scale = 8 ** -0.5
    flash = context._flash_cpu_forward(q, k, v, causal, scale)
    plain = context._plain_forward(q, k, v, causal, scale)
    for a, b in zip(plain, flash):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    out, lse = flash
    grads = zip(context._plain_backward(q, k, v, dout, out, lse, causal, scale),
                context._flash_cpu_backward(q, k, v, dout, out, lse, causal, scale))
    for a, b in grads:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
