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
for block 1), the model's output the mix M_d over X_0..X_d.

Pipeline stages (blocks first..last; the boundary after block b = last). A stage forms the
mixes its blocks read, M_{first-1}..M_{last-1} (and M_d on the last stage): the mix M_b at
a boundary is formed on the stage after it. What crosses the boundary after block b:

- raw (`boundary_items`): X_0..X_b, b + 1 tensors, as every later mix reads all of them.
  Dynamic weights (A_i from X_i) leave no other choice: a mix's weights depend on its own
  X_i, made after the boundary, so no sum over the X_j (j <= b) can be formed before it.
- partial sums (static weights only, `partial_items`): per later mix M_i (i = b..d) and
  stream s, sum_{j<=b} a_i[s, j] X_j, sum_{i>=b} C_i tensors (4 (d - b) + 1 under qkvr,
  d - b + 1 under r); for M_b that is M_b itself. The stage after adds its own X_j's terms
  (`Source("mudd", i, terms=(b + 1, .., i))`) to the received sums, exactly; a stage that
  received partial sums sends partial sums on (its received sum plus its own terms).

`boundary_state` takes whichever is fewer hidden-size tensors (raw on a tie): b + 1 grows
and sum_{i>=b} C_i shrinks along the pipe, so a run of raw boundaries is followed by one of
partial sums, never back. Each a_i[s, j] is applied on one stage (the one holding X_j,
unless X_j crossed raw).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pretrain.model.program import TRANSFER_MODES, Item, Source, StageProgram, Step

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


def partial_items(layout: MuddLayout, b: int) -> tuple[Item, ...]:
    """The partial sums crossing the boundary after block b (static weights): one per later
    mix M_i (i >= b) and stream s, `Item("mudd_s", i)`."""
    return tuple(Item(f"mudd_{s}", i) for i in range(b, layout.n_layers + 1)
                 for s in layout.stream_names(i))


@dataclass(frozen=True)
class BoundaryCounts:
    """The hidden-size tensors a boundary could carry: the raw X_0..X_b (`sources`), or the
    partial sums of the later mixes' streams (`partial`; static weights only)."""

    sources: int
    partial: int
    dynamic: bool

    @property
    def fewest(self) -> int:
        return self.sources if self.dynamic else min(self.sources, self.partial)


def boundary_counts(layout: MuddLayout, b: int) -> BoundaryCounts:
    return BoundaryCounts(b + 1, len(partial_items(layout, b)), layout.dynamic)


def boundary_state(layout: MuddLayout, b: int, mode: str = "optimal") -> tuple[Item, ...]:
    """The Items crossing the boundary after block b: the raw X_0..X_b (`mode="raw"`,
    dynamic weights, or when they are no more than the partial sums), else the partial
    sums."""
    if mode not in TRANSFER_MODES:
        raise ValueError(f"transfer mode must be one of {TRANSFER_MODES}, got {mode!r}")
    counts = boundary_counts(layout, b)
    if mode == "raw" or counts.dynamic or counts.sources <= counts.partial:
        return boundary_items(layout, b)
    return partial_items(layout, b)


def bound(layout: MuddLayout, b: int) -> tuple[int, str]:
    """(the most hidden-size tensors boundary b needs, the rule that gives it)."""
    if layout.dynamic:
        return b + 1, "b + 1 (dynamic: every mix reads X_0..X_b)"
    return boundary_counts(layout, b).fewest, "min(b + 1, sum of C_i over i >= b)"


def mudd_program(layout: MuddLayout, first: int = 1, last: int | None = None,
                 incoming: tuple[Item, ...] = (),
                 outgoing: tuple[Item, ...] | None = None) -> StageProgram:
    """The program of blocks first..last (default: the whole model): block i reads M_{i-1}
    (X_0 for block 1), the last stage's output is M_d; a stage after the first starts from
    `incoming` and one before the last sends `outgoing` (default: the raw
    `boundary_items`).

    With partial sums received, a mix reads only this stage's X_j (`Source.terms` from
    `first`); the connection state (pretrain/model/mudd.py) adds the received sums."""
    d = layout.n_layers
    last = d if last is None else last
    available = {0} if first == 1 else {item.index for item in incoming if item.kind == "x"}
    received = {item for item in incoming if item.kind.startswith("mudd_")}
    if received and layout.dynamic:
        raise ValueError("dynamic MUDD weights read X_i: partial sums cannot cross")
    lo = first if received else 0

    def reads(upto: int) -> tuple[int, ...]:
        terms = tuple(range(lo, upto + 1))
        missing = [j for j in terms if j not in available and not first <= j <= last]
        if missing:
            raise ValueError(f"stage {first}..{last} needs X_{missing[0]}, which does not "
                             "reach it")
        return terms

    def source(kind: str, i: int) -> Source:
        if received:
            names = layout.stream_names(i) if kind == "mudd" else (kind[len("mudd_"):],)
            absent = [s for s in names if Item(f"mudd_{s}", i) not in received]
            if absent:
                raise ValueError(f"stage {first}..{last} needs the partial sum of M_{i} "
                                 f"stream {absent[0]}, which does not reach it")
        return Source(kind, i, terms=reads(i if kind == "mudd" else last))

    steps = tuple(Step(i, "block", Source("x", 0) if i == 1 else source("mudd", i - 1))
                  for i in range(first, last + 1))
    if last == d:
        if outgoing:
            raise ValueError("the last stage sends nothing")
        outgoing, sources = (), (source("mudd", d),)
    else:
        outgoing = boundary_items(layout, last) if outgoing is None else tuple(outgoing)
        sources = []
        for item in outgoing:
            if item.kind == "x":
                if item.index not in available and not first <= item.index <= last:
                    raise ValueError(f"stage {first}..{last} needs X_{item.index}, which "
                                     "does not reach it")
                sources.append(Source("x", item.index))
            else:
                sources.append(source(item.kind, item.index))
        sources = tuple(sources)
    return StageProgram(first, last, d, tuple(incoming), steps, outgoing, sources)


def stage_programs(layout: MuddLayout, stages: list[tuple[int, int]],
                   mode: str = "optimal") -> list[StageProgram]:
    """One program per stage (inclusive block ranges covering 1..d, in order)."""
    programs, incoming = [], ()
    for n, (first, last) in enumerate(stages):
        outgoing = () if n == len(stages) - 1 else boundary_state(layout, last, mode)
        program = mudd_program(layout, first, last, incoming, outgoing)
        programs.append(program)
        incoming = program.outgoing
    return programs
