"""Save options, checked in the notebook before any rank is asked."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from workbench.checkpoints.layout import CheckpointError


@dataclass(frozen=True)
class SaveSchedule:
    """Periodic saves during `train()`: every `every` steps into `directory`, keeping the last `keep`."""

    every: int
    directory: str
    keep: int | None = None
    asynchronous: bool = False
    """Stage each save to host memory and write it in the background while training goes on (DCP `async_save`);
    the run waits for the last one before it ends, so a finished run's checkpoints are all durable."""
    nonce: str = field(default_factory=lambda: secrets.token_hex(4))
    """Names this run's temporary directories, so ranks agree on them without a round trip."""

    def __post_init__(self) -> None:
        check_options(self.every, self.keep)
        if not isinstance(self.asynchronous, bool):
            raise ValueError(f"async_save: must be True or False, got {self.asynchronous!r}")


def check_options(every: int | None = None, keep: int | None = None) -> None:
    for name, value in (("save_every", every), ("keep", keep)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def schedule(save_every: int | None, save_to: str | Path | None, keep: int | None = None,
             asynchronous: bool = False) -> SaveSchedule | None:
    """The periodic saves `bench.train(steps, save_every=N, save_to="ckpt/")` asks for; None for none."""
    if save_every is None:
        if save_to is not None or keep is not None or asynchronous:
            raise ValueError("save_to/keep/async_save: given without save_every; pass save_every=N to save every "
                             "N steps")
        return None
    if save_to is None:
        raise ValueError("save_to: periodic saves need a directory, e.g. save_to=\"ckpt/\"")
    return SaveSchedule(save_every, str(writable_directory(save_to)), keep, asynchronous)


def writable_directory(path: str | Path) -> Path:
    """`path` made absolute and created if need be; refused now, not on the ranks mid-save, if it cannot be written."""
    directory = Path(path).expanduser().absolute()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot save to {directory}: {e.strerror or e}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot save to {directory}: not writable")
    return directory
