"""Where the buffered DWA keeps things: the plan of pretrain/model/dwa.py, without torch.

Index conventions as in dwa_pattern.py (X_j the output of block j, X_0 the embedding; the DWA
after block c reads S_c and applies alpha[c, j], row c - 1 and column j of the alpha matrix).
A *consumer* c reads the X_j in `reads_of[c]` (all of one residue class mod k): a DWA of the
model, or, on a pipeline stage, the part of a DWA that the stage folds in
(parallel/strategies/stage_state.py). Per residue class r there are two buffers:

- values: the stored X_j of class r in increasing j (`slot[j] = (r, position)`); every
  consumer reads one slice of it (`reads[c] = (r, start, stop)`);
- output gradients, made in backward: one row per consumer of class r in increasing c
  (`row[c] = (r, row)`); the consumers that read X_j are one run of rows
  (`readers[j] = (r, start, stop)`), so X_j's gradient from every DWA is one
  matrix-vector product with the alphas on X_j (`column_index[j]`).

The alphas a consumer applies are a strided slice of its row (S_c is every k-th column) and
the alphas on X_j a strided slice of its column (the readers are every lcm(k, p)-th row), so
both are views of the alpha matrix (`weights_index`, `column_index`), not gathered copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class BufferLayout:
    """The buffered DWA's tables for one set of consumers (see the module docstring)."""

    slot: Mapping[int, tuple[int, int]]
    class_sizes: Mapping[int, int]
    reads: Mapping[int, tuple[int, int, int]]
    row: Mapping[int, tuple[int, int]]
    class_rows: Mapping[int, int]
    readers: Mapping[int, tuple[int, int, int]]
    weights_index: Mapping[int, tuple[int, slice]]
    column_index: Mapping[int, tuple[slice, int]]


def _strided(indices: list[int], what: str) -> slice:
    """The slice that picks exactly `indices` (equally spaced, increasing)."""
    step = indices[1] - indices[0] if len(indices) > 1 else 1
    if step < 1 or indices != list(range(indices[0], indices[-1] + 1, step)):
        raise AssertionError(f"{what} = {indices} is not equally spaced")
    return slice(indices[0], indices[-1] + 1, step)


def _run(positions: list[int], what: str) -> tuple[int, int]:
    """[start, stop) of consecutive positions."""
    if positions != list(range(positions[0], positions[0] + len(positions))):
        raise AssertionError(f"{what} sit at positions {positions}, not one run")
    return positions[0], positions[0] + len(positions)


def buffer_layout(reads_of: Mapping[int, tuple[int, ...]], dilation: int) -> BufferLayout:
    """The BufferLayout of consumers c reading X_j for j in `reads_of[c]` (increasing, one
    residue class mod `dilation`); consumers that read nothing are left out."""
    consumers = {c: tuple(js) for c, js in sorted(reads_of.items()) if js}
    slot: dict[int, tuple[int, int]] = {}
    sizes: dict[int, int] = {}
    for j in sorted({j for js in consumers.values() for j in js}):
        r = j % dilation
        slot[j] = (r, sizes.get(r, 0))
        sizes[r] = sizes.get(r, 0) + 1
    reads, row, class_rows = {}, {}, {}
    readers_of: dict[int, list[int]] = {}
    for c, js in consumers.items():
        r = js[0] % dilation
        if any(slot[j][0] != r for j in js):
            raise AssertionError(f"consumer {c} reads {js}, not one residue class")
        start, stop = _run([slot[j][1] for j in js], f"the X_j of consumer {c}")
        reads[c] = (r, start, stop)
        row[c] = (r, class_rows.get(r, 0))
        class_rows[r] = class_rows.get(r, 0) + 1
        for j in js:
            readers_of.setdefault(j, []).append(c)
    readers, column_index = {}, {}
    for j, cs in readers_of.items():
        r = slot[j][0]
        readers[j] = (r, *_run([row[c][1] for c in cs], f"the readers of X_{j}"))
        column_index[j] = (_strided([c - 1 for c in cs], f"alpha rows on X_{j}"), j)
    weights_index = {c: (c - 1, _strided(list(js), f"S_{c}")) for c, js in consumers.items()}
    frozen = MappingProxyType
    return BufferLayout(frozen(slot), frozen(sizes), frozen(reads), frozen(row),
                        frozen(class_rows), frozen(readers), frozen(weights_index),
                        frozen(column_index))


def buffered_traffic(pattern) -> dict[str, int]:
    """Hidden-size tensors (B x S x H each) the buffered DWA of a `DWAPattern` reads or
    writes in one forward and one backward, and the floor of each (what any scheme that
    reads every (i, j) pair once must move), as docs/design.md#bytes-moved-by-the-dwas
    counts them. C = sum |S_i|, D the DWAs, s the stored X_j, u the stored X_j that also
    feed the next block (an upstream gradient to add)."""
    c, d, s = pattern.n_connections, len(pattern.inputs), len(pattern.stored)
    u = sum(1 for j in pattern.stored if not pattern.has_dwa(j))
    return {"forward": 2 * s + c + d, "backward": c + 2 * d + 2 * s + u,
            "floor_forward": c + d, "floor_backward": c + 2 * s + u}
