"""The shapes of a sweep grid: listed, depth x width, or matched to a parameter count.

Three ways to give them (model keys are any of the run config's `model.*` keys):

    shape: [{n_layers: 12, d_model: 768}, ...]     # listed
    depth: [6, 12]  width: [256, 512]  head_dim: 64 # the product (n_heads = width / head_dim)
    params: 20M  depth: [6, 12, 24]  head_dim: 64  # matched: one width per depth

Matched shapes: for each depth (and each target in `params`, a number or a string with a
k/M/G suffix), the width is the multiple of `head_dim` (default: a multiple of the model's
n_heads, which then stays fixed) whose non-embedding parameter count, counted by the model
config itself (`DenseFormerConfig.num_params(non_embedding=True)`), is closest to the target
in ratio. The count is taken from the base config with the sweep's `set` and no architecture
overrides, so every architecture trains the same shape at a depth; each run's own N (DWA
weights included) is what the sweep reports.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Any

from slurm.sweep_errors import SweepError

SI = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9, "T": 1e12}
MAX_WIDTH_STEPS = 100_000


def parse_count(value: Any, key: str) -> float:
    """20000000, 2e7 or "20M" as a positive number; SweepError naming `key` otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKMGBT]?)\s*",
                         str(value))
    if not match or float(match[1]) <= 0:
        raise SweepError(f"{key}: {value!r} is not a parameter count: use a number or a "
                         "string like 20M, 1.5G, 300k")
    return float(match[1]) * SI[match[2]]


def _positive_ints(grid: dict, key: str) -> list[int] | None:
    if key not in grid:
        return None
    values = grid[key] if isinstance(grid[key], list) else [grid[key]]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                             for v in values):
        raise SweepError(f"grid.{key}: expected a list of positive integers, got {grid[key]!r}")
    return values


def _head_dim(grid: dict) -> int | None:
    head_dim = grid.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 1):
        raise SweepError(f"grid.head_dim: expected a positive integer, got {head_dim!r}")
    return head_dim


def parse_shapes(grid: dict) -> list[dict[str, Any]]:
    """grid.shape, or the product of grid.depth and grid.width (heads from head_dim); [] when
    the grid matches shapes to grid.params (see matched_shapes)."""
    given = [k for k in ("shape", "width", "params") if k in grid]
    if len(given) > 1:
        raise SweepError(f"grid: give one of shape, depth x width, or params with depth; got "
                         f"{' and '.join(given)}")
    if "shape" in grid:
        if "depth" in grid:
            raise SweepError("grid: give either shape or depth x width, not both")
        shapes = grid["shape"] if isinstance(grid["shape"], list) else [grid["shape"]]
        if not shapes or not all(isinstance(s, dict) and s for s in shapes):
            raise SweepError("grid.shape: expected a list of mappings of model keys, e.g. "
                             "{n_layers: 12, d_model: 768}")
        return [dict(s) for s in shapes]
    depths, widths = _positive_ints(grid, "depth"), _positive_ints(grid, "width")
    if "params" in grid:
        if depths is None:
            raise SweepError("grid.params: needs depth, a list of depths to match widths for")
        return []
    if depths is None or widths is None:
        raise SweepError("grid: needs shape (a list of {n_layers, d_model, ...}), depth and "
                         "width, or params and depth")
    head_dim = _head_dim(grid)
    shapes = []
    for d, w in itertools.product(depths, widths):
        shape = {"n_layers": d, "d_model": w}
        if head_dim is not None:
            if w % head_dim:
                raise SweepError(f"grid.head_dim: {head_dim!r} must divide every width ({w})")
            shape["n_heads"] = w // head_dim
        shapes.append(shape)
    return shapes


def matched_width(model, depth: int, target: float, head_dim: int | None) -> dict[str, Any]:
    """The shape {n_layers, d_model[, n_heads]} at `depth` whose non-embedding parameter count
    (of `model`, a DenseFormerConfig with its vocabulary) is closest to `target` in ratio."""
    step = head_dim or model.n_heads

    def shape_of(multiple: int) -> dict[str, Any]:
        shape = {"n_layers": depth, "d_model": multiple * step}
        if head_dim is not None:
            shape["n_heads"] = multiple
        return shape

    def count(multiple: int) -> int:
        return dataclasses.replace(model, **shape_of(multiple)).num_params(non_embedding=True)

    multiple = 1
    while count(multiple) < target and multiple < MAX_WIDTH_STEPS:
        multiple += max(1, multiple // 8)  # grows ~12% a step, then refined below
    low = max(1, multiple * 7 // 8 - 1)  # the last step was at most multiple / 8
    best = min(range(low, multiple + 1), key=lambda m: abs(math.log(count(m) / target)))
    return shape_of(best)


def matched_shapes(grid: dict, model) -> list[dict[str, Any]]:
    """The shapes of grid.params x grid.depth, each matched with matched_width; a shape is
    listed once even when two targets give it."""
    raw = grid["params"] if isinstance(grid["params"], list) else [grid["params"]]
    if not raw:
        raise SweepError("grid.params: empty list")
    targets = [parse_count(v, "grid.params") for v in raw]
    head_dim = _head_dim(grid)
    shapes: list[dict[str, Any]] = []
    for target, depth in itertools.product(targets, _positive_ints(grid, "depth")):
        shape = matched_width(model, depth, target, head_dim)
        if shape not in shapes:
            shapes.append(shape)
    return shapes
