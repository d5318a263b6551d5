"""The Workbench as a notebook uses it: apply, train in the background, reshard, stop, refuse."""

from __future__ import annotations

import time

import pytest

import workbench as wb
from tests.engine.rank_fns import reference_run
from workbench.engine.data import TokenData

BASE = wb.Config(batch_size=8, seq_len=64)


def reference_losses(cfg: wb.Config, steps: int) -> list[float]:
    """One process, the whole batch, plain AdamW: what every layout must reproduce."""
    return reference_run(cfg, steps, TokenData.for_config(cfg))["losses"]


@pytest.fixture
def bench(pool):
    bench = wb.Workbench(pool=pool)
    yield bench
    if bench.running:
        bench.running.stop()
    bench.close()


@pytest.mark.smoke
def test_changing_layout_mid_run_keeps_training_where_it_was(bench):
    """10 steps dp=2, reshard to tp=2, 10 more, to pp=2, 10 more: the 30 losses of one uninterrupted process."""
    losses = []
    for i, layout in enumerate([dict(dp=2), dict(tp=2), dict(pp=2, micro_batches=2)]):
        info = bench.apply(BASE.replace(**layout), fresh=i == 0)
        assert info["resharded"] == (i > 0)
        losses += [m.loss for m in bench.train(10).wait()]
    assert [m.step for m in bench.history] == list(range(30))
    assert [c.step for c in bench.layout_changes] == [0, 10, 20]
    # fp32, float reordering only: each layout is within 1e-5 of one process over its first steps (test_parity);
    # over 30 AdamW steps the reordering compounds (1.5e-5 seen at step 18). A lost optimizer moment or a
    # misplaced shard moves the loss by 1e-2 or more.
    assert losses == pytest.approx(reference_losses(BASE, 30), rel=5e-5)


def test_an_invalid_config_touches_no_rank_and_loses_nothing(bench, monkeypatch):
    bench.apply(BASE.replace(dp=2), fresh=True)
    before = bench.train(3).wait()
    sent = []
    monkeypatch.setattr(bench.pool, "run_async", lambda *a, **k: sent.append(a))
    with pytest.raises(wb.ConfigError, match="dp·tp·pp = 4.*2 ranks.*new Workbench"):
        bench.apply(BASE.replace(dp=4))
    with pytest.raises(wb.ConfigError, match="^tp:"):
        bench.apply(BASE.replace(tp=3))
    assert sent == [], "a refused config never reaches the ranks"
    monkeypatch.undo()
    after = bench.train(2).wait()
    assert [m.step for m in after] == [3, 4]
    assert bench.config == BASE.replace(dp=2) and len(before) == 3


def test_train_returns_at_once_and_stop_ends_every_rank_at_the_same_step(bench):
    from workbench.engine import session

    bench.apply(BASE.replace(dp=2), fresh=True)
    run = bench.train(10_000)
    # At once: before the run ends (10,000 steps take minutes), however slow this machine is today.
    assert not run.done
    while len(bench.history) < 3:
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match="stop"):
        bench.apply(BASE.replace(tp=2))
    done = run.stop(timeout=60)
    assert run.done and 3 <= len(done) < 10_000
    assert bench.pool.run(session.next_step) == [len(done), len(done)], "ranks agree where training stopped"
    assert bench.train(1).wait()[0].step == len(done)


def test_a_new_model_shape_starts_fresh(bench):
    bench.apply(BASE.replace(dp=2), fresh=True)
    bench.train(2).wait()
    small = BASE.replace(dp=2, model=wb.ModelConfig(dim=64, n_layers=2, n_heads=2))
    assert bench.apply(small)["resharded"] is False
    assert bench.train(1).wait()[0].step == 0 and len(bench.history) == 1


def test_a_stop_request_outlives_neither_its_run_nor_its_workbench(pool):
    # Flags live on the ranks, which outlive a Workbench: a later run must not read an old stop as its own.
    first = wb.Workbench(pool=pool)
    first.apply(BASE.replace(dp=2), fresh=True)
    run = first.train(10_000)
    while len(first.history) < 1:
        time.sleep(0.05)
    run.stop(timeout=60)
    first.close()
    second = wb.Workbench(pool=pool)
    try:
        second.apply(BASE.replace(dp=2), fresh=True)
        assert len(second.train(3).wait()) == 3
    finally:
        second.close()


def test_a_trained_mixture_of_experts_reshards_into_expert_parallel_live(bench):
    """5 steps of tiny-moe at dp=2 (experts replicated), apply ep=2 (half the experts per rank), 5 more: one process's
    10 losses, and the router's counts reported every step."""
    moe = BASE.replace(model=wb.ModelConfig.preset("tiny-moe"))
    bench.apply(moe.replace(dp=2), fresh=True)
    first = bench.train(5).wait()
    info = bench.apply(moe.replace(dp=2, ep=2))
    assert info["resharded"] and info["layout"] == "dp2·ep2"
    assert info["params_local"] < moe.model.num_params
    second = bench.train(5).wait()
    metrics = first + second
    for m in metrics:
        assert len(m.expert_load) == moe.model.n_moe_layers
        # Every token's top_k choices are counted, dropped or not: the global batch's tokens times top_k per layer.
        assert all(sum(layer) == moe.tokens_per_step * moe.model.top_k for layer in m.expert_load)
        assert m.aux_loss is not None and m.aux_loss > 0
    reference = reference_losses(moe, 10)  # one process; its MoE layers backpropagate their balancing loss
    assert [m.loss for m in metrics] == pytest.approx(reference, rel=5e-5)


def test_replica_check_stops_a_run_whose_replicas_diverged_naming_the_rank_and_the_parameter(bench):
    from tests.telemetry import replica_rank_fns

    bench.apply(wb.Config(dp=2, batch_size=8, seq_len=32, replica_check_every=2), fresh=True)
    bench.train(4).wait()  # replicas agree: checked at steps 2 and 4
    name = bench.pool.run(replica_rank_fns.nudge_the_sessions_parameter, 1)[0]
    with pytest.raises(wb.RemoteError) as info:
        bench.train(2).wait()
    assert "ReplicaDivergence" in str(info.value) and name in str(info.value) and "rank 1" in str(info.value)
    bench.apply(wb.Config(dp=2, batch_size=8, seq_len=32), fresh=True)  # the bench stays usable


def test_replica_check_is_refused_where_no_two_ranks_hold_the_same_bytes():
    with pytest.raises(wb.ConfigError, match="replica_check_every: zero=3 shards every parameter"):
        wb.Config(dp=2, zero=3, replica_check_every=10)
    with pytest.raises(wb.ConfigError, match="replica_check_every: the layout has no data-parallel replicas"):
        wb.Config(tp=2, replica_check_every=10)
    wb.Config(dp=4, zero=3, dp_replicate=2, replica_check_every=10)  # HSDP's replica groups are compared
