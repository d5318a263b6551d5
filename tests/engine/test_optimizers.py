"""The optimizers (Config.optimizer): Lion against the paper's update, every optimizer in every kind of layout
against one process, their state's memory as the dashboard reports it, and checkpoints and reshards with them.

Tolerance: as test_parity, losses within 1e-5 relative of the single-process reference (Lion's sign update
could flip an element whose argument is ~0 under a different order of sums; not seen on these runs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workbench.config import Config
from workbench.engine.optimizers import Lion
from workbench.engine.reshard import export_full_state, import_full_state
from workbench.pool import rank

from tests.engine import rank_fns as fns
from tests.engine.test_checkpoint import SAVED_AT, THEN, resume_in_layouts

STEPS = 4
BASE = Config(batch_size=8, seq_len=64)
LION = BASE.replace(optimizer="lion", lr=3e-4, weight_decay=0.1)
SGD = BASE.replace(optimizer="sgd", lr=0.3)
REL = 1e-5

LAYOUTS = {  # one of each mechanism that touches the optimizer
    "dp2 zero1 (ZeroRedundancyOptimizer)": dict(dp=2, zero=1),
    "dp2 zero3 (FSDP2: DTensor shards)": dict(dp=2, zero=3),
    "tp2 (DTensor parameters)": dict(tp=2),
    "pp2 1f1b (an optimizer per stage)": dict(pp=2, micro_batches=2),
    "dp2 zero0 offload (the host copy)": dict(dp=2, offload=True),
    "dp2 zero3 offload (FSDP2's CPUOffloadPolicy)": dict(dp=2, zero=3, offload=True),
}
SGD_LAYOUTS = ("dp2 zero1 (ZeroRedundancyOptimizer)", "dp2 zero3 (FSDP2: DTensor shards)",
               "dp2 zero0 offload (the host copy)")


def lion_by_the_paper(w, g_steps, lr, beta1, beta2, decay):
    """Algorithm 2 of Chen et al. 2023 (decoupled weight decay), in numpy: the independent reference."""
    w, m = w.astype(np.float64), np.zeros_like(w, dtype=np.float64)
    for g in g_steps:
        c = beta1 * m + (1 - beta1) * g
        w = w - lr * (np.sign(c) + decay * w)
        m = beta2 * m + (1 - beta2) * g
    return w, m


def test_lion_follows_the_paper_and_keeps_one_moment():
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(64, 32, generator=gen)
    grads = [torch.randn(64, 32, generator=gen) for _ in range(5)]
    param = torch.nn.Parameter(w0.clone())
    opt = Lion([param], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    for g in grads:
        param.grad = g.clone()
        opt.step()
    w, m = lion_by_the_paper(w0.numpy(), [g.numpy() for g in grads], 1e-2, 0.9, 0.99, 0.1)
    # fp32 against fp64: a few ulps of weights of size ~3 (a wrong sign would be off by 2·lr = 2e-2)
    assert np.allclose(param.detach().numpy(), w, rtol=0, atol=1e-5)
    assert list(opt.state[param]) == ["exp_avg"]
    assert np.allclose(opt.state[param]["exp_avg"].numpy(), m, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def references() -> dict[str, list[float]]:
    return {cfg.optimizer: fns.reference_run(cfg, STEPS)["losses"] for cfg in (LION, SGD)}


@pytest.mark.parametrize("name", LAYOUTS)
def test_lion_trains_every_layout_like_one_process(pool, references, name):
    results = pool.run(fns.train, LION.replace(**LAYOUTS[name]), STEPS)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    assert results[0]["losses"] == pytest.approx(references["lion"], rel=REL)


@pytest.mark.parametrize("name", SGD_LAYOUTS)
def test_sgd_trains_like_one_process(pool, references, name):
    results = pool.run(fns.train, SGD.replace(**LAYOUTS[name]), STEPS)
    assert results[0]["losses"] == pytest.approx(references["sgd"], rel=REL)


def optimizer_memory(cfg: Config) -> dict:
    """On the ranks: two steps with telemetry on; the optimizer bytes the dashboard shows, and this rank's
    parameter elements (counted from the shards themselves) to compare them with."""
    from workbench.engine.mesh import build_mesh
    from workbench.engine.trainer import Trainer

    with rank.unchecked():
        trainer = Trainer(cfg, build_mesh(cfg, "cpu"), "cpu", fns.SyntheticData(cfg), telemetry=True)
        metrics = [trainer.step(i) for i in range(2)][-1]
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for m in trainer.modules
                    for p in m.parameters())
    return {"optimizer": metrics.memory["optimizer"], "params": local}


def test_lion_and_sgd_keep_half_of_adamws_optimizer_state_as_measured(pool):
    zero3 = BASE.replace(dp=2, zero=3)
    measured = {name: pool.run(optimizer_memory, zero3.replace(optimizer=name)) for name in ("adamw", "lion", "sgd")}
    for r in range(2):
        adamw, lion, sgd = (measured[name][r]["optimizer"] for name in ("adamw", "lion", "sgd"))
        assert adamw == 8 * measured["adamw"][r]["params"]  # two fp32 moments per element of this rank's shard
        assert lion == sgd == 4 * measured["lion"][r]["params"]
        assert lion / adamw == 0.5
    print(f"optimizer state on rank 0 (dp2 zero3): adamw {measured['adamw'][0]['optimizer']:,} B, "
          f"lion {measured['lion'][0]['optimizer']:,} B, sgd {measured['sgd'][0]['optimizer']:,} B")


def test_a_lion_checkpoint_continues_in_other_layouts(pool, tmp_path):
    targets = {"tp2": LION.replace(tp=2), "dp2 zero1": LION.replace(dp=2, zero=1)}
    reference = fns.reference_run(LION, SAVED_AT + THEN)["losses"]
    out = pool.run(resume_in_layouts, LION.replace(dp=2, zero=3), targets, str(tmp_path))[0]
    assert out["saved"] == pytest.approx(reference[:SAVED_AT], rel=REL)
    for name in targets:
        assert out[name] == pytest.approx(reference[SAVED_AT:], rel=REL), name


@fns.unchecked
def switch_optimizer(first: Config, second: Config) -> dict:
    """Train `first` 2 steps, reshard into `second` (another optimizer): the weights carry, its state starts empty."""
    a = fns._trainer(first)
    for i in range(2):
        a.step(i)
    before = [p.detach().clone() for m in a.modules for p in m.parameters()]
    b = fns._trainer(second)
    import_full_state(b, export_full_state(a))
    after = [p.detach() for m in b.modules for p in m.parameters()]
    return {"same_weights": all(torch.equal(x, y) for x, y in zip(before, after)),
            "state": sum(len(opt.state) for opt in b.optimizers), "loss": b.step(2).loss,
            "state_after_a_step": sum(len(s) for opt in b.optimizers for s in opt.state.values())}


def test_changing_the_optimizer_carries_the_weights_and_starts_its_state_afresh(pool):
    for r in pool.run(switch_optimizer, BASE.replace(dp=2), LION.replace(dp=2)):
        assert r["same_weights"] and r["state"] == 0 and np.isfinite(r["loss"])
        assert r["state_after_a_step"] > 0


def test_the_estimator_and_the_plan_follow_the_optimizer():
    """Pure: wb.estimate counts Lion's and SGD's state as half of AdamW's, and wb.plan carries the optimizer
    (and any other setting) of its `base` into every candidate."""
    import workbench as wb

    cfg = Config(model=wb.ModelConfig.preset("1b"), dp=8, zero=1, batch_size=8, seq_len=2048, precision="bf16")
    adamw, lion, sgd = (wb.estimate(cfg.replace(optimizer=o), hardware="h100").memory.optimizer
                        for o in ("adamw", "lion", "sgd"))
    assert lion == sgd == adamw // 2
    planned = wb.plan("1b", gpus=8, global_batch=16, base=Config(optimizer="lion"))
    assert planned.best.config.optimizer == "lion"
