"""Config values checked against their type hints, and the error for an unknown key."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal, Union

from pretrain.model.config import ConfigError


def type_name(tp: Any) -> str:
    """A type hint in words, e.g. "int or null", for error messages."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return "a list of " + type_name(typing.get_args(tp)[0])
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def coerce(key: str, value: Any, tp: Any) -> Any:
    """`value` checked against the type hint `tp` (an int is accepted for a float)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is not type(None):
                try:
                    return coerce(key, value, arg)
                except ConfigError:
                    pass
    elif origin is Literal:
        if value in typing.get_args(tp) and isinstance(value, str):
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is list:
        if isinstance(value, list):
            (item_type,) = typing.get_args(tp)
            return [coerce(f"{key}[{n}]", v, item_type) for n, v in enumerate(value)]
    else:
        raise TypeError(f"{key}: unsupported config type {tp!r}")
    raise ConfigError(key, f"expected {type_name(tp)}, got {value!r} ({type(value).__name__})")


def is_str_field(tp: Any) -> bool:
    """Whether the type hint `tp` admits a string."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    return str in args


def unknown_key(key: str, name: str, known: Sequence[str]) -> ConfigError:
    """The error for an unknown `name` at `key`, suggesting the closest known name."""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else "known: " + ", ".join(known)
    return ConfigError(key, f"unknown key; {hint}")
