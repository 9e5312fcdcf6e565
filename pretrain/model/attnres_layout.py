"""Which earlier outputs each sub-layer of an Attention Residuals model reads (plain Python).

Index conventions (docs/connections.md#attention-residuals): sub-layers are numbered
1..L, L = 2d; sub-layer 2i - 1 is block i's attention and 2i its MLP. v_0 is the embedding
and v_l the output of sub-layer l's branch (its attention or MLP, without a skip). Consumer
l = 1..L reads into sub-layer l's input; consumer L + 1 is the model output (before the
final norm).

Block AttnRes splits the L sub-layers into N groups of S = L / N consecutive ones; full
AttnRes is the case S = 1. The program holds one tensor per sub-layer, X_l, the running sum
of its group so far (v_l itself when S = 1): X_0 = v_0, X_l = v_l when l opens a group
(l - 1 = 0 mod S), else X_{l-1} + v_l. Consumer l then reads X_j for j in `sources(l)`: the
completed groups' sums X_0, X_S, ..., and the partial sum of its own group, X_{l-1}, when
that group has begun.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class AttnResLayout:
    """The sources of every consumer of a d-block model with `blocks` groups (None: full)."""

    n_layers: int
    blocks: int | None = None

    def __post_init__(self):
        if self.blocks is not None and self.n_sublayers % self.blocks:
            raise ValueError(f"{self.blocks} AttnRes blocks do not divide the "
                             f"{self.n_sublayers} sub-layers")

    @property
    def n_sublayers(self) -> int:
        return 2 * self.n_layers

    @property
    def group(self) -> int:
        """S: sub-layers per group (1 for full AttnRes)."""
        return 1 if self.blocks is None else self.n_sublayers // self.blocks

    @functools.cached_property
    def _sources(self) -> tuple[tuple[int, ...], ...]:
        s = self.group
        return tuple(tuple(sorted({*range(0, c, s), c - 1}))
                     for c in range(1, self.n_sublayers + 2))

    def sources(self, c: int) -> tuple[int, ...]:
        """The X_j consumer c (1..L + 1) attends over."""
        return self._sources[c - 1]

    def accumulates(self, sub: int) -> bool:
        """Whether X_sub = X_{sub-1} + v_sub (sub-layer `sub` continues a group), not v_sub."""
        return (sub - 1) % self.group != 0

    def n_reads(self) -> int:
        """Sources summed over all consumers (each read costs two multiply-adds per element:
        its logit and its share of the weighted sum)."""
        return sum(len(js) for js in self._sources)

    def peak_held(self) -> int:
        """The most X_j a forward holds at once: X_j from the sub-layer that makes it (X_0:
        the embedding) to its last reader, dropped as that reader's input is formed (the
        liveness of the block program, `StageProgram.peak_held`, without building it)."""
        last = {j: c for c in range(1, self.n_sublayers + 2) for j in self.sources(c)}
        held = {0} & last.keys()
        peak = len(held)
        for c in range(1, self.n_sublayers + 1):
            held -= {j for j in held if last[j] == c}
            if c in last:
                held.add(c)
                peak = max(peak, len(held))
        return peak

    def n_params(self, d_model: int) -> int:
        """A query and a key-norm weight of d_model per consumer."""
        return 2 * (self.n_sublayers + 1) * d_model
