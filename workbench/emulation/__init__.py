"""A cluster on a laptop: real collectives paced to what an emulated cluster's links would take (issue 19).

`Cluster` (pure) says what is emulated; `workbench.emulation.rank` runs on the ranks and tells the compiled
recording backend (extensions/telemetry/emulation*) each group's cost; the link arithmetic is
`workbench.links`, the same the estimator uses.
"""

from workbench.emulation.cluster import Cluster, status_line

__all__ = ["Cluster", "status_line"]
