"""The block program of a Hyper-Connections model (`model.connection: hc` or `mhc`): its
shape (`HCLayout`) and its sub-layer steps (plain Python: config and plan read it without
torch).

Index conventions (docs/connections.md#hyper-connections-hc-and-mhc): sub-layers are
numbered 1..L, L = 2d; sub-layer 2i - 1 is block i's attention and 2i its MLP (as in
attnres_layout.py).
The residual state is n streams per token, one tensor (..., n, H). X_j in the program is the
state after sub-layer j: X_0 is the embedding copied into the n streams, and sub-layer c
reads X_{c-1} and writes X_c:

    h_c = sum_k Am_c[k] X_{c-1}[k]                  (the step's input, `Source("hc", c)`)
    X_c[k] = sum_l Ar_c[l, k] X_{c-1}[l] + B_c[k] T_c(h_c)      (the step's `write`)

T_c is block i's `attention_branch` or `mlp_branch` (pre-norm, no skip). Consumer L + 1 is
the model output, sum_k X_L[k], which the final norm reads.

Pipeline stages (blocks first..last): every sub-layer reads only the state before it, so
the boundary after block b carries exactly one tensor, the n-stream state X_{2b}
(`boundary_items`, `Item("x", 2b)`: n hidden-size tensors' bytes, (..., n, H)); the stage
after starts from it as the first stage starts from X_0. There is nothing to choose: raw
and optimal transfer are the same one state, which is also the least any stage cut can
send (`bound`). The stage that runs sub-layer c is the only one that reads its weights
(row c of each parameter).
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.model.program import Item, Source, StageProgram, Step


@dataclass(frozen=True)
class HCLayout:
    """The shape of the connections of a d-block model: `kind` hc (static or dynamic, as
    `dynamic` says) or mhc, with n `streams`; mHC projects with `sinkhorn_iters`."""

    kind: str
    n_layers: int
    streams: int
    dynamic: bool
    sinkhorn_iters: int = 20

    @property
    def n_sublayers(self) -> int:
        return 2 * self.n_layers

    @property
    def n_weights(self) -> int:
        """Mixing weights per sub-layer: Am (n), Ar (n x n) and B (n)."""
        return self.streams * (self.streams + 2)

    def n_params(self, d_model: int) -> int:
        """Static HC: Am, Ar, B per sub-layer. Dynamic HC adds a (H, n + 2) projection and
        two scales per sub-layer; mHC: a (n H, n^2 + 2n) projection, three scales and the
        n^2 + 2n biases per sub-layer."""
        n, per = self.streams, self.n_weights
        if self.kind == "mhc":
            per = n * d_model * self.n_weights + 3 + self.n_weights
        elif self.dynamic:
            per += d_model * (n + 2) + 2
        return self.n_sublayers * per

    def n_macs(self, d_model: int) -> int:
        """Multiply-adds per token of a forward (the Sinkhorn iterations, O(n^2) per token,
        are left out): per sub-layer the input mix (n H), the write ((n^2 + n) H), and for
        dynamic HC the projection of the normalised streams (n H (n + 2)), for mHC of the
        flattened state (n H (n^2 + 2n)); plus the output's sum over the streams (n H)."""
        n, h = self.streams, d_model
        per = self.n_weights * h
        if self.kind == "mhc":
            per += n * h * self.n_weights
        elif self.dynamic:
            per += n * h * (n + 2)
        return self.n_sublayers * per + n * h

    @property
    def name(self) -> str:
        """"HC n=4", "HC static n=4", "mHC n=4"."""
        if self.kind == "mhc":
            return f"mHC n={self.streams}"
        return f"HC{'' if self.dynamic else ' static'} n={self.streams}"


def boundary_items(layout: HCLayout, b: int) -> tuple[Item, ...]:
    """What crosses the boundary after block b: the n-stream state X_{2b}, one tensor."""
    return (Item("x", 2 * b),)


def bound(layout: HCLayout, b: int) -> tuple[int, str]:
    """(the fewest tensors boundary b can carry, the rule that gives it)."""
    return 1, f"one n-stream state (n={layout.streams} hidden-size tensors' bytes)"


def hc_program(layout: HCLayout, first: int = 1, last: int | None = None,
               incoming: tuple[Item, ...] | None = None,
               outgoing: tuple[Item, ...] | None = None) -> StageProgram:
    """The program of blocks first..last (default: the whole model): each block as its two
    branches, each reading the state X_{c-1} (its one term) and writing X_c through the
    connection state (`Step.write`); the last stage's output is consumer L + 1, the sum of
    the streams of X_L. A stage after the first starts from X_{2(first-1)} (`incoming`,
    default that state), one before the last sends X_{2 last} (`outgoing`, default that)."""
    d = layout.n_layers
    last = d if last is None else last
    if not 1 <= first <= last <= d:
        raise ValueError(f"blocks {first}..{last} are not a stage of a {d}-block model")
    start = 2 * (first - 1)
    incoming = () if first == 1 else (boundary_items(layout, first - 1) if incoming is None
                                      else tuple(incoming))
    if first > 1 and incoming != boundary_items(layout, first - 1):
        raise ValueError(f"stage {first}..{last} starts from X_{start} alone, got "
                         f"{[str(item) for item in incoming]}")
    steps = []
    for i in range(first, last + 1):
        for c, layer in ((2 * i - 1, "attention_branch"), (2 * i, "mlp_branch")):
            steps.append(Step(i, layer, Source("hc", c, terms=(c - 1,)), out=c,
                              residual=c - 1, write=True))
    hi = 2 * last
    if last == d:
        if outgoing:
            raise ValueError("the last stage sends nothing")
        outgoing, sources = (), (Source("hc", hi + 1, terms=(hi,)),)
    else:
        want = boundary_items(layout, last)
        outgoing = want if outgoing is None else tuple(outgoing)
        if outgoing != want:
            raise ValueError(f"stage {first}..{last} sends X_{hi} alone, got "
                             f"{[str(item) for item in outgoing]}")
        sources = (Source("x", hi),)
    return StageProgram(first, last, d, incoming, tuple(steps), outgoing, sources)


def stage_programs(layout: HCLayout, stages: list[tuple[int, int]]) -> list[StageProgram]:
    """One program per stage (inclusive block ranges covering 1..d, in order)."""
    programs = []
    for n, (first, last) in enumerate(stages):
        programs.append(hc_program(layout, first, last,
                                   outgoing=() if n == len(stages) - 1 else None))
    return programs
