"""How a run's ranks are spread over machines, and what its training entry point is asked to do: the one shape
every exported launch file (torchrun, Slurm, accelerate, torchtitan) is written from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from workbench.config import Config


Device = Literal["cuda", "cpu"]


@dataclass(frozen=True)
class Launch:
    """How the ranks of a run are spread over machines, and what the training entry point is asked to do."""

    nnodes: int
    """Machines."""
    nproc_per_node: int
    """Ranks per machine: one per GPU on CUDA."""
    device: Device = "cuda"
    """"cuda" (NCCL, one GPU per rank) or "cpu" (gloo)."""
    steps: int = 1000
    """Optimizer steps the run trains."""
    save_every: int = 100
    """Checkpoint every this many steps (into ckpt/ beside config.json)."""
    async_save: bool = False
    """Write those checkpoints in the background while training goes on (torchtitan's checkpoint.async_mode)."""
    port: int = 29500
    """Rendezvous port on the first node."""
    corpus: str | None = None
    """The folder or file of text the run trains on (`Workbench(corpus=...)`, as an absolute path); None: the
    Python standard library's source."""

    def __post_init__(self) -> None:
        for name in ("nnodes", "nproc_per_node", "steps", "save_every", "port"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if not isinstance(self.async_save, bool):
            raise ValueError(f"async_save: must be True or False, got {self.async_save!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device: {self.device!r} is not 'cuda' or 'cpu'")
        if self.corpus is not None:  # the launch runs elsewhere, from the export's folder: never a relative path
            object.__setattr__(self, "corpus", str(Path(self.corpus).expanduser().resolve()))

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @classmethod
    def for_config(cls, cfg: Config, *, gpus_per_node: int = 8, device: Device = "cuda", **kwargs) -> "Launch":
        """Fill whole nodes of `gpus_per_node` ranks; a world smaller than a node runs on one node."""
        world = cfg.world_size
        per_node = min(gpus_per_node, world)
        if world % per_node:
            raise ValueError(f"gpus_per_node: the layout needs {world} ranks (dp·cp·tp·pp), which {per_node} ranks per "
                             f"node do not divide; choose gpus_per_node dividing {world}")
        return cls(nnodes=world // per_node, nproc_per_node=per_node, device=device, **kwargs)
