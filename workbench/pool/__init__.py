"""The rank pool: long-lived worker processes that notebook cells drive. It knows nothing about training."""

from workbench.pool.errors import CollectiveTimeout, PoolBroken, PoolError, RankFrozen, RemoteError, WorkerDied
from workbench.pool.pool import Handle, Pool

__all__ = ["Pool", "Handle", "PoolError", "PoolBroken", "WorkerDied", "RankFrozen", "RemoteError", "CollectiveTimeout"]
