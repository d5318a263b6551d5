"""The probes' numbers against independent measures: tensor sizes, theory, the FLOP formula."""

from __future__ import annotations

import pytest

from tests.telemetry import probe_rank_fns as fns
from workbench.config import Config, ModelConfig
from workbench.estimate import flops_per_token
from tests.telemetry.overlap_reference import step_summary
from workbench.telemetry.analysis import split_kinds
from workbench.telemetry.events import Interval

BASE = Config(model=ModelConfig.preset("tiny"), batch_size=8, seq_len=64)


def test_waits_inside_compute_spans_are_not_counted_as_compute():
    ivs = [Interval("compute", "forward", 0, 100), Interval("wait", "wait ALLGATHER", 20, 50),
           Interval("comm", "all_gather", 10, 60), Interval("comm", "all_reduce", 90, 130)]
    compute, comm = split_kinds(ivs)
    assert compute == [(0, 20), (50, 100)]
    comm_s, exposed_s, overlap = step_summary(ivs)
    # comm covers [10,60) ∪ [90,130) = 90 ns; computing during it: [10,20) ∪ [50,60) ∪ [90,100) = 30 ns
    assert comm_s == pytest.approx(90e-9) and exposed_s == pytest.approx(60e-9) and overlap == pytest.approx(30 / 90)


def test_a_collective_result_saved_twice_counts_once():
    import torch
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    from workbench.telemetry.activations import ActivationMeter

    # What the embedding's sequence-parallel reduce-scatter returns: a wrapper owning no storage of its own. The
    # meter saves a detached alias of each saved tensor, and detaching it makes a new wrapper every time.
    result = torch.randn(64, 32)
    x, w = AsyncCollectiveTensor(result), torch.ones(64, 32, requires_grad=True)
    meter = ActivationMeter()
    with meter.watching():
        loss = (x * w).sum() + (x * w.square()).sum()  # both products save x for w's gradient
    assert meter.live == result.nbytes
    loss.backward()
    assert meter.live == 0 and meter.peak == result.nbytes


@pytest.fixture(scope="module")
def zero_stages(_session_pool):
    return {zero: _session_pool.run(fns.train_and_measure, BASE.replace(dp=2, zero=zero)) for zero in range(4)}


def test_memory_categories_equal_the_actual_tensor_bytes(zero_stages):
    for zero, per_rank in zero_stages.items():
        for r in per_rank:
            assert r["memory"]["parameters"] == r["independent_params"], zero
            assert r["memory"]["optimizer"] == r["independent_optimizer"], zero
            assert r["memory"]["gradients"] == 0, "gradients are freed after the step (zero_grad(set_to_none))"
            assert r["memory"]["activations"] == 0, "nothing saved for backward outlives the step"


def test_the_probes_per_layout_memory_counts_equal_the_full_walks_at_every_call(zero_stages):
    # The probe finds what a layout fixes once (telemetry.memory.ModelMemory); the walks find everything each call.
    for zero, per_rank in zero_stages.items():
        checks = per_rank[0]["memory_checks"]
        assert {name for name, _, _ in checks} == {"parameter_bytes", "gradient_bytes", "optimizer_bytes"}, zero
        assert [(n, a) for n, a, _ in checks] == [(n, b) for n, _, b in checks], zero
        assert any(n == "gradient_bytes" and a > 0 for n, a, _ in checks), "counted while gradients exist"


def test_memory_shrinks_across_zero_stages_as_theory_says(zero_stages):
    P = zero_stages[0][0]["full_params"]
    mem = {z: per_rank[0]["memory"] for z, per_rank in zero_stages.items()}
    peak = {z: per_rank[0]["peak"] for z, per_rank in zero_stages.items()}
    # ZeRO 0: everything replicated — P params, P gradients, 2P AdamW moments
    assert mem[0]["parameters"] == P and peak[0]["gradients"] == P and mem[0]["optimizer"] == 2 * P
    # ZeRO 1: optimizer state sharded over dp=2 (ZeroRedundancyOptimizer balances whole tensors: about half)
    assert mem[1]["parameters"] == P and peak[1]["gradients"] == P
    assert 0.4 * 2 * P <= mem[1]["optimizer"] <= 0.6 * 2 * P
    # ZeRO 2 and 3 (FSDP2): parameters at rest, gradients and optimizer state sharded — halves, up to padding
    for z in (2, 3):
        assert mem[z]["parameters"] == pytest.approx(P / 2, rel=0.01)
        assert peak[z]["gradients"] == pytest.approx(P / 2, rel=0.01)
        assert mem[z]["optimizer"] == pytest.approx(P, rel=0.01)
    # ZeRO 2 keeps every gathered parameter from forward to backward; ZeRO 3 frees them after each block
    assert peak[2]["parameters"] >= P + P / 2 * 0.99
    assert peak[3]["parameters"] < peak[2]["parameters"]


def test_ddp_all_reduces_exactly_the_gradient_bytes_each_step(zero_stages):
    r = zero_stages[0][0]
    reduced = sum(nbytes for name, nbytes, _ in r["comm"] if name == "all_reduce")
    # DDP's buckets carry every gradient once; the trainer's own all-reduce carries its 6 fp32 verdicts.
    assert reduced == r["full_params"] + 6 * 4
    assert 0 <= r["exposed_comm_s"] <= r["comm_time_s"] and 0 <= r["overlap"] <= 1
    assert {"forward", "backward", "optimizer"} <= set(r["compute"])


def test_activation_memory_falls_with_checkpointing(pool):
    peaks = {ac: pool.run(fns.train_and_measure, BASE.replace(dp=2, activation_checkpointing=ac))[0]["peak"]
             ["activations"] for ac in ("none", "selective", "full")}
    print("peak activation bytes:", peaks)
    assert peaks["none"] > peaks["selective"] > peaks["full"] > 0


def test_flops_and_mfu_follow_the_model_formula(zero_stages):
    r = zero_stages[0][0]
    assert r["flops"] == flops_per_token(BASE.model, BASE.seq_len) * BASE.tokens_per_step / r["world"]
    assert r["mfu"] == pytest.approx(r["flops"] / r["step_time_s"] / (r["flops"] / r["step_time_s"] / r["mfu"]))
    assert 0 < r["mfu"] < 1 and "measured" in r["basis"]


def test_pipeline_actions_are_measured_per_stage_and_micro_batch(pool):
    per_rank = pool.run(fns.train_and_measure, BASE.replace(pp=2, micro_batches=4, schedule="1f1b"))
    for stage, r in enumerate(per_rank):
        assert sorted((s, mb, k) for s, mb, k, _, _ in r["actions"]) == sorted(
            (stage, mb, k) for mb in range(4) for k in "FB")
        assert {n for n, _, _ in r["comm"]} >= {"send", "recv"}
