"""ZeRO 1's optimizer, torch's ZeroRedundancyOptimizer, built and recognised without importing it up front.

Importing `torch.distributed.optim` compiles its functional optimizers with TorchScript: ~0.18 s of the ~2 s
a rank's preparation takes (benches/first_cell.py), which every start paid though only zero=1 uses it. So
it is imported where ZeRO 1 builds its optimizer, and an optimizer that is one proves the module is loaded.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

_MODULE = "torch.distributed.optim.zero_redundancy_optimizer"


def zero_redundancy(params: Iterable[torch.nn.Parameter], optimizer_class: type[torch.optim.Optimizer],
                    process_group: Any, **hyper: Any) -> ZeroRedundancyOptimizer:
    """`optimizer_class` over `params`, each rank of `process_group` keeping and updating its share of the state."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=process_group, **hyper)


def is_zero_redundancy(opt: object) -> bool:
    """Whether `opt` is a ZeroRedundancyOptimizer (never imports torch.distributed.optim to say no)."""
    module = sys.modules.get(_MODULE)
    return module is not None and isinstance(opt, module.ZeroRedundancyOptimizer)


def local_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that steps this rank's parameters: ZeRO 1's inner one, or `opt` itself."""
    return opt.optim if is_zero_redundancy(opt) else opt
