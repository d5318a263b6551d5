"""Pipeline arithmetic as data: which layers each rank holds, who runs which action at each step, and the bubble.

Pure Python (no torch at import), so the notebook side (config, estimator,
plan, plots) and the engine share one rule without processes, and the
notebook kernel never imports torch for it. One idea per module:

- `layout`: stages per rank (`virtual_stages`), loop or V placement
  (`stages_of_rank`, `stage_rank`), the blocks of each stage (`split_layers`, `config_split`, `rank_layers`;
  even, or as Config.stage_layers gives them, e.g. `lighter_ends`, torchtitan's first and last stages lighter).
- `grid`: actions (F, B, and the split backward's I and W), the time-step ×
  rank `Grid`, `place` (each action as early as its dependencies allow) and
  `measured_grid` (the order the ranks actually ran, placed the same way).
- `orders`: each schedule's order per rank (`rank_orders`, torch-free) and its
  ideal grid (`schedule_grid`, `config_grid`).
- `torch_orders`: torch's own order, the schedule objects' `pipeline_order`
  (`orders_from_torch`, `torch_rank_orders`): the truth that `rank_orders` copies.
- `bubble`: each schedule's bubble formula, `simulate` (an order placed in
  time with given durations), and the measured bubble of timed intervals.

Cells print as torch prints its actions: "1F0" is stage 1, forward, micro-batch 0.
"""

from workbench.schedules.bubble import (
    FORMULAS,
    Durations,
    MeasuredBubble,
    Timeline,
    bubble_formula,
    ideal_bubble_fraction,
    measured_bubble,
    measured_durations,
    simulate,
)
from workbench.schedules.grid import KINDS, Action, ActionInterval, Grid, Kind, measured_grid, measured_orders, place
from workbench.schedules.layout import (
    MULTI_STAGE,
    SPLIT_BACKWARD,
    V_SHAPED,
    Placement,
    config_rank_stages,
    config_split,
    config_stages,
    lighter_ends,
    placement,
    rank_layers,
    rank_stage_layers,
    split_layers,
    splits_backward,
    stage_rank,
    stages_of_rank,
    virtual_stages,
)
from workbench.schedules.orders import SCHEDULES, config_grid, rank_orders, schedule_grid
from workbench.schedules.torch_orders import TORCH_CLASSES, orders_from_torch, torch_rank_orders

__all__ = [
    "FORMULAS", "KINDS", "MULTI_STAGE", "SCHEDULES", "SPLIT_BACKWARD", "TORCH_CLASSES", "V_SHAPED",
    "Action", "ActionInterval", "Durations", "Grid", "Kind", "MeasuredBubble", "Placement", "Timeline",
    "bubble_formula", "config_grid", "config_rank_stages", "config_split", "config_stages", "ideal_bubble_fraction",
    "lighter_ends", "measured_bubble", "measured_durations", "measured_grid", "measured_orders", "orders_from_torch",
    "place", "placement", "rank_layers", "rank_orders", "rank_stage_layers", "schedule_grid", "simulate",
    "split_layers", "splits_backward", "stage_rank", "stages_of_rank", "torch_rank_orders", "virtual_stages",
]
