"""workbench: an interactive workbench for distributed training, driven from Jupyter.

    import workbench as wb
    bench = wb.Workbench(world_size=2)
    bench.apply(wb.Config(dp=2))
    bench.train(steps=100).wait()
"""

from workbench.config import Config, ConfigError, ModelConfig
from workbench.emulation import Cluster
from workbench.estimate import Estimate
from workbench.hardware import Hardware
from workbench.plan import Plan
from workbench.tracing.estimate import estimate, plan
from workbench.pool import CollectiveTimeout, Handle, Pool, PoolBroken, PoolError, RankFrozen, RemoteError, WorkerDied
from workbench.telemetry.events import Interval, StepMetrics
from workbench.telemetry.runs import LayoutChange
from workbench.workbench import Run, Workbench

__all__ = ["Config", "ConfigError", "ModelConfig", "Pool", "Handle", "PoolError", "PoolBroken", "WorkerDied",
           "RemoteError", "CollectiveTimeout", "RankFrozen", "StepMetrics", "Interval", "Workbench", "Run", "LayoutChange", "estimate", "Estimate",
           "Hardware", "plan", "Plan", "Cluster"]
__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    """`%load_ext workbench`: the %%ranks cell magic (imported lazily: ranks never load IPython)."""
    from workbench.ui.magics import load_ipython_extension as load

    load(ipython)


def _prepare_ahead_in_a_kernel() -> None:
    # In a notebook, the Workbench of a later cell then forks ranks already prepared: about 0.1 s instead of ~6.
    from workbench.kernel import in_kernel
    from workbench.workbench import prepare_ahead

    if in_kernel():
        try:
            prepare_ahead()
        except Exception:  # noqa: BLE001 - a head start, never a reason for the import to fail
            import logging

            logging.getLogger("workbench").warning("could not prepare ranks ahead", exc_info=True)


_prepare_ahead_in_a_kernel()
