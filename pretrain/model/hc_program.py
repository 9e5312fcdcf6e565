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

A pipeline stage cut from this program (not available yet: config validation refuses pp > 1)
would receive and send exactly one tensor, the state X_{2b} at the boundary after block b.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.model.program import Source, StageProgram, Step


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


def hc_program(layout: HCLayout) -> StageProgram:
    """The whole model's program: each block as its two branches, each reading the state
    X_{c-1} (its one term) and writing X_c through the connection state (`Step.write`);
    the output is consumer L + 1, the sum of the streams of X_L."""
    steps = []
    for i in range(1, layout.n_layers + 1):
        for c, layer in ((2 * i - 1, "attention_branch"), (2 * i, "mlp_branch")):
            steps.append(Step(i, layer, Source("hc", c, terms=(c - 1,)), out=c,
                              residual=c - 1, write=True))
    last = layout.n_sublayers
    return StageProgram(1, layout.n_layers, layout.n_layers, (), tuple(steps), (),
                        (Source("hc", last + 1, terms=(last,)),))
