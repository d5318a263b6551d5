"""bf16 / fp16 layouts against the same-precision single process, and skipped steps agreed by every rank.

Tolerances (losses, relative, vs one process under the same autocast):
- bf16: 2e-3 (measured ≤ 3e-4 over 5 steps: bf16 matmuls sum in a
  different order on a half batch, and bf16 keeps 8 bits of mantissa);
- fp16: 1e-3 (measured ≤ 1e-4), and the skipped steps and the final loss
  scale must be exactly those of the reference.
"""

from __future__ import annotations

import pytest

from workbench.config import Config

from tests.engine import rank_fns as fns

STEPS = 5
BASE = Config(batch_size=8, seq_len=64)
TOLERANCE = {"bf16": 2e-3, "fp16": 1e-3}

CASES = {
    "bf16 dp2 zero2": dict(dp=2, zero=2, precision="bf16"),
    "bf16 tp2": dict(tp=2, precision="bf16"),
    "fp16 dp2 zero1": dict(dp=2, zero=1, precision="fp16"),
    "fp16 dp2 zero3": dict(dp=2, zero=3, precision="fp16"),
    "fp16 tp2": dict(tp=2, precision="fp16"),
}


@pytest.mark.parametrize("name", CASES)
def test_low_precision_layout_matches_one_process(pool, name):
    cfg = BASE.replace(**CASES[name])
    reference = fns.reference_run(cfg, STEPS)
    results = pool.run(fns.train, cfg, STEPS)
    losses = results[0]["losses"]
    assert all(r["losses"] == losses and r["scale"] == results[0]["scale"] for r in results)
    assert losses == pytest.approx(reference["losses"], rel=TOLERANCE[cfg.precision])
    if cfg.precision == "fp16":
        assert results[0]["skipped"] == reference["skipped"]
        assert results[0]["scale"] == reference["scale"]


OVERFLOW_CASES = {
    # DDP/ZeroRedundancyOptimizer: GradScaler checks each rank's own (plain) gradients only.
    "dp2 zero1": dict(dp=2, zero=1),
    # FSDP2: GradScaler's DTensor path agrees within the dp axis by itself; the trainer must not undo it.
    "dp2 zero3": dict(dp=2, zero=3),
    # Pipeline stages hold different gradients: nothing in torch agrees across them.
    "pp2": dict(pp=2, micro_batches=2),
}


@pytest.mark.parametrize("name", OVERFLOW_CASES)
def test_an_inf_gradient_on_one_rank_skips_the_step_on_every_rank(pool, name):
    cfg = BASE.replace(precision="fp16", **OVERFLOW_CASES[name])
    results = pool.run(fns.inject_overflow, cfg, 3, 1, 1)  # 3 steps, inf at step 1 on rank 1 only
    for r in results:
        assert r["skipped"] == [False, True, False]
        assert r["unchanged"], "weights moved on a skipped step"
        assert r["scales"][1] == r["scales"][0] / 2
        assert r["skipped_steps"] == 1
        assert r["reason"] == "fp16 gradient overflow"


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_one_ranks_votes_hold_for_every_rank(pool, precision):
    cfg = BASE.replace(dp=2, precision=precision)
    results = pool.run(fns.vote, cfg, 1, 0)  # rank 1 asks to stop, rank 0 to skip
    for r in results:
        assert r["stop"] and r["skipped"] and r["unchanged"]
        assert r["reason"] == "skip requested by a rank"
    none = pool.run(fns.vote, cfg, None, None)
    assert not any(r["stop"] or r["skipped"] or r["unchanged"] for r in none)


def fsdp_mixed_precision_reference(cfg: Config, steps: int) -> list[float]:
    """One process doing what FSDP2's MixedPrecisionPolicy does, on the whole batch: fp32 master weights, a bf16
    copy of them for forward and backward (every op in bf16, no autocast), the bf16 gradients cast to fp32 onto
    the masters, AdamW on the masters."""
    import torch

    from tests.engine.rank_fns import SyntheticData
    from workbench.models.transformer import build_model, loss_fn

    master = build_model(cfg.model, cfg.seed)
    opt = torch.optim.AdamW(master.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data, losses = SyntheticData(cfg), []
    for step in range(steps):
        compute = build_model(cfg.model, cfg.seed).to(torch.bfloat16)
        compute.load_state_dict({k: v.to(torch.bfloat16) for k, v in master.state_dict().items()})
        tokens = data.global_batch(step)
        loss = loss_fn(compute(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        for p, q in zip(master.parameters(), compute.parameters()):
            p.grad = q.grad.float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


FSDP_MP_TOLERANCE = 5e-4
"""bf16 FSDP2 mixed precision against one process doing the same (above): losses within 5e-4 relative (measured
7e-5 over 5 steps: each rank's half batch gives bf16 gradients averaged in fp32, one process's whole batch one
bf16 gradient). Autocast's losses differ from these by about as much at this size, so what tells the two apart
is `compute_dtypes`: the weights a block multiplies, and its input, are bf16 tensors under "fsdp"."""


def compute_dtypes(cfg: Config) -> dict[str, str]:
    """On a rank: the dtypes block 0's wq sees in forward (its weight and its input), and its parameter's at rest."""
    import torch

    trainer = fns._trainer(cfg)
    wq = next(m for name, m in trainer.modules[0].named_modules() if name.endswith("layers.0.attention.wq"))
    seen: dict[str, str] = {}
    handle = wq.register_forward_pre_hook(
        lambda mod, args: seen.update(weight=str(mod.weight.dtype), input=str(args[0].dtype)))
    trainer.step(0)
    handle.remove()
    seen["at rest"] = str(wq.weight.dtype)
    seen["autocast"] = str(torch.is_autocast_enabled("cpu"))
    return seen


def test_fsdp_mixed_precision_matches_one_process(pool):
    cfg = BASE.replace(dp=2, zero=3, precision="bf16", mixed_precision="fsdp")
    results = pool.run(fns.train, cfg, STEPS)
    losses = results[0]["losses"]
    assert all(r["losses"] == losses for r in results)
    assert losses == pytest.approx(fsdp_mixed_precision_reference(cfg, STEPS), rel=FSDP_MP_TOLERANCE)
    for seen in pool.run(compute_dtypes, cfg):
        assert seen == {"weight": "torch.bfloat16", "input": "torch.bfloat16", "at rest": "torch.float32",
                        "autocast": "False"}
