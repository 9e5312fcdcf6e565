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
nor of block j. `StageProgram` says, for one stage, how every block input and every outgoing
tensor is formed; `run_program` executes it on tensors. Everything here except
`run_program` is plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:
    from pretrain.model.dwa_pattern import DWAPattern

TRANSFER_MODES = ("optimal", "raw")


class Item(NamedTuple):
    """One hidden-size tensor crossing a boundary: `("x", j)` is X_j itself; `("sum", c)` is
    the DWA after block c summed over its X_j with j <= the boundary (Y_c when c is the
    boundary block)."""

    kind: Literal["x", "sum"]
    index: int

    def __str__(self) -> str:
        return f"X_{self.index}" if self.kind == "x" else f"sum_{self.index}"


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


# ---------------------------------------------------------------------------------------------
# One stage's arithmetic


@dataclass(frozen=True)
class Source:
    """How to form one tensor on a stage: X_j itself (`kind="x"`), or for the DWA after
    block `index`, the received partial sum (if `base`) plus alpha[index, j] X_j for j in
    `terms` (X_j received raw or computed on this stage)."""

    kind: Literal["x", "dwa"]
    index: int
    base: bool = False
    terms: tuple[int, ...] = ()


@dataclass(frozen=True)
class StageProgram:
    """Blocks first..last of a d-block model: what the stage receives, how it forms each
    block's input, and what it sends (or, on the last stage, the model output Y_d)."""

    first: int
    last: int
    n_layers: int
    incoming: tuple[Item, ...]  # empty on the first stage (it starts from the embedding)
    block_inputs: tuple[Source, ...]  # Y_{i-1} for i = first..last
    outgoing: tuple[Item, ...]  # empty on the last stage
    outgoing_sources: tuple[Source, ...]  # the Y_d source alone on the last stage

    @property
    def is_first(self) -> bool:
        return self.first == 1

    @property
    def is_last(self) -> bool:
        return self.last == self.n_layers

    def dwa_reads(self) -> dict[int, tuple[int, ...]]:
        """{c: the X_j this stage folds into the DWA after block c} (the buffered DWA's
        consumers, pretrain/model/dwa_layout.py)."""
        return {src.index: src.terms for src in self.block_inputs + self.outgoing_sources
                if src.kind == "dwa" and src.terms}

    def alpha_entries(self) -> set[tuple[int, int]]:
        """The (c, j) whose alpha[c, j] this stage applies."""
        return {(src.index, j) for src in self.block_inputs + self.outgoing_sources
                if src.kind == "dwa" for j in src.terms}


def stage_program(pattern: DWAPattern, first: int, last: int, incoming: tuple[Item, ...],
                  outgoing: tuple[Item, ...]) -> StageProgram:
    """Check that `incoming` suffices to produce `outgoing` (and every block input) on a
    stage of blocks first..last, and say how; raises ValueError otherwise."""
    inputs, n_layers = pattern.inputs, pattern.n_layers
    b_in = first - 1
    received_x = {item.index for item in incoming if item.kind == "x"}
    received_sums = {item.index for item in incoming if item.kind == "sum"}
    if first == 1:
        received_x = {0}  # X_0: the embedding, computed here

    def x_source(j: int) -> Source:
        if j not in received_x and not first <= j <= last:
            raise ValueError(f"stage {first}..{last} needs X_{j}, which does not reach it")
        return Source("x", j)

    def dwa_source(c: int, upto: int) -> Source:
        base = c in received_sums  # then it already holds every j <= b_in
        terms = tuple(j for j in inputs[c] if j <= upto and not (base and j <= b_in))
        for j in terms:
            x_source(j)
        return Source("dwa", c, base, terms)

    def y_source(i: int) -> Source:  # Y_i, the input of block i + 1
        return dwa_source(i, i) if i in inputs else x_source(i)

    block_inputs = tuple(y_source(i - 1) for i in range(first, last + 1))
    if last == n_layers:
        if outgoing:
            raise ValueError("the last stage sends nothing")
        sources = (y_source(last),)
    else:
        sources = tuple(x_source(item.index) if item.kind == "x" else dwa_source(item.index, last)
                        for item in outgoing)
    return StageProgram(first, last, n_layers, tuple(incoming), block_inputs, tuple(outgoing),
                        sources)


def stage_programs(pattern: DWAPattern, stages: list[tuple[int, int]],
                   mode: str) -> list[StageProgram]:
    """One StageProgram per stage (inclusive block ranges, in order, covering 1..d)."""
    boundaries = [last for _, last in stages[:-1]]
    states = boundary_states(pattern, boundaries, mode)
    incoming = [()] + states
    outgoing = states + [()]
    return [stage_program(pattern, first, last, incoming[s], outgoing[s])
            for s, (first, last) in enumerate(stages)]


def run_program(program: StageProgram, alpha, x: dict, sums: dict, blocks: dict,
                layout=None, storage_dtype=None, impl: str = "auto"):
    """Execute a StageProgram on tensors. `x` maps j to X_j (received, or X_0 on the first
    stage), `sums` maps c to a received partial sum; `blocks[i]` is block i's callable;
    `alpha` is the full (d, d + 1) matrix. With `layout` (`buffer_layout` of
    `program.dwa_reads()`) the DWAs run buffered, as in the single-process model, else
    functional (one custom op per DWA, pretrain/model/dwa_op.py). `storage_dtype`: the
    DWAs' (`model.dwa_dtype`; None: the stream's); `impl`: whose products
    (`model.dwa_impl`, as in the whole model). Returns the outgoing tensors (a tuple), or
    Y_d on the last stage."""
    from pretrain.model.dwa import BufferedDWA, depth_weighted_average

    buffered = None
    if layout is not None and layout.slot:
        like = next(iter((*x.values(), *sums.values())))
        buffered = BufferedDWA(layout, alpha, like, storage_dtype, impl)
        for j in list(x):
            x[j] = buffered.store(j, x[j])

    def form(src: Source):
        if src.kind == "x":
            return x[src.index]
        total = None
        if src.terms and buffered is not None:
            total = buffered.combine(src.index, [x[j] for j in src.terms], x.get(src.index))
        elif src.terms:
            total = depth_weighted_average(alpha[src.index - 1, list(src.terms)],
                                           [x[j] for j in src.terms], storage_dtype,
                                           diagonal=src.terms[-1] == src.index, impl=impl)
        if src.base:
            total = sums[src.index] if total is None else sums[src.index] + total
        return total

    blocks_in = range(program.first, program.last + 1)
    for i, src in zip(blocks_in, program.block_inputs, strict=True):
        x[i] = blocks[i](form(src))
        if buffered is not None:
            x[i] = buffered.store(i, x[i])
    outputs = tuple(form(src) for src in program.outgoing_sources)
    return outputs[0] if program.is_last else outputs
