"""The one table of controls: each row is a Config field, the widget that edits it, when it applies and what it means.

`Controls` (ui/controls.py) builds its inputs, its layout, the Config they describe, `set_config` and the
explanation lines from `CONTROLS` alone, as `plan.py` builds its search from its axes; nothing else lists
the fields. Config fields without a row (seed, weight_decay, ...) are carried over unchanged.

Adding a control is one row (after `git merge main`, when the field exists in Config):

    Control("cp", "layout", degree("cp", "context-parallel degree: the sequence split across this many ranks")),
    Control("compile", "training", flag("torch.compile"), help=lambda v: COMPILE_HELP if v.compile else None),

- `name`: the widget's attribute on Controls (`controls.cp`) and, unless `field` says otherwise, the Config field;
  `field="model.top_k"` edits a field of the chosen model (or of any nested config: a dotted path).
- `line`: the line of the controls it sits on; lines appear in the order they are first named.
- `make`: a widget factory (`degree`, `toggle`, `dropdown`, `integer`, `number`, `flag` below); the choices of a
  `Literal` field come from Config's own type hints (`toggle("precision", choices("precision"))`), so a new
  precision or schedule appears without touching this file.
- `help(v)`: a line explaining the current values (`v.zero`, `v.dp`, `v.model`, ... by Config field name),
  or None; the texts themselves live beside Config (`workbench.config`'s *_HELP).
- `active(v)`: whether the input applies to the values; an inactive input is greyed out and leaves its field
  as the shown Config has it (the routing of a dense model, the schedule without a pipeline).
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import ipywidgets as widgets

from workbench.config import ASYNC_TP_HELP, COMPILE_HELP, COMPRESSION_HELP, CUDA_GRAPHS_HELP, FP8, OFFLOAD_HELP
from workbench.config import OPTIMIZER_HELP
from workbench.config import PRECISION_HELP, RECOMPUTE_HELP, SCHEDULE_HELP, ZERO_HELP, Config, ModelConfig, divisors
from workbench.schedules import MULTI_STAGE

Values = SimpleNamespace
"""What the inputs describe, by Config field name (`v.dp`, `v.model`), before Config validates it."""
Factory = Callable[[int], widgets.ValueWidget]
"""Makes a control's widget, given the pool's world size."""

_LABEL = {"description_width": "initial"}


@dataclass(frozen=True)
class Control:
    """One row of the table: a Config field and its widget (see the module docstring for each part)."""

    name: str
    line: str
    make: Factory
    field: str = ""
    help: Callable[[Values], str | None] = lambda v: None
    active: Callable[[Values], bool] = lambda v: True

    @property
    def path(self) -> tuple[str, ...]:
        """The Config field as attribute names: ("dp",) or ("model", "top_k")."""
        return tuple((self.field or self.name).split("."))


# -- widget factories -------------------------------------------------------------------------------------
def choices(field: str) -> tuple:
    """The values a `Literal`-typed Config field allows, from Config's own type hints."""
    allowed = typing.get_args(typing.get_type_hints(Config)[field])
    if not allowed:
        raise TypeError(f"Config.{field} is not a Literal: give its choices explicitly")
    return allowed


def toggle(label: str, options: tuple | list, tooltip: str = "") -> Factory:
    def make(world: int) -> widgets.ToggleButtons:
        return widgets.ToggleButtons(description=label, options=list(options), tooltips=[tooltip] * len(options),
                                     style=dict(_LABEL, button_width="auto"), layout=widgets.Layout(width="auto"))
    return make


def degree(label: str, tooltip: str) -> Factory:
    """A parallel degree: a toggle of the divisors of the world size."""
    return lambda world: toggle(label, divisors(world), tooltip)(world)


def dropdown(label: str, options: tuple | list, width: int, tooltip: str = "") -> Factory:
    return lambda world: widgets.Dropdown(description=label, options=list(options), style=_LABEL,
                                          tooltip=tooltip, layout=widgets.Layout(width=f"{width}px"))


def integer(label: str, low: int, high: int, width: int) -> Factory:
    return lambda world: widgets.BoundedIntText(description=label, min=low, max=high, style=_LABEL,
                                                layout=widgets.Layout(width=f"{width}px"))


def number(label: str, step: float, width: int) -> Factory:
    return lambda world: widgets.FloatText(description=label, step=step, style=_LABEL,
                                           layout=widgets.Layout(width=f"{width}px"))


def flag(label: str, width: int = 240) -> Factory:
    return lambda world: widgets.Checkbox(description=label, indent=False, layout=widgets.Layout(width=f"{width}px"))


# -- help that depends on more than one value ---------------------------------------------------------------
def _zero_help(v: Values) -> str:
    if v.dp == 1:
        # ZERO_HELP[0] speaks of all-reduced gradients: with dp = 1 there is none, whatever tp and pp do.
        return "dp = 1: no data-parallel replicas, so no gradient all-reduce and nothing for ZeRO to shard"
    return ZERO_HELP[v.zero]


def _moe(v: Values) -> bool:
    """The built-in model's routing settings apply (another model routes as its own config or code says)."""
    return isinstance(v.model, ModelConfig) and bool(v.model.n_experts)


def _moe_help(v: Values) -> str | None:
    m = v.model
    if not m.n_experts:
        return None
    split = (f"ep={v.ep}: experts split over that many dp ranks, tokens sent to them by all-to-all" if v.ep > 1
             else "ep=1: every dp rank holds every expert")
    if not isinstance(m, ModelConfig):
        return f"mixture of experts: {m.n_experts} experts, routed as the model's own config says; " + split
    return (f"mixture of experts: {m.n_experts} experts, top-{m.top_k}, each expert takes at most "
            f"{m.expert_capacity(v.seq_len)} of a sequence's assignments (capacity factor {m.capacity_factor}); "
            + split)


def _cp_help(v: Values) -> str | None:
    if v.cp == 1:
        return None
    share = v.seq_len // (2 * v.cp)
    return (f"cp={v.cp}: each rank holds {2 * share} of the {v.seq_len} tokens of every sequence (2 balanced chunks "
            f"of {share}), so its activations are 1/{v.cp}; keys and values go round the cp ring in every attention, "
            "and the cp ranks average their gradients with the dp ranks")


def _hsdp_help(v: Values) -> str | None:
    if v.dp_replicate == 1 or v.zero < 2 or v.dp % v.dp_replicate:
        return None
    return (f"HSDP: {v.dp_replicate} replica groups of {v.dp // v.dp_replicate} ranks; FSDP2 shards within a group "
            "(reduce-scatter) and all-reduces the shards across the groups")


CONTROLS: tuple[Control, ...] = (
    Control("dp", "layout", degree("dp", "data-parallel degree")),
    Control("tp", "layout", degree("tp", "tensor-parallel degree")),
    Control("pp", "layout", degree("pp", "pipeline-parallel degree")),
    Control("cp", "layout", degree("cp", "context-parallel degree: each sequence split across this many ranks"),
            help=_cp_help),
    Control("zero", "layout", toggle("ZeRO", (0, 1, 2, 3), "ZeRO stage across the dp ranks"), help=_zero_help),
    Control("dp_replicate", "layout", degree("HSDP replicas", "zero 2/3: dp ranks in this many replica groups, "
                                             "FSDP2 sharding within each"), help=_hsdp_help),
    Control("schedule", "pipeline", dropdown("schedule", choices("schedule"), 210),
            help=lambda v: SCHEDULE_HELP[v.schedule] if v.pp > 1 else None, active=lambda v: v.pp > 1),
    Control("micro_batches", "pipeline", integer("micro-batches", 1, 1024, 150)),
    Control("stages_per_rank", "pipeline", integer("stages/rank", 1, 64, 140),
            active=lambda v: v.pp > 1 and v.schedule in MULTI_STAGE),
    Control("recompute", "pipeline", toggle("recompute", choices("activation_checkpointing"),
                                             "activation checkpointing"),
            field="activation_checkpointing", help=lambda v: RECOMPUTE_HELP[v.activation_checkpointing]),
    Control("precision", "pipeline", toggle("precision", choices("precision"), "compute precision"),
            help=lambda v: PRECISION_HELP[v.precision] if v.precision in FP8 else None),
    Control("batch_size", "training", integer("batch", 1, 1 << 20, 130)),
    Control("seq_len", "training", integer("seq_len", 1, 1 << 20, 140)),
    Control("lr", "training", number("lr", 1e-4, 140)),
    Control("compression", "training", dropdown("compression", choices("compression"), 210,
                                                "compression of the data-parallel gradient sync"),
            help=lambda v: COMPRESSION_HELP[v.compression] if v.compression != "none" else None),
    Control("offload", "training", flag("offload optimizer (ZeRO-Offload)"),
            help=lambda v: OFFLOAD_HELP if v.offload else None),
    Control("optimizer", "compiler", toggle("optimizer", choices("optimizer"), "the optimizer"),
            help=lambda v: OPTIMIZER_HELP[v.optimizer] if v.optimizer != "adamw" else None),
    Control("compile", "compiler", flag("torch.compile", 150), help=lambda v: COMPILE_HELP if v.compile else None),
    Control("cuda_graphs", "compiler", flag("CUDA Graphs", 150),
            help=lambda v: CUDA_GRAPHS_HELP if v.cuda_graphs else None, active=lambda v: v.compile),
    Control("async_tp", "compiler", flag("async TP", 120), help=lambda v: ASYNC_TP_HELP if v.async_tp else None,
            active=lambda v: v.tp > 1 and v.compile),
    Control("fp8_all_gather", "compiler", flag("fp8 all-gather", 150),
            active=lambda v: v.precision == "fp8_tensorwise" and v.zero >= 2),
    Control("ep", "experts", degree("ep", "expert-parallel degree: experts split across this many of the dp ranks"),
            help=_moe_help),
    Control("expert_exchange", "experts", dropdown("exchange", choices("expert_exchange"), 190,
                                                   "how tokens reach their experts: one all-to-all, or node by node"),
            active=lambda v: v.ep > 1),
    Control("top_k", "experts", integer("top-k", 1, 1024, 110), field="model.top_k", active=_moe),
    Control("capacity_factor", "experts", number("capacity factor", 0.25, 170), field="model.capacity_factor",
            active=_moe),
    Control("aux_loss_coef", "experts", number("aux loss coef", 0.01, 160), field="model.aux_loss_coef",
            active=_moe),
)
"""Every Config field the dashboard edits, in the order shown (the model's choice itself is Controls' own)."""


def read(obj: Any, path: tuple[str, ...]) -> Any:
    """`obj.a.b` for path ("a", "b")."""
    for name in path:
        obj = getattr(obj, name)
    return obj
