"""Generated Configs (hypothesis): each one is refused naming a field and a fix, or it is a valid run.

Values are drawn from choices that combine into valid and invalid layouts
alike, and at most one value that no layout takes (a float for an int, NaN, a
string, out of range) is put in: that one must be refused by its own name.
Many examples are validated in pure code; a few accepted world-2 layouts of a
tiny model train one step on the session's 2-rank pool, every loss finite.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from tests.engine import rank_fns as fns
from workbench.config import Config, ConfigError, ModelConfig

NAN, INF = float("nan"), float("inf")
FIELDS = {f.name for f in dataclasses.fields(Config)} | {"model." + f.name for f in dataclasses.fields(ModelConfig)} \
    | {"dp·tp·pp"}

MODEL_CHOICES = {  # small shapes; some combinations are refused (heads vs dim, experts vs ep, ...)
    "dim": [32, 64, 96], "n_layers": [1, 2, 4], "n_heads": [2, 4], "n_kv_heads": [None, 1, 2],
    "vocab_size": [256, 320], "ffn_dim": [None, 64, 96], "max_seq_len": [32, 256], "norm_eps": [1e-5, 1e-6],
    "rope_theta": [10000.0, 500], "n_experts": [0, 0, 2, 4], "top_k": [1, 2, 3], "capacity_factor": [1.0, 2],
    "aux_loss_coef": [0.0, 0.01], "moe_every": [1, 2], "shared_expert": [False, True],
}
RUN_CHOICES = {
    "dp": [1, 2], "tp": [1, 2], "pp": [1, 2], "ep": [1, 2], "zero": [0, 1, 2, 3],
    "schedule": ["gpipe", "1f1b", "interleaved_1f1b"], "micro_batches": [1, 2, 4], "stages_per_rank": [1, 2],
    "activation_checkpointing": ["none", "selective", "full"], "precision": ["fp32", "bf16", "fp16"],
    "batch_size": [4, 8, 6], "seq_len": [16, 32, 33], "lr": [3e-3, 1e-3], "weight_decay": [0.0, 0.1],
    "seed": [0, 7, -3], "compression": ["none", "fp16", "bf16", "powersgd", "int8", "1bit"],
    "powersgd_rank": [1, 2], "offload": [False, False, True],
}
BAD = [  # (field, a value no layout takes)
    *[("model." + f, v) for f, vs in {
        "dim": [64.0, True, 0], "n_layers": [2.5, 0], "n_heads": [1.0], "n_kv_heads": [False, 0],
        "vocab_size": [10, 256.0], "ffn_dim": [0, "64"], "max_seq_len": [2**40, -1],
        "norm_eps": [0.0, -1.0, NAN], "rope_theta": [0, INF], "n_experts": [-1], "top_k": [0],
        "capacity_factor": [NAN, 0], "aux_loss_coef": [-0.1, INF], "moe_every": [0], "shared_expert": [1],
    }.items() for v in vs],
    *[(f, v) for f, vs in {
        "dp": [0, 2.0], "tp": [True], "pp": [1.0], "ep": [0], "zero": [4, True], "schedule": ["zigzag"],
        "micro_batches": [0], "stages_per_rank": [0], "activation_checkpointing": ["all"], "precision": ["fp8"],
        "batch_size": [0, 8.0], "seq_len": [-1], "lr": [0.0, NAN, INF, "0.1"], "weight_decay": [-0.1, "0"],
        "seed": [2**70, 1.5], "compression": ["zip"], "powersgd_rank": [0], "offload": ["yes", 0],
    }.items() for v in vs],
]


def _choices(table: dict) -> st.SearchStrategy:
    return st.fixed_dictionaries({name: st.sampled_from(values) for name, values in table.items()})


def _make(model: dict, run: dict) -> tuple[Config | None, str | None]:
    """The Config or None, and the field a refusal names (it must name one, and a fix)."""
    try:
        return Config(model=ModelConfig(**model), **run), None
    except ConfigError as e:
        field, _, rest = str(e).partition(": ")
        assert field in FIELDS and "Fix:" in rest, str(e)
        return None, field


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(_choices(MODEL_CHOICES), _choices(RUN_CHOICES), st.none() | st.sampled_from(BAD))
def test_every_generated_config_is_refused_by_name_or_consistent(model, run, bad):
    if bad is not None:
        field, value = bad
        if field.startswith("model."):
            model = {**model, field.removeprefix("model."): value}
        else:
            run = {**run, field: value}
    cfg, refused = _make(model, run)
    if bad is not None:
        # A bad value is refused by its own name: a field's type and range are checked before any rule across
        # fields (the model, made first, may refuse its own combination before a bad Config value is seen).
        assert refused == bad[0] or (refused.startswith("model.") and not bad[0].startswith("model.")), (bad, refused)
    elif cfg is not None:
        assert Config.from_dict(cfg.to_dict()) == cfg
        assert cfg.degrees.mesh_layout().world_size == cfg.world_size
        assert cfg.micro_batch_size * cfg.dp * cfg.micro_batches == cfg.batch_size


@pytest.mark.parametrize("degrees", [dict(dp=2, tp=1, pp=1), dict(dp=1, tp=2, pp=1), dict(dp=1, tp=1, pp=2)],
                         ids=["dp2", "tp2", "pp2"])
@settings(max_examples=3, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow,
                                 HealthCheck.function_scoped_fixture])  # the shared pool is meant to persist
@given(model=_choices(MODEL_CHOICES), run=_choices(RUN_CHOICES))
def test_an_accepted_config_trains_one_step(pool, degrees, model, run):
    cfg, _ = _make(model, {**run, **degrees})
    assume(cfg is not None)
    results = pool.run(fns.train, cfg, 1)
    assert all(math.isfinite(r["losses"][0]) for r in results)
