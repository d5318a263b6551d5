"""A Config as JSON (config.json for runs outside the notebook): written and read back generically over fields."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any, TypeVar

from workbench.config.refusals import ConfigError, refuse
from workbench.config.sources import SOURCES, source_from_data

T = TypeVar("T")


def to_dict(value: Any) -> Any:
    """Every field as plain JSON data, nested parts as objects. Generic over dataclass fields, so a field added to
    Config or ModelConfig is written with no change here."""
    if callable(getattr(value, "to_data", None)):  # a model source (sources.py): its own JSON shape
        return to_dict(value.to_data())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_dict(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_dict(v) for v in value]
    if isinstance(value, dict):
        return {k: to_dict(v) for k, v in value.items()}
    return value


def from_dict(cls: type[T], data: Any, prefix: str = "") -> T:
    """Build dataclass `cls` from `data` (as `to_dict` writes it), recursing into fields whose declared type is a
    dataclass; an unknown key is refused by name, a missing one takes its default (older files still load)."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(data, dict):
        raise refuse(where, f"expected a JSON object, got {type(data).__name__}", "pass a dict as to_dict() writes it")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise refuse(f"{prefix}{unknown[0]}", f"unknown field(s) {unknown} for {cls.__name__}",
                     f"use the fields {sorted(names)}")
    values = {}
    for name, value in data.items():
        hint = hints.get(name)
        if isinstance(value, dict) and "source" in value and _holds_sources(hint):
            value = source_from_data(value)  # a model source; without "source", the built-in ModelConfig
        elif isinstance(value, dict) and (dataclass := _dataclass_of(hint)) is not None:
            value = from_dict(dataclass, value, f"{prefix}{name}.")
        elif typing.get_origin(hint) is tuple and isinstance(value, list):
            value = tuple(value)  # JSON has no tuples
        values[name] = value
    return cls(**values)


def _dataclass_of(hint: Any) -> type | None:
    """The dataclass a field holds: its hint, or the first dataclass of a union (Config.model: ModelConfig)."""
    if dataclasses.is_dataclass(hint):
        return hint
    return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), None)


def _holds_sources(hint: Any) -> bool:
    return any(a in SOURCES.values() for a in typing.get_args(hint))


def save(value: Any, path: str | Path) -> Path:
    """Write `value` (a Config) as indented JSON to `path`."""
    path = Path(path)
    path.write_text(json.dumps(to_dict(value), indent=2) + "\n", encoding="utf-8")
    return path


def load(cls: type[T], path: str | Path) -> T:
    """The `cls` in the JSON file `path` (as `save` or `bench.export` write it), validated."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"config: cannot read {path} ({e}). Fix: pass a config.json written by "
                          "bench.export() or Config.save()") from None
    return from_dict(cls, data)
