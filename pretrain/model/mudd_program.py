"""The mixes of a MUDD model and its block program (plain Python: the pipeline planner and
the memory estimate can read it without torch).

Index conventions (docs/design.md#index-conventions): X_0 is the embedding, block i = 1..d
outputs X_i. After block i a mix M_i forms, for each stream s of block i + 1, the per-token
weighted sum Y_i^s = sum_{j=0}^{i} A_i[s, j] X_j (pretrain/model/mudd.py has the weights).
Streams (`model.mudd_streams`): qkvr, the inputs of block i + 1's query, key and value
projections and its residual R (C = 4); r, the residual alone (C = 1). The last mix M_d
forms R alone (C = 1), the final norm's input. M_0 is no mix: block 1 reads X_0 for every
stream.

The dynamic weights of M_i come from an MLP of width K_i = C_i (i + 1) on X_i (the authors'
code rounds K_i up to a multiple of 64 and widens the last mix's; we do not).

The program: block i's input is `Source("mudd", i - 1, terms=(0, .., i - 1))` (X_0 itself
for block 1), the model's output the mix M_d over X_0..X_d. A pipeline stage would receive
the X_j its mixes read (each X_j is read by every later mix, so the raw X_j are the whole
state: `boundary_items`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pretrain.model.program import Item, Source, StageProgram, Step

STREAMS = {"qkvr": ("q", "k", "v", "r"), "r": ("r",)}


@dataclass(frozen=True)
class MuddLayout:
    """The mixes M_1..M_d of a d-block MUDD model."""

    n_layers: int
    streams: Literal["qkvr", "r"] = "qkvr"
    dynamic: bool = True

    def __post_init__(self):
        if self.streams not in STREAMS:
            raise ValueError(f"MUDD streams must be one of {tuple(STREAMS)}, "
                             f"got {self.streams!r}")

    def n_streams(self, i: int) -> int:
        """C_i: the streams M_i forms (1 for the last mix, the model output)."""
        return 1 if i == self.n_layers else len(STREAMS[self.streams])

    def stream_names(self, i: int) -> tuple[str, ...]:
        return ("r",) if i == self.n_layers else STREAMS[self.streams]

    def width(self, i: int) -> int:
        """K_i = C_i (i + 1): the dynamic weights' MLP width, and the weights of M_i."""
        return self.n_streams(i) * (i + 1)

    @property
    def block_norms(self) -> int:
        """Norms a block has beyond the Transformer's two: the key and value inputs'."""
        return 2 if self.streams == "qkvr" else 0

    def n_params(self, d_model: int) -> int:
        """Per mix its static weights a_i (C_i x (i + 1)) and, dynamic, W1 (K_i x H) and
        W2 (K_i x K_i)."""
        n = 0
        for i in range(1, self.n_layers + 1):
            k = self.width(i)
            n += k + (k * d_model + k * k if self.dynamic else 0)
        return n

    def mix_macs(self, d_model: int) -> int:
        """Multiply-adds per token of the mixes (C_i (i + 1) H each) and of the dynamic
        weights' MLP (K_i (H + K_i))."""
        n = 0
        for i in range(1, self.n_layers + 1):
            k = self.width(i)
            n += k * d_model + (k * (d_model + k) if self.dynamic else 0)
        return n


def boundary_items(layout: MuddLayout, b: int) -> tuple[Item, ...]:
    """The raw X_j crossing the boundary after block b: X_0..X_b, as every later mix reads
    them all."""
    return tuple(Item("x", j) for j in range(b + 1))


def mudd_program(layout: MuddLayout) -> StageProgram:
    """The program of the whole model: block i reads M_{i-1} (X_0 for block 1), the output
    is M_d."""
    d = layout.n_layers
    steps = tuple(Step(i, "block", Source("x", 0) if i == 1 else
                       Source("mudd", i - 1, terms=tuple(range(i))))
                  for i in range(1, d + 1))
    return StageProgram(1, d, d, (), steps, (), (Source("mudd", d, terms=tuple(range(d + 1))),))
