"""A Workbench's emulated cluster, from the notebook: shaped once for its ranks, installed on them, told each layout's
target compute, and taken off again.

    bench = wb.Workbench(2, cluster=wb.Cluster("h100-25gbe", nodes=2))
    bench.emulate("a100-ib"); bench.links; bench.emulate(None)

The ranks' side is `workbench.emulation.rank` (pacing under the recording backend); the estimator runs here, never
on a rank: under a measured time dilation the ranks are sent the cluster GPU's compute of each pipeline stage
(`workbench.emulation.predict.stage_compute_s`) when a layout is applied or the cluster installed.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from typing import TYPE_CHECKING

from workbench.config import Config, ConfigError
from workbench.emulation import Cluster, status_line
from workbench.emulation import rank as emulation
from workbench.emulation.cluster import emulation_for
from workbench.emulation.predict import stage_compute_s
from workbench.pool import Pool

if TYPE_CHECKING:
    from workbench.rank_session import RankSession


class Emulation:
    """The cluster a Workbench's ranks stand for (None: this machine's own links), and the commands that make them."""

    def __init__(self, pool: Pool, session: "RankSession", cluster: Cluster | None, telemetry: bool) -> None:
        self.pool, self.session, self.telemetry = pool, session, telemetry
        self.cluster = cluster
        """Shaped for this pool's ranks (`shaped`, here, once); None when the links are this machine's own."""
        # Where the ranks share when each issued each collective, under emulation (removed with its Workbench).
        self.arrivals = tempfile.mkdtemp(prefix="workbench-links-")
        weakref.finalize(self, shutil.rmtree, self.arrivals, True)

    @staticmethod
    def shaped(cluster: Cluster | str | None, world_size: int, telemetry: bool) -> Cluster | None:
        """A Workbench's `cluster=` checked and shaped for its `world_size` ranks, before any rank is started."""
        return emulation_for(cluster, world_size, telemetry)

    @staticmethod
    def check(cfg: Config, cluster: Cluster | None) -> None:
        """Refuse `cfg` where a measured dilation cannot be had for it on `cluster`: the cluster GPU's compute of its
        stages, which the dilation divides by, is not estimated."""
        if cluster is None or cluster.dilation is not None:
            return
        try:
            stage_compute_s(cfg, cluster)
        except ValueError as e:
            raise ConfigError(f"cluster: the {cluster.gpu.name}'s compute of {cfg.layout}, which the "
                              f"measured time dilation divides by, cannot be estimated: {e}. Fix: "
                              "wb.Cluster(..., dilation=<a number>), or a layout that GPU runs") from None

    def change(self, cluster: Cluster | str | None, config: Config | None) -> None:
        """Stand for `cluster` from now on (None: this machine's own links); `config`: the layout on the ranks."""
        self.cluster = self.shaped(cluster, self.pool.world_size, self.telemetry)
        if self.cluster is None:
            self.pool.run(emulation.uninstall)
        else:
            self.install(config)

    def install(self, config: Config | None) -> None:
        """Pace the ranks' collectives as the cluster's (fresh ranks run on their own links until told)."""
        self.pool.run(emulation.install, self.cluster, self.arrivals)
        self.session.observe_steps(emulation.after_step)  # the dilation measured, and each step marked with it
        if self.pool.run(emulation.status)[0]["arrivals"] != "shared":  # ranks on several hosts estimate them
            self.pool.run(emulation.calibrate)
        if config is not None:
            self.applied(config)

    def applied(self, cfg: Config) -> None:
        """`cfg` is the layout on the ranks now: under a measured time dilation, tell them what the cluster's GPU
        computes a step of each of its pipeline stages in (estimated here, once per layout)."""
        if self.cluster is not None and self.cluster.dilation is None:
            self.pool.run(emulation.set_targets, cfg, stage_compute_s(cfg, self.cluster))

    def line(self, last_dilation: float | None) -> str:
        """Whether a cluster is emulated, which, and the dilation the ranks paced their last step with."""
        if self.cluster is None:
            return status_line(None)
        return status_line(self.cluster, self.cluster.dilation or last_dilation)

    def close(self, pool_closed: bool) -> None:
        """A shared pool (one the Workbench did not start, which lives on) goes back to its own links."""
        if not pool_closed and self.cluster is not None and not self.pool.broken:
            self.pool.run(emulation.uninstall)
        shutil.rmtree(self.arrivals, ignore_errors=True)
