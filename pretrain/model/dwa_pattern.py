"""The DWA pattern of a model shape: who reads what, built once, without torch.

Index conventions (docs/design.md#index-conventions): blocks are numbered 1..d; X_0 is the
embedding output and X_i the output of block i. Block i has a DWA iff p divides i, and it
computes

    Y_i = sum over j in S_i of alpha[i, j] X_j,    S_i = {0 <= j <= i : j = i (mod k)}

(k the dilation, p the period), cut to j > i - K under a Last-K window K. The alphas of all
DWAs live in one (d, d + 1) matrix: row i - 1 is the DWA after block i, column j multiplies
X_j; entries outside the pattern are structurally zero.

`DWAPattern` is the one place this is derived. `DenseFormerConfig.dwa_pattern` builds it
(`pattern_for_shape`: once per shape), and the same object goes to the model and its
initialisation, the pipeline plan and stage modules, the memory estimator and the sweep
expander.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from pretrain.model.dwa_layout import BufferLayout, buffer_layout


@dataclass(frozen=True)
class DWAPattern:
    """Which blocks have a DWA, what each reads, and what must be kept for them.

    Derived tables (read-only):
    - `inputs[i]`: S_i in increasing j, for every block i that has a DWA;
    - `stored`: the X_j some DWA reads (what the buffered DWA keeps), increasing;
    - `last_reader[j]`: the last block whose DWA reads X_j: X_j is kept until that DWA ran;
    - `slot[j] = (r, n)`: X_j is the n-th stored output of residue class r = j mod k, and
      `class_sizes[r]` the number of stored outputs of class r (the buffer layout);
    - `reads[i] = (r, start, stop)`: S_i is positions [start, stop) of class r = i mod k
      (S_i is a contiguous run of its class, so a DWA reads one slice);
    - `layout`: those tables and the backward's (`BufferLayout`), the buffered DWA's plan.
    """

    n_layers: int  # d
    dilation: int  # k
    period: int | None  # p; None: no DWA at all (a plain Transformer)
    window: int | None = None  # Last-K: S_i holds only j > i - window
    init_offdiag: float = 0.0  # alpha[i, j] at init for j != i (alpha[i, i] = 1)
    inputs: Mapping[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    stored: tuple[int, ...] = field(init=False, repr=False, compare=False)
    last_reader: Mapping[int, int] = field(init=False, repr=False, compare=False)
    slot: Mapping[int, tuple[int, int]] = field(init=False, repr=False, compare=False)
    class_sizes: Mapping[int, int] = field(init=False, repr=False, compare=False)
    reads: Mapping[int, tuple[int, int, int]] = field(init=False, repr=False, compare=False)
    layout: BufferLayout = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        d, k, p = self.n_layers, self.dilation, self.period
        inputs: dict[int, tuple[int, ...]] = {}
        for i in range(p, d + 1, p) if p is not None else ():
            low = 0 if self.window is None else i - self.window + 1
            inputs[i] = tuple(j for j in range(i % k, i + 1, k) if j >= low)
        last_reader = {j: i for i, js in inputs.items() for j in js}  # i increases
        layout = buffer_layout(inputs, k)
        set_ = functools.partial(object.__setattr__, self)  # frozen: set the tables once
        set_("inputs", MappingProxyType(inputs))
        set_("stored", tuple(sorted(last_reader)))
        set_("last_reader", MappingProxyType(last_reader))
        set_("layout", layout)
        set_("slot", layout.slot)
        set_("class_sizes", layout.class_sizes)
        set_("reads", layout.reads)

    # -- the alpha matrix ----------------------------------------------------------------

    @property
    def alpha_shape(self) -> tuple[int, int]:
        """(d, d + 1): row i - 1 is the DWA after block i, column j multiplies X_j."""
        return self.n_layers, self.n_layers + 1

    @property
    def n_connections(self) -> int:
        """The learned alphas: sum over the DWAs of |S_i|."""
        return sum(len(js) for js in self.inputs.values())

    def has_dwa(self, i: int) -> bool:
        """Whether block i is followed by a DWA."""
        return i in self.inputs

    def mask(self) -> list[list[bool]]:
        """The (d, d + 1) matrix of live alpha entries (True: a learned connection)."""
        rows = [[False] * (self.n_layers + 1) for _ in range(self.n_layers)]
        for i, js in self.inputs.items():
            for j in js:
                rows[i - 1][j] = True
        return rows

    def initial_alpha(self) -> list[list[float]]:
        """alpha at init: 1 on X_i for the DWA after block i, `init_offdiag` elsewhere in S_i
        (0 makes a DenseFormer compute exactly the Transformer of its shape), 0 off the
        pattern."""
        rows = [[0.0] * (self.n_layers + 1) for _ in range(self.n_layers)]
        for i, js in self.inputs.items():
            for j in js:
                rows[i - 1][j] = 1.0 if j == i else self.init_offdiag
        return rows


@functools.lru_cache(maxsize=64)
def pattern_for_shape(n_layers: int, dilation: int, period: int | None,
                      window: int | None = None,
                      init_offdiag: float = 0.0) -> DWAPattern:
    """The DWAPattern of a shape, built once per distinct shape (the object is immutable)."""
    return DWAPattern(n_layers, dilation, period, window, init_offdiag)
