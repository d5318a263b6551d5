"""How a Config says no: one error type, one message shape, and the checks every field's value passes.

Every refusal reads "field: problem. Fix: what to do." so the notebook, the
controls and the logs can show it as it is. A field's value is checked from
its type hint (an `int` field takes no float and no bool, a `float` field only
finite numbers, a `Literal` one of its values) and from the range its class
declares beside its fields; rules that relate several fields live with the
part they belong to (`ModelConfig`, `Degrees`, `rules.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

Check = Callable[[str, Any], None]
"""A range check: called with the field's name and its (type-checked) value; raises ConfigError."""


class ConfigError(ValueError):
    """An impossible configuration; the message names the field and a fix."""


def refuse(field_name: str, problem: str, fix: str) -> ConfigError:
    """The error for `field_name`, in the one shape every refusal has."""
    return ConfigError(f"{field_name}: {problem}. Fix: {fix}.")


# -- ranges ---------------------------------------------------------------------------------------------
def at_least(low: int | float, why: str = "") -> Check:
    """value ≥ low (`at_least(1)` for a count); `why` says where the bound comes from."""
    def check(name: str, value: Any) -> None:
        if value < low:
            reason = f" ({why})" if why else ""
            raise refuse(name, f"must be ≥ {low}, got {value!r}{reason}",
                         f"set {name} > 0" if low == 1 else f"set {name} ≥ {low}")
    return check


def positive(name: str, value: Any) -> None:
    """value > 0."""
    if not value > 0:
        raise refuse(name, f"must be a positive number, got {value!r}", f"set {name} > 0")


def between(low: int, high: int, why: str) -> Check:
    """low ≤ value ≤ high; `why` says where the bound comes from."""
    def check(name: str, value: Any) -> None:
        if not low <= value <= high:
            raise refuse(name, f"{value!r} is outside [{low}, {high}] ({why})", f"choose {name} in that range")
    return check


def one_of(*allowed: Any) -> Check:
    """value is one of `allowed`."""
    def check(name: str, value: Any) -> None:
        if value not in allowed:
            raise refuse(name, f"{value!r} is not one of {', '.join(map(repr, allowed))}", f"use one of {allowed}")
    return check


# -- types, from the hints -------------------------------------------------------------------------------
def check_fields(obj: Any, ranges: Mapping[str, Check], prefix: str = "") -> None:
    """Refuse the first field of dataclass `obj` whose value has the wrong type, or lies outside its range.

    `prefix` ("model.") names fields of a nested part as the enclosing Config
    sees them.
    """
    for name, check in _field_checks(type(obj)):
        value, where = getattr(obj, name), prefix + name
        check(where, value)
        if name in ranges and value is not None:
            ranges[name](where, value)


@functools.cache
def _field_checks(cls: type) -> tuple[tuple[str, Check], ...]:
    # Worked out once per class: wb.plan builds thousands of Configs, and reading the hints each time was a tenth
    # of a plan's time.
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _type_check(hints[f.name])) for f in dataclasses.fields(cls) if f.init)


def _type_check(hint: Any) -> Check:
    """The check of a value against the type `hint`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        optional = type(None) in args
        kinds = tuple(a for a in args if dataclasses.is_dataclass(a))
        if len(kinds) > 1:  # one of several values (Config.model: a ModelConfig or another model source)
            names = " or ".join(k.__name__ for k in kinds)

            def one_of_kinds(name: str, value: Any) -> None:
                if not (value is None and optional) and not isinstance(value, kinds):
                    raise refuse(name, f"expected a {names}, got {type(value).__name__}", f"pass a {names}")
            return one_of_kinds
        inner = _type_check(next(a for a in args if a is not type(None)))  # X | None: check as X
        if not optional:
            return inner

        def or_none(name: str, value: Any) -> None:
            if value is not None:
                inner(name, value)
        return or_none
    if origin is Literal:
        def literal(name: str, value: Any) -> None:
            # bool is an int: True would pass `in (0, 1)`, so a literal of strings or ints never takes one
            if isinstance(value, bool) or value not in args:
                raise refuse(name, f"{value!r} is not one of {', '.join(map(repr, args))}", f"use one of {args}")
        return literal
    if hint is bool:
        def boolean(name: str, value: Any) -> None:
            if not isinstance(value, bool):
                raise refuse(name, f"must be True or False, got {value!r}", f"pass {name}=True or False")
        return boolean
    if hint is int:
        def integer(name: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise refuse(name, f"must be an integer, got {value!r}", f"pass an int for {name}")
        return integer
    if hint is float:
        def real(name: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise refuse(name, f"must be a real number, got {value!r}", f"pass a float for {name}")
            if not math.isfinite(value):
                raise refuse(name, f"must be finite, got {value!r}", f"pass a finite number for {name}")
        return real
    if origin is tuple and args[1:] == (Ellipsis,) and args[0] is int:
        def integers(name: str, value: Any) -> None:
            if not isinstance(value, tuple) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
                raise refuse(name, f"must be a tuple of integers, got {value!r}", f"pass {name}=(…) of ints")
        return integers
    if dataclasses.is_dataclass(hint):
        def instance(name: str, value: Any) -> None:
            if not isinstance(value, hint):
                raise refuse(name, f"expected a {hint.__name__}, got {type(value).__name__}",
                             f"pass a {hint.__name__}(...)")
        return instance
    return _unchecked


def _unchecked(name: str, value: Any) -> None:
    """A hint with no type check of its own (str, a path, other structures): the range checks and rules see it."""
