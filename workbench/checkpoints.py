"""Checkpoints on disk: their layout, manifest and atomic commit, and how a load finds the latest complete one.

    ckpt/
      step-000120/              complete: the data position (next step) is 120
        .metadata               torch.distributed.checkpoint's index of the shards
        __0_0.distcp  ...       the shards, one file per rank
        manifest.json           SHA-256 of every file above; Config, counters, loss scale (JSON: nothing to unpickle)
        COMMIT                  SHA-256 of manifest.json, written last
      .step-000150.tmp-3f9a1c/  a save in progress, or one that was interrupted: never loaded, removed by the next save

A save writes everything into the hidden temporary directory, fsyncs it, and
only then renames it to `step-N`; a rename within one directory is atomic, so
an interrupted save (before, during or after the shards, before the commit
marker) leaves the checkpoints already there as they were. A directory counts
as a checkpoint only under its final name, with a COMMIT that matches its
manifest; `load("ckpt/")` takes the highest step among those and checks every
file's digest before a rank reads it.

This module is the on-disk format only, pure (no torch, no processes): the
notebook uses it to check save options and to pick and verify a checkpoint,
rank 0 to commit one. The shards themselves are `workbench.engine.checkpoint`'s
(DCP); `Workbench.save/load` send the session's `save`/`load` commands.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.config import Config, ModelConfig

FORMAT = 1
"""Bumped when the layout or the manifest's meaning changes; older formats are refused, not misread."""
MANIFEST, COMMIT = "manifest.json", "COMMIT"
_FINAL = re.compile(r"^step-(\d{6,})$")
_STALE = re.compile(r"^\.step-\d{6,}\.(tmp|old)-[0-9a-f]+$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded (missing, incomplete, corrupt, unsafe, or for another model)."""


@dataclass(frozen=True)
class SaveSchedule:
    """Periodic saves during `train()`: every `every` steps into `directory`, keeping the last `keep`."""

    every: int
    directory: str
    keep: int | None = None
    nonce: str = field(default_factory=lambda: secrets.token_hex(4))
    """Names this run's temporary directories, so ranks agree on them without a round trip."""

    def __post_init__(self) -> None:
        check_options(self.every, self.keep)


def check_options(every: int | None = None, keep: int | None = None) -> None:
    for name, value in (("save_every", every), ("keep", keep)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")


# -- names --------------------------------------------------------------------------------------------
def final_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def temp_dir(root: str | Path, step: int, nonce: str) -> Path:
    return Path(root) / f".step-{step:06d}.tmp-{nonce}"


def complete(root: str | Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under `root`, oldest first."""
    root = Path(root)
    found = []
    for child in root.iterdir() if root.is_dir() else ():
        match = _FINAL.match(child.name)
        if match and is_committed(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def is_committed(directory: Path) -> bool:
    try:
        marker = (directory / COMMIT).read_text().strip()
        return marker == sha256_file(directory / MANIFEST)
    except OSError:
        return False


# -- digests --------------------------------------------------------------------------------------------
def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def digests(directory: str | Path, names: list[str] | None = None) -> dict[str, str]:
    """SHA-256 of the named files in `directory` (all regular files when `names` is None)."""
    directory = Path(directory)
    if names is None:
        names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name not in (MANIFEST, COMMIT))
    return {name: sha256_file(directory / name) for name in names}


# -- write (rank 0) -------------------------------------------------------------------------------------
def commit(tmp: Path, final: Path, manifest: dict[str, Any], keep: int | None = None) -> Path:
    """Write the manifest and the commit marker into `tmp`, then rename it to `final`; prune to `keep`.

    `manifest["files"]` must already hold the digest of every shard. Each write
    is fsynced before the next step depends on it, so after a crash the disk
    never holds a COMMIT whose manifest or shards did not reach it.
    """
    unlisted = set(digests_missing(tmp, manifest["files"]))
    if unlisted:
        raise CheckpointError(f"{tmp}: files without a digest: {sorted(unlisted)}")
    data = json.dumps({"format": FORMAT, **manifest}, indent=1, sort_keys=True).encode()
    _write_synced(tmp / MANIFEST, data)
    _write_synced(tmp / COMMIT, hashlib.sha256(data).hexdigest().encode())
    _fsync(tmp)
    aside = None
    if final.exists():  # the same step saved again: the new one replaces it
        aside = final.with_name(f".{final.name}.old-{secrets.token_hex(4)}")
        os.rename(final, aside)
    os.rename(tmp, final)
    _fsync(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    prune(final.parent, keep)
    return final


def digests_missing(directory: Path, files: dict[str, str]) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name not in files and p.name not in (MANIFEST, COMMIT)]


def prune(root: Path, keep: int | None) -> None:
    """Delete leftovers of interrupted saves and, with `keep`, all but the `keep` latest checkpoints."""
    for child in root.iterdir():
        if _STALE.match(child.name):
            shutil.rmtree(child, ignore_errors=True)
    if keep is not None:
        for _, old in complete(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- read (notebook) ------------------------------------------------------------------------------------
def resolve(path: str | Path) -> Path:
    """The checkpoint `path` names: itself if it is one, else the latest complete one inside it."""
    path = Path(path).expanduser().absolute()  # ranks may run elsewhere: they get an absolute path
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file; pass the checkpoint directory (e.g. ckpt/ or ckpt/step-000120)")
    if any((path / name).exists() for name in (COMMIT, MANIFEST, ".metadata")):
        if not is_committed(path):
            raise CheckpointError(f"{path} is incomplete (no valid commit marker: the save was interrupted or the "
                                  f"files were changed); load {path.parent} to take the latest complete checkpoint")
        return path
    found = complete(path)
    if found:
        return found[-1][1]
    partial = sorted(c.name for c in path.iterdir() if _STALE.match(c.name) or _FINAL.match(c.name))
    detail = f" (incomplete, not loadable: {', '.join(partial)})" if partial else ""
    raise CheckpointError(f"no complete checkpoint in {path}{detail}")


def verify(checkpoint: Path) -> dict[str, Any]:
    """The manifest of a committed checkpoint, after checking every file against its SHA-256."""
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{checkpoint / MANIFEST}: unreadable ({e})") from None
    if not is_committed(checkpoint):
        raise CheckpointError(f"{checkpoint / MANIFEST}: does not match the commit marker {checkpoint / COMMIT}")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{checkpoint}: checkpoint format {manifest.get('format')!r}, this workbench reads "
                              f"format {FORMAT}")
    files: dict[str, str] = manifest["files"]
    for name, expected in sorted(files.items()):
        if Path(name).name != name or name in (".", "..", MANIFEST, COMMIT):
            raise CheckpointError(f"{checkpoint}: the manifest names an unsafe path {name!r}")
        if not (checkpoint / name).is_file():
            raise CheckpointError(f"{checkpoint / name}: missing (listed in the manifest)")
        found = sha256_file(checkpoint / name)
        if found != expected:
            raise CheckpointError(f"{checkpoint / name}: SHA-256 {found[:16]}… does not match the manifest's "
                                  f"{expected[:16]}…: the file is corrupt or was changed after the save")
    extra = digests_missing(checkpoint, files)
    if extra:
        raise CheckpointError(f"{checkpoint}: files not in the manifest: {sorted(extra)}")
    return manifest


# -- Config as JSON -------------------------------------------------------------------------------------
def config_to_json(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_json(data: dict[str, Any]) -> Config:
    return Config(**{**data, "model": ModelConfig(**data["model"])})


# -- save options (checked in the notebook, before any rank is asked) -----------------------------------
def schedule(save_every: int | None, save_to: str | Path | None, keep: int | None = None) -> SaveSchedule | None:
    """The periodic saves `bench.train(steps, save_every=N, save_to="ckpt/")` asks for; None for none."""
    if save_every is None:
        if save_to is not None or keep is not None:
            raise ValueError("save_to/keep: given without save_every; pass save_every=N to save every N steps")
        return None
    if save_to is None:
        raise ValueError("save_to: periodic saves need a directory, e.g. save_to=\"ckpt/\"")
    return SaveSchedule(save_every, str(writable_directory(save_to)), keep)


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


def resume_state(manifest: dict[str, Any]) -> dict[str, Any]:
    """What a load restores from the manifest beyond the shards: data position, counters, loss scale."""
    keys = ("next_step", "steps_done", "skipped_steps", "scaler")
    return {k: manifest[k] for k in keys}
