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
import math
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.config import Config

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
    manifest = {"format": FORMAT, **manifest}
    check_manifest(manifest, final)  # what a load would refuse is never committed
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
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
    """The checkpoint `path` names: itself if it is one, else the newest inside it, if that one is intact.

    Never a silent fallback: when the newest checkpoint under `path` is damaged
    (commit marker missing or wrong, manifest unreadable or out of schema, a
    file gone), this refuses, naming it and the newest intact one; loading an
    older checkpoint takes naming it (`ckpt/step-000110`).
    """
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
    found = finals(path)
    if not found:
        partial = sorted(c.name for c in path.iterdir() if _STALE.match(c.name))
        detail = f" (incomplete, not loadable: {', '.join(partial)})" if partial else ""
        raise CheckpointError(f"no complete checkpoint in {path}{detail}")
    newest_step, newest = found[-1]
    problem = damage(newest)
    if problem is None:
        return newest
    intact = next(((s, d) for s, d in reversed(found[:-1]) if damage(d) is None), None)
    if intact is None:
        older = "; no older checkpoint there is intact either"
    else:
        step, directory = intact
        older = (f"; the newest intact one is {directory} (step {step}, {newest_step - step} steps earlier): to "
                 f"continue from there, load it by name: bench.load({str(directory)!r})")
    raise CheckpointError(f"{newest}, the newest checkpoint in {path}, is damaged ({problem}); nothing was "
                          f"loaded{older}")


def finals(root: Path) -> list[tuple[int, Path]]:
    """Every directory under `root` named as a finished checkpoint (`step-N`), intact or not, oldest first.

    A save only ever gives a directory that name by renaming it after its commit
    marker is down, so one of these without a valid marker was damaged afterwards.
    """
    return sorted((int(m.group(1)), c) for c in root.iterdir() if (m := _FINAL.match(c.name)) and c.is_dir())


def damage(checkpoint: Path) -> str | None:
    """What is wrong with a finished checkpoint, found without reading its data (commit marker, manifest schema,
    every listed file present); None if nothing is. Its files' digests are checked when it is loaded (`verify`)."""
    if not (checkpoint / COMMIT).is_file():
        return f"its commit marker {COMMIT} is missing"
    if not is_committed(checkpoint):
        return f"{MANIFEST} does not match the commit marker (unreadable, truncated or edited)"
    try:
        manifest = read_manifest(checkpoint)
    except CheckpointError as e:
        return str(e).removeprefix(f"{checkpoint}: ")
    missing = [name for name in manifest["files"] if not (checkpoint / name).is_file()]
    return f"{missing[0]} is missing" if missing else None


def read_manifest(checkpoint: Path) -> dict[str, Any]:
    """The manifest of `checkpoint`, parsed and schema-checked (not yet compared with the files)."""
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{checkpoint / MANIFEST}: unreadable ({e})") from None
    check_manifest(manifest, checkpoint)
    return manifest


def verify(checkpoint: Path) -> dict[str, Any]:
    """The manifest of a committed checkpoint, after checking every file against its SHA-256."""
    if not is_committed(checkpoint):
        raise CheckpointError(f"{checkpoint / MANIFEST}: does not match the commit marker {checkpoint / COMMIT}")
    manifest = read_manifest(checkpoint)
    files: dict[str, str] = manifest["files"]
    for name, expected in sorted(files.items()):  # plain names inside the checkpoint: the schema says so
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


# -- the manifest's schema --------------------------------------------------------------------------------
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def check_manifest(manifest: Any, checkpoint: Path) -> None:
    """Refuse a manifest whose fields are not what a save writes: each field's type and range, by name.

    The commit marker only proves the manifest is the one committed; a manifest
    edited and re-marked (say next_step = -7) must still not reach the ranks.
    """
    def refuse(name: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{checkpoint}: manifest field {name!r} {problem}")

    if not isinstance(manifest, dict):
        raise refuse("(top level)", f"is a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{checkpoint}: checkpoint format {manifest.get('format')!r}, this workbench reads "
                              f"format {FORMAT}")
    missing = sorted(set(_FIELDS) - set(manifest))
    if missing:
        raise refuse(missing[0], "is missing")
    unknown = sorted(set(manifest) - set(_FIELDS))
    if unknown:
        raise refuse(unknown[0], "is not a manifest field (this workbench does not know what it means)")
    for name, check in _FIELDS.items():
        problem = check(manifest[name])
        if problem:
            raise refuse(name, f"{problem}, got {_short(manifest[name])}")
    match = _FINAL.match(checkpoint.name)
    if match and int(match.group(1)) != manifest["next_step"]:
        raise refuse("next_step", f"is {manifest['next_step']}, but the directory is {checkpoint.name}")
    if manifest["skipped_steps"] > manifest["steps_done"]:
        raise refuse("skipped_steps", f"({manifest['skipped_steps']}) exceeds steps_done ({manifest['steps_done']})")
    try:
        cfg = config_from_json(manifest["config"])
    except (TypeError, ValueError, KeyError) as e:
        raise refuse("config", f"is not a valid Config ({e})") from None
    if manifest["world_size"] != cfg.world_size:
        raise refuse("world_size", f"is {manifest['world_size']}, but its config's layout {cfg.layout} has "
                     f"{cfg.world_size} ranks")
    if manifest["layout"] != cfg.layout:
        raise refuse("layout", f"is {manifest['layout']!r}, but its config's layout is {cfg.layout!r}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _count(value: Any) -> str | None:
    """An integer ≥ 0 (and not a bool, which JSON keeps apart but Python counts as an int)."""
    return None if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else \
        "must be an integer ≥ 0"


def _files(value: Any) -> str | None:
    if not isinstance(value, dict) or not value:
        return "must be a non-empty object of file name → SHA-256"
    for name, digest in value.items():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..", MANIFEST, COMMIT):
            return f"names an unsafe path {name!r}"
        if not isinstance(digest, str) or not _HEX64.match(digest):
            return f"holds {digest!r} for {name}, not a SHA-256 in hex"
    return None


def _scaler(value: Any) -> str | None:
    """None, or GradScaler.state_dict(): a finite positive scale, growth > 1, 0 < backoff < 1, counts ≥ 0."""
    if value is None:
        return None
    keys = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    if not isinstance(value, dict) or set(value) != keys:
        return f"must be null or an object with exactly {sorted(keys)}"

    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    if not number(value["scale"]) or value["scale"] <= 0:
        return "must have a finite scale > 0"
    if not number(value["growth_factor"]) or value["growth_factor"] <= 1:
        return "must have a growth_factor > 1"
    if not number(value["backoff_factor"]) or not 0 < value["backoff_factor"] < 1:
        return "must have a backoff_factor in (0, 1)"
    if _count(value["growth_interval"]) or value["growth_interval"] < 1 or _count(value["_growth_tracker"]):
        return "must have an integer growth_interval ≥ 1 and _growth_tracker ≥ 0"
    return None


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) and value else "must be a non-empty string"


def _positive(value: Any) -> str | None:
    return _count(value) or (None if value >= 1 else "must be ≥ 1")


_FIELDS = {
    "format": lambda v: None,  # checked first, with its own message
    "files": _files,
    "next_step": _count,
    "steps_done": _count,
    "skipped_steps": _count,
    "scaler": _scaler,
    "config": lambda v: None if isinstance(v, dict) else "must be an object (a Config as JSON)",
    "layout": _text,
    "world_size": _positive,
    "torch": _text,
}
"""Every field a save writes, with the check of its value (a message, or None when it is fine)."""


# -- Config as JSON -------------------------------------------------------------------------------------
def config_to_json(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_json(data: dict[str, Any]) -> Config:
    """The Config a manifest holds, validated (an unknown or invalid field is refused by name)."""
    return Config.from_dict(data)


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
