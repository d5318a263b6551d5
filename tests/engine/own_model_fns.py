"""Rank functions for the foreign-model tests: train a layout, then write the model as a Hugging Face checkpoint."""

from __future__ import annotations

from typing import Any

from workbench.config import Config
from workbench.engine.export_hf import export_hf

from workbench.engine.mesh import build_mesh
from workbench.engine.trainer import Trainer

from tests.engine.rank_fns import _trainer, unchecked
from tests.models.families import data_of


@unchecked
def train(cfg: Config, steps: int) -> dict[str, Any]:
    """rank_fns.train, on `data_of(cfg)`'s batches (a user's module does not say its vocabulary before it is built)."""
    trainer = Trainer(cfg, build_mesh(cfg, "cpu"), "cpu", data_of(cfg))
    return {"losses": [trainer.step(i).loss for i in range(steps)]}


@unchecked
def train_and_export(cfg: Config, steps: int, directory: str) -> dict[str, Any]:
    """Train `steps` steps of `cfg`'s layout from its initial values (its weights, if any), then export_hf."""
    trainer = _trainer(cfg)
    losses = [trainer.step(i).loss for i in range(steps)]
    return {"losses": losses, "files": export_hf(trainer, directory, 5 * 2**30)}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


@unchecked
def build_memory(cfg: Config) -> dict[str, int]:
    """What building `cfg`'s trainer costs this rank at its peak, beside the bytes of the parameters it holds.

    Measured by the kernel, not by us. A first build warms the process (the modules a layout imports, torch's lazy
    set-ups: costs of the process, not of the model) and is dropped; freed heap memory is returned to the system
    (malloc_trim), the process's peak resident size is reset (/proc/self/clear_refs, 5), the trainer is built
    again, and the new peak (VmHWM) less the resident size before is what the build needed at its most."""
    import ctypes
    import gc

    import torch.distributed as dist

    from workbench.engine.reshard_direct import local_tensor

    def trainer() -> Trainer:
        return Trainer(cfg, build_mesh(cfg, "cpu"), "cpu", data_of(cfg))

    warm = trainer()
    del warm
    gc.collect()
    dist.barrier()
    ctypes.CDLL(None).malloc_trim(0)
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    built = trainer()
    peak = _status_kib("VmHWM")
    shard = sum(local_tensor(p).numel() * p.element_size() for m in built.modules for p in m.parameters())
    return {"peak_bytes": (peak - before) * 1024, "shard_bytes": shard}


@unchecked
def measured_activations(cfg: Config, steps: int = 2) -> int:
    """This rank's peak of saved activations over `steps` steps of `cfg`'s layout, as its probe (the
    ActivationMeter) measures them: what the estimate's `memory.activations` predicts."""
    trainer = Trainer(cfg, build_mesh(cfg, "cpu"), "cpu", data_of(cfg), telemetry=True)
    peaks = [trainer.step(i).peak_memory["activations"] for i in range(steps)]
    trainer.close()
    return max(peaks)
