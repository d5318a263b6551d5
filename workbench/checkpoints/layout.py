"""Names on disk, and what counts as a checkpoint: a `step-N` directory whose COMMIT matches its manifest."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

MANIFEST, COMMIT = "manifest.json", "COMMIT"
METADATA = ".metadata"
"""DCP's index of the tensors, the one file of a checkpoint beside its manifest and commit marker."""
FINAL = re.compile(r"^step-(\d{6,})$")
STALE = re.compile(r"^\.step-\d{6,}\.(tmp|old)-[0-9a-f]+$")
"""A save in progress or interrupted (`tmp`), or a checkpoint being replaced by a save of the same step (`old`)."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded (missing, incomplete, corrupt, unsafe, or for another model)."""


def final_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def temp_dir(root: str | Path, step: int, nonce: str) -> Path:
    return Path(root) / f".step-{step:06d}.tmp-{nonce}"


def finals(root: Path) -> list[tuple[int, Path]]:
    """Every directory under `root` named as a finished checkpoint (`step-N`), intact or not, oldest first.

    A save only ever gives a directory that name by renaming it after its commit
    marker is down, so one of these without a valid marker was damaged afterwards.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), c) for c in root.iterdir() if (m := FINAL.match(c.name)) and c.is_dir())


def complete(root: str | Path) -> list[tuple[int, Path]]:
    """The committed checkpoints under `root`, oldest first."""
    return [(step, path) for step, path in finals(Path(root)) if is_committed(path)]


def is_committed(directory: Path) -> bool:
    try:
        marker = (directory / COMMIT).read_text().strip()
        return marker == sha256_file(directory / MANIFEST)
    except OSError:
        return False


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
