"""Live reshards into and out of context parallel and HSDP continue training with the same losses.

cp changes only how each sequence is split and how attention reads it; the state a reshard carries (weights,
AdamW moments, counters) is the same full state as for any layout, and under ZeRO it is sharded over dp·cp. So a
chain through cp and HSDP must be invisible: losses of every step within 1e-5 relative of one process training
straight through (as test_reshard), and export(import(state)) exactly the state imported.
"""

from __future__ import annotations

import pytest

from tests.engine import rank_fns as fns
from tests.engine.test_reshard import check_chain, plan

CHAIN = plan((dict(dp=4, zero=3, dp_replicate=2), 2), (dict(dp=2, cp=2, zero=1), 2), (dict(cp=2, tp=2), 2),
             (dict(dp=4, zero=2, dp_replicate=2), 2))


@pytest.mark.slow  # ~30 s on 2 loaded cores: four layouts built, three reshards
def test_four_ranks_through_hsdp_and_context_parallel_and_back(pool4):
    """HSDP ZeRO-3 → cp·dp ZeRO-1 (optimizer sharded over dp·cp) → cp·tp → HSDP ZeRO-2."""
    check_chain(pool4.run(fns.train_through_layouts, CHAIN), CHAIN)
