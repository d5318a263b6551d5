"""The traced estimate of a foreign model against what its ranks measure (issue 32, item 6's check, and the CPU
memory prediction the dashboard draws beside the measured bars).

The Hugging Face families the workbench is tested with (tests/models/families.py: Llama, Mistral, Qwen3, Gemma,
Qwen3-MoE) and a module of one's own, at tiny shapes, trained on the 2-rank pool in the layouts that reach each
part of the estimate: dp (the blocks' saved tensors), tp (sequence parallel's split and gathered inputs, a mixture
of experts run whole on every tp rank), pp (each stage's blocks, the micro-batches in flight), full recompute (a
block's input, and what checkpointing keeps of its positional inputs), cp (a rank's share of each sequence). The
measure is the ranks' own probe (the ActivationMeter), independent of the trace (fake tensors in the notebook).
"""

from __future__ import annotations

import pytest

from tests.activations_kept import kept_by_one_forward
from tests.engine import own_model_fns as own_fns
from tests.models.custom_models import PLAN
from tests.models.families import FAMILIES, family
from workbench.compare import predicted_memory_on
from workbench.config import Config, CustomModel
from workbench.tracing.estimate import estimate

BASE = dict(batch_size=4, seq_len=32)
LAYOUTS = {"dp2": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2, micro_batches=2),
           "dp2 zero3 full recompute": dict(dp=2, zero=3, activation_checkpointing="full"), "cp2": dict(cp=2)}
REL = 0.02
"""Issue 32's bound. Measured here: within 0.46% everywhere, the most under full recompute (the scalar loss and the
saved ids' pinned extra target position, ~540 bytes, are not traced); under tp, pp and cp within 0.02%, Gemma's
within 0.18%."""


def _sources() -> dict:
    return {**{name: family(name) for name in FAMILIES},
            "own module": CustomModel("tests.models.custom_models:tiny_gpt", plan=PLAN)}


def test_each_familys_activations_on_the_ranks_are_its_traced_estimate(pool):
    checked = []
    for name, source in _sources().items():
        for layout, degrees in LAYOUTS.items():
            if name == "mistral" and "cp" in layout:
                continue  # its sliding window (8) is shorter than the sequence: cp is refused
            cfg = Config(model=source, **BASE, **degrees)
            est = estimate(cfg, "cpu")  # traced: the model is not the built-in one
            measured = pool.run(own_fns.measured_activations, cfg)
            # Each rank against its own pipeline stage (every rank of a stage alike).
            predicted = [est.stages[rank if cfg.pp > 1 else 0].memory.activations for rank in range(2)]
            assert predicted == pytest.approx(measured, rel=REL), f"{name} {layout}"
            # What the Workbench hands the memory plot beside the measured bars: the same figures, per rank.
            drawn = predicted_memory_on(cfg, {"device": "cpu", "name": "cpu"})
            assert [drawn[rank]["activations"] for rank in range(2)] == predicted, f"{name} {layout}"
            checked.append((name, layout))
    assert len(checked) == 6 * len(LAYOUTS) - 1


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "own module"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_what_the_per_op_policy_keeps_of_a_foreign_model_is_traced(name, precision):
    """The per-op policy keeps every other matmul's output and attention's: the trace follows it op by op (no
    names: Qwen3-MoE's router is one of its matmuls, the module's own linears carry biases)."""
    cfg = Config(model=_sources()[name], batch_size=4, seq_len=64, activation_checkpointing="op", precision=precision)
    # 0.5%: measured 0.2-0.4% apart (the ids' pinned extra position, the scalar loss). Keeping every matmul's
    # output, or none of attention's, would be 10% or more off.
    assert estimate(cfg, "cpu").memory.activations == pytest.approx(kept_by_one_forward(cfg), rel=0.005)
