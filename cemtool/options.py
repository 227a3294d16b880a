"""Checking an analysis's ``Options`` dataclass against its own field types: the one rule every analysis uses.

An analysis declares its options once, as a frozen dataclass with typed fields and defaults; its
``__post_init__`` calls :func:`check_types` and then checks its ranges. The same dataclass serves the command
line, ``sweep -A name.key=value`` and Python callers, so an option's type, range and default live in one place.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from typing import Any, Union

from cemtool.errors import CemtoolError

WANT = {int: "a whole number", float: "a finite number", str: "a string", bool: "true or false", tuple: "a list"}


def _ok(v: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_ok(v, t) for t in typing.get_args(tp))
    if tp is type(None):
        return v is None
    if tp is bool:
        return isinstance(v, bool)
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool) or (isinstance(v, float) and v.is_integer())
    if tp is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if tp is str:
        return isinstance(v, str)
    if origin is tuple:
        args = typing.get_args(tp)
        return isinstance(v, tuple) and all(_ok(x, args[0]) for x in v)
    return True  # a type this rule does not know is the analysis's own to check


def _name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        names = [_name(t) for t in typing.get_args(tp) if t is not type(None)]
        return " or ".join(names) + (" (or null)" if type(None) in typing.get_args(tp) else "")
    return WANT.get(origin or tp, getattr(tp, "__name__", str(tp)))


def check_types(options: Any, what: str) -> None:
    """Every field of the dataclass ``options`` holds a value of its declared type (an int where an int goes, a
    finite float, a string, a tuple of strings...); else one CemtoolError naming ``what``.key and the value.
    Whole floats are accepted for ints and converted (JSON has one number type)."""
    hints = typing.get_type_hints(type(options))
    for f in dataclasses.fields(options):
        v, tp = getattr(options, f.name), hints[f.name]
        if isinstance(v, list):  # JSON and the command line give lists
            v = tuple(v)
            object.__setattr__(options, f.name, v)
        if not _ok(v, tp):
            raise CemtoolError(f"{what}.{f.name}={_show(v)}: must be {_name(tp)}")
        if tp is int and isinstance(v, float):
            object.__setattr__(options, f.name, int(v))


def _show(v: Any) -> str:
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


def at_least(options: Any, what: str, **lows: float) -> None:
    """Each named field is >= its lower bound (None, where allowed, passes)."""
    hints = typing.get_type_hints(type(options))
    for key, low in lows.items():
        v = getattr(options, key)
        if v is not None and v < low:
            want = "a whole number" if int in (hints[key], *typing.get_args(hints[key])) else "a number"
            raise CemtoolError(f"{what}.{key}={_show(v)}: must be {want} >= {low:g}")


def as_cli(message: str, cls: type, what: str) -> tuple[str, str | None]:
    """An Options error (``what.key=value: why``) as the command line says it: (why, with field names written
    ``--key``; the option ``--key`` for the usage line, or None)."""
    m = re.match(rf"{re.escape(what)}\.(\w+)=[^:]*: (.*)$", message, flags=re.S)
    key, why = (m.group(1), m.group(2)) if m else (None, message)
    for n in sorted(option_names(cls), key=len, reverse=True):
        why = re.sub(rf"(?<![\w.-])(?:{re.escape(what)}\.)?{re.escape(n)}\b", "--" + n.replace("_", "-"), why)
    return why, None if key is None else "--" + key.replace("_", "-")


def option_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


__all__ = ["as_cli", "at_least", "check_types", "option_names"]
