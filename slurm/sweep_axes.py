"""The named axes of a sweep grid: safe names, number lists, architectures.

An architecture is "transformer", "denseformer-KxP" (k x p DenseFormer), or a mapping
{name: ..., set: {model.key: value}, lr: [...], warmup: [...]}: its own model keys (a
shorthand name brings its own too) and, optionally, its own learning-rate and warm-up grids,
which replace grid.lr and grid.warmup for that architecture.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from slurm.sweep_errors import SweepError

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
RUN_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}"
ARCHITECTURE_KEYS = {"name", "set", "lr", "warmup"}


@dataclass
class Architecture:
    name: str
    overrides: dict[str, Any]
    lrs: list[float] | None = None  # its own learning-rate grid (else grid.lr)
    warmups: list[float] | None = None  # its own warm-up fractions (else grid.warmup)


def check_name(value: Any, key: str, pattern: str = NAME_PATTERN) -> str:
    """`value` if it is a safe name (letters, digits, . _ -), else SweepError naming `key`."""
    if not isinstance(value, str) or not re.fullmatch(pattern, value):
        raise SweepError(f"{key}: {value!r} is not a valid name: use letters, digits, '.', "
                         f"'_' and '-', starting with a letter or digit (pattern {pattern})")
    return value


def number_list(grid: dict, key: str, kind: type | tuple, positive: bool = False,
          where: str = "grid") -> list | None:
    if key not in grid:
        return None
    values = grid[key] if isinstance(grid[key], list) else [grid[key]]
    if not values:
        raise SweepError(f"{where}.{key}: empty list")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, kind) or (positive and not v > 0):
            raise SweepError(f"{where}.{key}: expected {'positive ' if positive else ''}"
                             f"numbers, got {v!r}")
    return values


def _shorthand(name: str) -> dict[str, Any] | None:
    """The model keys of "transformer", "denseformer-KxP", "attnres" (full Attention
    Residuals), "attnres-blockN", "mudd" and "mudd-static" (MUDD, qkvr streams), "hc"
    (dynamic Hyper-Connections), "hc-static" and "mhc" (n = 4 streams, the keys' defaults);
    None for other names."""
    if name == "transformer":
        return {"model.dwa": False}
    match = re.fullmatch(r"denseformer-(\d+)x(\d+)", name)
    if match:
        return {"model.dwa": True, "model.dwa_dilation": int(match[1]),
                "model.dwa_period": int(match[2])}
    match = re.fullmatch(r"attnres(?:-block(\d+))?", name)
    if match:
        return {"model.connection": "attnres",
                "model.attnres_blocks": None if match[1] is None else int(match[1])}
    if name in ("mudd", "mudd-static"):
        return {"model.connection": "mudd", "model.mudd_dynamic": name == "mudd"}
    if name in ("hc", "hc-static"):
        return {"model.connection": "hc", "model.hc_dynamic": name == "hc"}
    if name == "mhc":
        return {"model.connection": "mhc"}
    return None


def parse_architecture(item: Any, key: str = "grid.architecture") -> Architecture:
    """"transformer", "denseformer-KxP", "attnres", "attnres-blockN", "mudd", "mudd-static",
    "hc", "hc-static", "mhc", or {name: ..., set: {model.key: value}, lr: [...], warmup:
    [...]} (a shorthand name in the mapping brings its own model keys too)."""
    if isinstance(item, str):
        overrides = _shorthand(item)
        if overrides is None:
            raise SweepError(f"{key}: {item!r}: use transformer, denseformer-KxP (e.g. "
                             "denseformer-4x5), attnres, attnres-blockN (e.g. attnres-block8), "
                             "mudd, mudd-static, hc, hc-static, mhc or "
                             "{name: ..., set: {model.key: value}}")
        return Architecture(item, overrides)
    if isinstance(item, dict) and set(item) <= ARCHITECTURE_KEYS and "name" in item:
        name = check_name(item["name"], f"{key}.name")
        overrides = item.get("set") or {}
        if not isinstance(overrides, dict):
            raise SweepError(f"{key}: 'set' of {name!r} must be a mapping")
        own = {k: number_list(item, k, (int, float), True, f"{key}[{name}]")
               for k in ("lr", "warmup")}
        return Architecture(name, {**(_shorthand(name) or {}), **overrides}, own["lr"],
                            own["warmup"])
    raise SweepError(f"{key}: cannot read {item!r}; known keys of a mapping: "
                     f"{sorted(ARCHITECTURE_KEYS)}")


def si_format(value: float) -> str:
    """3 significant digits and a suffix: 5120 -> "5.12k", 2e9 -> "2G"."""
    for suffix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"
