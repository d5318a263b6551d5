"""The manifest: what a checkpoint holds beyond its tensors, as JSON, and the schema every field is checked against.

The commit marker only proves a manifest is the one committed; a manifest
edited and re-marked (say `next_step: -7`) must still not reach the ranks, so
every field's type and range is checked when a checkpoint is loaded, and before
one is committed (a save never writes what a load would refuse).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable

from workbench.checkpoints.layout import COMMIT, FINAL, MANIFEST, METADATA, CheckpointError
from workbench.config import Config

FORMAT = 2
"""Bumped when the layout or the manifest's meaning changes; other formats are refused, not misread.
2: data in the content-addressed chunk store beside the checkpoints (1 had one DCP shard file per rank inside)."""
HEX64 = re.compile(r"^[0-9a-f]{64}$")


def read_manifest(checkpoint: Path) -> dict[str, Any]:
    """The manifest of `checkpoint`, parsed and schema-checked (not yet compared with the files)."""
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{checkpoint / MANIFEST}: unreadable ({e})") from None
    check_manifest(manifest, checkpoint)
    return manifest


def check_manifest(manifest: Any, checkpoint: Path) -> None:
    """Refuse a manifest whose fields are not what a save writes, naming the field: type, range, consistency."""
    def refuse(name: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{checkpoint}: manifest field {name!r} {problem}")

    if not isinstance(manifest, dict):
        raise refuse("(top level)", f"is a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{checkpoint}: checkpoint format {manifest.get('format')!r}, this workbench reads "
                              f"format {FORMAT}")
    missing = sorted(set(FIELDS) - set(manifest))
    if missing:
        raise refuse(missing[0], "is missing")
    unknown = sorted(set(manifest) - set(FIELDS))
    if unknown:
        raise refuse(unknown[0], "is not a manifest field (this workbench does not know what it means)")
    for name, check in FIELDS.items():
        problem = check(manifest[name])
        if problem:
            raise refuse(name, f"{problem}, got {_short(manifest[name])}")
    match = FINAL.match(checkpoint.name)
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
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return None if ok else "must be an integer ≥ 0"


def _positive(value: Any) -> str | None:
    return _count(value) or (None if value >= 1 else "must be ≥ 1")


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) and value else "must be a non-empty string"


def _files(value: Any) -> str | None:
    """The files inside the checkpoint directory: DCP's index, by SHA-256 (no other name is ever written there)."""
    if not isinstance(value, dict) or set(value) != {METADATA}:
        names = sorted(value) if isinstance(value, dict) else None
        unsafe = [n for n in names or () if not isinstance(n, str) or Path(n).name != n or n in (".", "..", MANIFEST,
                                                                                                   COMMIT)]
        if unsafe:
            return f"names an unsafe path {unsafe[0]!r}"
        return f"must be an object holding exactly {METADATA!r} → its SHA-256"
    digest = value[METADATA]
    return None if isinstance(digest, str) and HEX64.match(digest) else \
        f"holds {digest!r} for {METADATA}, not a SHA-256 in hex"


def _chunks(value: Any) -> str | None:
    """The chunks this checkpoint reads from the store: SHA-256 in hex → size in bytes."""
    if not isinstance(value, dict):
        return "must be an object of chunk SHA-256 → size"
    for digest, size in value.items():
        if not HEX64.match(digest):
            return f"names {digest!r}, not a SHA-256 in hex"
        if _count(size):
            return f"gives chunk {digest[:16]}… the size {size!r}, not an integer ≥ 0"
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


FIELDS: dict[str, Callable[[Any], str | None]] = {
    "format": lambda v: None,  # checked first, with its own message
    "files": _files,
    "chunks": _chunks,
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
    """As config.json holds it (`Config.to_dict`): a model source in its own shape, read back by `Config.from_dict`."""
    return cfg.to_dict()


def config_from_json(data: dict[str, Any]) -> Config:
    """The Config a manifest holds, validated (an unknown or invalid field is refused by name)."""
    return Config.from_dict(data)


def resume_state(manifest: dict[str, Any]) -> dict[str, Any]:
    """What a load restores from the manifest beyond the tensors: data position, counters, loss scale; and which
    optimizer saved its state (another optimizer's state is not loaded)."""
    keys = ("next_step", "steps_done", "skipped_steps", "scaler")
    return {**{k: manifest[k] for k in keys}, "optimizer": manifest["config"].get("optimizer", "adamw")}
