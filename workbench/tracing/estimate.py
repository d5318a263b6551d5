"""`wb.estimate` and `wb.plan` for any model: the built-in one by its formulas, any other traced first.

A model is traced once per shape, sequence length and precision (`traced_profile`, cached for the kernel's life),
and its profile is handed to the pure estimator (`workbench.estimate.estimate(..., traced=...)`), which
applies the layout's sharding, recompute, schedule and link arithmetic to it as it does to the built-in model.
torch is imported only when a model is traced.
"""

from __future__ import annotations

import functools
from typing import Any

from workbench.config import Config, ConfigError, ModelConfig
from workbench.estimate import Estimate
from workbench.estimate import estimate as estimate_from
from workbench.estimate.options import NO_FEATURES, Features
from workbench.estimate.stage import traced_precision
from workbench.hardware import Hardware
from workbench.model_profile import ModelProfile
from workbench.plan import Plan
from workbench.plan import plan as plan_from


@functools.lru_cache(maxsize=32)
def traced_profile(model: Any, seq_len: int, precision: str = "fp32") -> ModelProfile:
    """The profile of `model` (a ModelConfig, or any model source Config.model takes) for one sequence of
    `seq_len` tokens at `precision` ("fp32" or "low"), traced on fake tensors; cached per (model, seq_len,
    precision): the dashboard re-estimates on every change without tracing again."""
    from workbench.tracing.trace import trace

    try:
        return trace(_builder(model), seq_len=seq_len, precision=precision, name=_name(model))
    except Exception as e:
        if isinstance(model, ModelConfig):
            raise  # the built-in model always traces: a failure here is the workbench's, with its traceback
        # A model of the user's that fails one forward and backward on fake tensors would fail on the ranks too.
        mode = {"fp32": "in fp32", "low": "under bf16 autocast", "bf16_params": "with bf16 parameters"}[precision]
        raise ConfigError(f"model: {_name(model)} failed one forward and backward {mode} on fake tensors, which "
                          f"the estimate traces ({type(e).__name__}: {e}); its ranks would fail the same way. Fix: "
                          "make the model run in that precision, or estimate another precision") from e


def _builder(model: Any):
    """How to build `model` on the meta device, as the ranks do: the model sources' own `build`."""
    from workbench.models.build import build  # any Config.model source

    return lambda: build(model, 0).model


def _name(model: Any) -> str:
    return getattr(model, "name", None) or type(model).__name__


def estimate(cfg: Config, hardware: str | Hardware = "h100", *, efficiency: float | None = None,
             features: Features = NO_FEATURES, trace: bool | None = None) -> Estimate:
    """Predicted per-rank memory, FLOPs, communication and step time of `cfg` on `hardware` (`workbench.estimate`'s
    docs), for any model. trace: None traces every model but the built-in one (whose formulas are exact); True
    traces the built-in one too (what the tests hold to its formulas), False never traces."""
    traced = _traced(cfg.model, cfg.seq_len, traced_precision(cfg), trace)
    return estimate_from(cfg, hardware, efficiency=efficiency, features=features, traced=traced)


def plan(model: Any, hardware: str | Hardware = "h100", gpus: int = 8, global_batch: int = 64, *,
         seq_len: int = 2048, precision: str = "bf16", trace: bool | None = None,
         traced: Any = None, **kwargs: Any) -> Plan:
    """Every valid layout of `model` on `gpus` devices ranked by predicted step time (`workbench.plan`'s docs), for
    any model: one trace per precision the candidates run in serves them all (they share the sequence length).
    traced: profiles already made (`workbench.plan.plan`'s), read instead of tracing `model`."""
    model = ModelConfig.preset(model) if isinstance(model, str) else model
    if traced is None and (not isinstance(model, ModelConfig) if trace is None else trace):
        traced = _failing_once(functools.partial(traced_profile, model, seq_len))
    return plan_from(model, hardware, gpus, global_batch, seq_len=seq_len, precision=precision, traced=traced,
                     **kwargs)


def _failing_once(profile_of):
    """`profile_of(precision)`, where a precision the model failed in fails again at once: the cache keeps only
    profiles, and a plan asks once per candidate (hundreds of them train in that precision)."""
    failed: dict[str, ConfigError] = {}

    def traced(precision: str) -> ModelProfile:
        if precision in failed:
            raise failed[precision]
        try:
            return profile_of(precision)
        except ConfigError as e:
            failed[precision] = e
            raise

    return traced


def _traced(model: Any, seq_len: int, precision: str, trace: bool | None) -> ModelProfile | None:
    if trace is None:
        trace = not isinstance(model, ModelConfig)
    return traced_profile(model, seq_len, precision) if trace else None
