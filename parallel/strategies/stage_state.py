"""The cross-stage DWA state of a pipelined DenseFormer (docs/design.md#the-boundary-state-bound).

Index conventions (pretrain/model/dwa_pattern.py): blocks are numbered 1..d, X_0 is the
embedding output, block i maps Y_{i-1} to X_i, and the DWA after block i (if any) is
Y_i = sum_{j in S_i} alpha[i, j] X_j, where S_i holds only j = i (mod k). Every function here
reads S_i from the model's `DWAPattern` (`pattern.inputs`), never from (d, k, p).

A stage boundary b lies after block b, the last block of a stage. A *consumer* at b is
something after the boundary that reads an X_j with j <= b:

- the DWA after block c, for every c >= b whose S_c holds some j <= b (c = b is the next
  block's input Y_b); it reads residue class r = c mod k;
- the next block's input X_b itself when block b has no DWA (class b mod k).

For class r, C_r are its consumers and P_r the X_j (j <= b) they read. A class crosses as
either

- raw: the |P_r| tensors X_j; the stages after b apply alpha[c, j] themselves, or
- partial sums: one tensor per consumer, sum_{j in S_c, j <= b} alpha[c, j] X_j (X_b itself
  for the next input when block b has no DWA),

Without a Last-K window (every S_c is its whole class up to c), no fewer than
sum_r min(|P_r|, |C_r|) hidden-size tensors can carry this for generic alphas
(`lower_bound`). Transfer modes (`boundary_states`):

- `raw` (reference): every X_j that a later DWA reads, plus the next input as computed
  (Y_b, or X_b when it is not already among them);
- `optimal`: per class, raw up to some boundary and partial sums from there on (a class can
  switch from raw to partial sums along the pipe, never back), the switch chosen to minimise
  the tensors summed over all boundaries. Without a Last-K window this meets the bound at
  every boundary; with a window (S_c not all of its class) it can stay above it.

Each alpha[c, j] is applied exactly once, on the stage that first folds X_j into consumer c's
sum (a partial sum that it sends on, or Y_c itself), which need not be the stage of block c
nor of block j. A stage's program is the model's block program (pretrain/model/program.py:
`StageProgram`, `stage_program`, `Item`) cut to its blocks, with what crosses its boundaries
chosen here; the same interpreter runs it (parallel/strategies/stage_model.py). Everything here is
plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pretrain.model.program import TRANSFER_MODES, Item, StageProgram, stage_program

if TYPE_CHECKING:
    from pretrain.model.dwa_pattern import DWAPattern


def _ordered(items) -> tuple[Item, ...]:
    return tuple(sorted(items, key=lambda item: (item.kind != "x", item.index)))


@dataclass(frozen=True)
class BoundaryClass:
    """Residue class r at one boundary: its consumers (as the Item each would cross as a
    partial sum) and the X_j (j <= b) they read."""

    consumers: frozenset[Item]
    producers: frozenset[int]

    @property
    def raw_items(self) -> frozenset[Item]:
        return frozenset(Item("x", j) for j in self.producers)


def boundary_classes(pattern: DWAPattern, b: int) -> dict[int, BoundaryClass]:
    """{r: BoundaryClass} at the boundary after block b."""
    inputs, k = pattern.inputs, pattern.dilation
    consumers: dict[int, set[Item]] = {}
    producers: dict[int, set[int]] = {}
    for c, js in inputs.items():
        read = [j for j in js if j <= b]
        if c >= b and read:
            consumers.setdefault(c % k, set()).add(Item("sum", c))
            producers.setdefault(c % k, set()).update(read)
    if b not in inputs:  # no DWA after block b: the next block reads X_b itself
        consumers.setdefault(b % k, set()).add(Item("x", b))
        producers.setdefault(b % k, set()).add(b)
    return {r: BoundaryClass(frozenset(consumers[r]), frozenset(producers[r]))
            for r in sorted(consumers)}


def lower_bound(pattern: DWAPattern, b: int) -> int:
    """sum_r min(|P_r|, |C_r|): the fewest hidden-size tensors that can cross boundary b
    (for generic alphas, without a Last-K window)."""
    return sum(min(len(cl.consumers), len(cl.producers))
               for cl in boundary_classes(pattern, b).values())


def raw_items(pattern: DWAPattern, b: int) -> tuple[Item, ...]:
    """Mode `raw` at boundary b: the X_j (j <= b) a DWA after block b reads (those whose
    last reader lies past b), and the next input as computed (Y_b, or X_b)."""
    items = {Item("x", j) for j, last in pattern.last_reader.items() if j <= b < last}
    items.add(Item("sum", b) if pattern.has_dwa(b) else Item("x", b))
    return _ordered(items)


def _switch_points(classes: list[dict[int, BoundaryClass]]) -> dict[int, int]:
    """For each class r, the index of the first boundary where it crosses as partial sums
    (len(classes): never), minimising its tensors summed over all boundaries; on a tie the
    class stays raw longer."""
    switch = {}
    for r in sorted({r for per_boundary in classes for r in per_boundary}):
        raw = [len(cl[r].producers) if r in cl else 0 for cl in classes]
        partial = [len(cl[r].consumers) if r in cl else 0 for cl in classes]
        costs = [sum(raw[:s]) + sum(partial[s:]) for s in range(len(classes) + 1)]
        best = min(costs)
        switch[r] = max(s for s, cost in enumerate(costs) if cost == best)
    return switch


def boundary_states(pattern: DWAPattern, boundaries: list[int],
                    mode: str) -> list[tuple[Item, ...]]:
    """The Items crossing each boundary (blocks after which a stage ends, increasing)."""
    if mode == "raw":
        return [raw_items(pattern, b) for b in boundaries]
    if mode != "optimal":
        raise ValueError(f"transfer mode must be one of {TRANSFER_MODES}, got {mode!r}")
    classes = [boundary_classes(pattern, b) for b in boundaries]
    switch = _switch_points(classes)
    states = []
    for t, per_class in enumerate(classes):
        items: set[Item] = set()
        for r, cl in per_class.items():
            items |= cl.consumers if t >= switch[r] else cl.raw_items
        states.append(_ordered(items))
    return states


def stage_programs(pattern: DWAPattern, stages: list[tuple[int, int]],
                   mode: str) -> list[StageProgram]:
    """One StageProgram per stage (inclusive block ranges, in order, covering 1..d)."""
    boundaries = [last for _, last in stages[:-1]]
    states = boundary_states(pattern, boundaries, mode)
    incoming = [()] + states
    outgoing = states + [()]
    return [stage_program(pattern, first, last, incoming[s], outgoing[s])
            for s, (first, last) in enumerate(stages)]
