"""The block program of an Attention Residuals model, whole or cut into pipeline stages, and
what crosses each stage boundary (plain Python: parallel/strategies/plan.py reads it
without torch).

Index conventions (attnres_layout.py): sub-layers 1..L, L = 2d, consumers 1..L + 1, X_j the
held running sums; the stage boundary after block b lies after sub-layer B = 2b. A consumer
at the boundary is every c > B (each reads X_0); its *sources* there are the X_j (j <= B)
that some consumer past it reads: the completed sums X_0, X_S, ... up to B and, when B
leaves a group open, its partial sum X_B (for S = 1, full AttnRes: X_0..X_B).

A boundary carries either

- raw: those sources themselves (`boundary_items`; block AttnRes: at most N + 1), or
- states: per consumer c its softmax over the completed sums up to B, as the weighted mean
  o_c (`Item("state", c)`, hidden-size) and the log-sum-exp of its logits, lse_c; the lse of
  all n consumers as one (n, tokens) tensor (`Item("lse", n)`, per token, fp32); plus the
  open group's partial sum raw. The stage after merges the completed sums it makes into
  each state with the online-softmax merge (pretrain/model/attnres_mix.py `merge_states`),
  exactly.

`boundary_state` takes whichever is fewer hidden-size tensors (raw on a tie), so full
AttnRes sends min(sources, consumers); sources only grow and consumers only shrink along
the pipe, so a run of raw boundaries is followed by one of states, never back.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.model.attnres_layout import AttnResLayout
from pretrain.model.program import TRANSFER_MODES, Item, Source, StageProgram, Step


@dataclass(frozen=True)
class BoundaryCounts:
    """The tensors a boundary's state could take: `sources` X_j raw, or one state per
    consumer plus `partial` (the open group's partial sum, 0 or 1)."""

    sources: int
    consumers: int
    partial: int

    @property
    def states(self) -> int:
        return self.consumers + self.partial

    @property
    def fewest(self) -> int:
        return min(self.sources, self.states)


def boundary_items(layout: AttnResLayout, b: int) -> tuple[Item, ...]:
    """The raw sources at the boundary after block b: the X_j (j <= 2b) that a consumer past
    it reads (block AttnRes: the completed groups' sums and the open group's partial sum, at
    most N + 1)."""
    last_sub = 2 * b
    reads = {j for c in range(last_sub + 1, layout.n_sublayers + 2)
             for j in layout.sources(c) if j <= last_sub}
    return tuple(Item("x", j) for j in sorted(reads))


def boundary_counts(layout: AttnResLayout, b: int) -> BoundaryCounts:
    """Sources, consumers and open partial sums at the boundary after block b."""
    last_sub = 2 * b
    partial = int(last_sub % layout.group != 0)
    return BoundaryCounts(len(boundary_items(layout, b)), layout.n_sublayers + 1 - last_sub,
                          partial)


def boundary_state(layout: AttnResLayout, b: int, mode: str = "optimal") -> tuple[Item, ...]:
    """The Items crossing the boundary after block b: raw X_j (`mode="raw"`, or when they
    are no more than the states), else the open group's partial sum, consumer states and
    their lse."""
    if mode not in TRANSFER_MODES:
        raise ValueError(f"transfer mode must be one of {TRANSFER_MODES}, got {mode!r}")
    raw = boundary_items(layout, b)
    counts = boundary_counts(layout, b)
    if mode == "raw" or counts.sources <= counts.states:
        return raw
    last_sub = 2 * b
    partial = (Item("x", last_sub),) if counts.partial else ()
    states = tuple(Item("state", c) for c in range(last_sub + 1, layout.n_sublayers + 2))
    return (*partial, *states, Item("lse", len(states)))


def hidden_items(items: tuple[Item, ...]) -> int:
    """The hidden-size tensors among `items` (all but the per-token lse)."""
    return sum(item.kind != "lse" for item in items)


def bound(layout: AttnResLayout, b: int) -> tuple[int, str]:
    """(the most hidden-size tensors boundary b needs, the rule that gives it)."""
    if layout.blocks is None:
        counts = boundary_counts(layout, b)
        return counts.fewest, "min(sources, consumers)"
    return layout.blocks + 1, "N + 1 block sums"


def attnres_program(layout: AttnResLayout, first: int = 1, last: int | None = None,
                    incoming: tuple[Item, ...] = (),
                    outgoing: tuple[Item, ...] | None = None) -> StageProgram:
    """The program of blocks first..last (default: the whole model), each block run as its
    two branches; a stage after the first starts from `incoming` and one before the last
    sends `outgoing` (default: the raw `boundary_items`).

    A consumer whose state arrives reads only the X_j not in it (`Source.terms`); the
    connection state (pretrain/model/attnres.py) holds the received states. An outgoing
    state reads the completed sums not already in a received state."""
    d = layout.n_layers
    last = d if last is None else last
    lo, hi = 2 * first - 1, 2 * last
    size = layout.group
    available = {0} if first == 1 else {item.index for item in incoming if item.kind == "x"}
    # The completed sums folded into the received states (none when the X_j arrive raw).
    in_state = set()
    if any(item.kind == "state" for item in incoming):
        in_state = set(range(0, lo, size))

    def reads(terms) -> tuple[int, ...]:
        terms = tuple(j for j in terms if j not in in_state)
        missing = [j for j in terms if j not in available and not lo <= j <= hi]
        if missing:
            raise ValueError(f"stage {first}..{last} needs X_{missing[0]}, which does not "
                             "reach it")
        return terms

    def source(c: int) -> Source:
        return Source("attnres", c, terms=reads(layout.sources(c)))

    def outgoing_source(item: Item) -> Source:
        if item.kind == "x":
            reads((item.index,))
            return Source("x", item.index)
        # A state reads the completed sums; the lse comes from the states' computation.
        terms = reads(range(0, hi + 1, size)) if item.kind == "state" else ()
        return Source(f"attnres_{item.kind}", item.index, terms=terms)

    steps = []
    for i in range(first, last + 1):
        for sub, layer in ((2 * i - 1, "attention_branch"), (2 * i, "mlp_branch")):
            steps.append(Step(i, layer, source(sub), out=sub,
                              residual=sub - 1 if layout.accumulates(sub) else None))
    if last == d:
        if outgoing:
            raise ValueError("the last stage sends nothing")
        outgoing, sources = (), (source(hi + 1),)
    else:
        outgoing = boundary_items(layout, last) if outgoing is None else tuple(outgoing)
        sources = tuple(outgoing_source(item) for item in outgoing)
    return StageProgram(first, last, d, tuple(incoming), tuple(steps), outgoing, sources)


def stage_programs(layout: AttnResLayout, stages: list[tuple[int, int]],
                   mode: str = "optimal") -> list[StageProgram]:
    """One program per stage (inclusive block ranges covering 1..d, in order)."""
    programs, incoming = [], ()
    for n, (first, last) in enumerate(stages):
        outgoing = () if n == len(stages) - 1 else boundary_state(layout, last, mode)
        program = attnres_program(layout, first, last, incoming, outgoing)
        programs.append(program)
        incoming = program.outgoing
    return programs
