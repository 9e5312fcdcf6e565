"""MUDD: MUltiway Dynamic Dense connections (Xiao et al., ICML 2025, arXiv 2502.12170;
docs/connections.md#mudd has the equations and our choices).

With the conventions of mudd_program.py (X_0 the embedding, block i outputs X_i, mix M_i
after block i forms the C_i streams of block i + 1), M_i's weights are per token

    A_i = a_i + W2_i GELU(W1_i RMSNorm(X_i))     (dynamic; (C_i, i + 1) per token)
    A_i = a_i                                    (static: no MLP parameters)

with RMSNorm without scale (the model's norm_eps), W1_i (K_i, H), W2_i (K_i, K_i), K_i =
C_i (i + 1), no biases. At initialisation a_i is 1 on X_i and 0 elsewhere for every
stream and W2_i = 0 (W1_i ~ N(0, init_std)), so every stream of block i + 1 is X_i and
the model equals the Transformer (up to the key and value inputs' own norms, ones at init
as every norm).

Here: the parameters (`MuddWeights`, one entry per mix keyed by i, so that a pipeline stage
can hold its own mixes' rows) and the connection state the block program's interpreter runs
(`MuddConnections`, pretrain/model/program.py `Connections`), in training and cached
inference alike (the mix is per token: the KV cache is all the state between decoding
steps). The mix itself is mudd_mix.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.model.mudd_mix import MuddBuffers, functional_mix, mix, store
from pretrain.model.mudd_program import MuddLayout
from pretrain.model.program import Source

# Parameter-name prefixes (init, optimizer): static weights a_i, the MLP's W1_i and W2_i.
STATIC, W1, W2 = "mudd_static", "mudd_w1", "mudd_w2"


class MuddWeights(nn.Module):
    """a_i (C_i, i + 1) and, dynamic, W1_i (K_i, H), W2_i (K_i, K_i) for the mixes i in
    `mixes` (default 1..d), replicated on every rank. Registered on the model as three
    ParameterDicts keyed by str(i) (names `mudd_static.3`, ...)."""

    @staticmethod
    def new_parameters(layout: MuddLayout, d_model: int, mixes=None
                       ) -> tuple[nn.ParameterDict, nn.ParameterDict, nn.ParameterDict]:
        mixes = range(1, layout.n_layers + 1) if mixes is None else mixes
        static, w1, w2 = nn.ParameterDict(), nn.ParameterDict(), nn.ParameterDict()
        for i in mixes:
            k = layout.width(i)
            static[str(i)] = nn.Parameter(torch.zeros(layout.n_streams(i), i + 1))
            if layout.dynamic:
                w1[str(i)] = nn.Parameter(torch.zeros(k, d_model))
                w2[str(i)] = nn.Parameter(torch.zeros(k, k))
        return static, w1, w2


def initial_static(shape: tuple[int, ...]) -> torch.Tensor:
    """a_i at init: 1 on X_i (the last column), 0 elsewhere, for every stream."""
    a = torch.zeros(shape)
    a[:, -1] = 1.0
    return a


def mix_weights(static: torch.Tensor, w1: torch.Tensor | None, w2: torch.Tensor | None,
                x: torch.Tensor, eps: float) -> torch.Tensor:
    """A_i: (C, i + 1) when static, else per token (T, C, i + 1) from X_i `x` (..., H), in
    fp32 at least with autocast off."""
    if w1 is None:
        return static
    dtype = torch.promote_types(x.dtype, torch.float32)
    with torch.autocast(x.device.type, enabled=False):
        flat = x.reshape(-1, x.shape[-1]).to(dtype)
        h = F.linear(F.gelu(F.linear(F.rms_norm(flat, (flat.shape[-1],), eps=eps),
                                     w1.to(dtype))), w2.to(dtype))
        return static.to(dtype) + h.view(-1, *static.shape)


class MuddConnections:
    """The connection state of a forward pass: `hold` stores each X_j in the buffers
    (`functional`: no buffers, the mix stacks the X_j in plain ops), `mix` forms M_i's
    streams from the held X_j in the source's terms (a tuple (q, k, v, r) under qkvr, else
    one tensor). `record`: a dict that gets each mix's weights (analysis), {i: (T, C, i + 1)}.

    On a pipeline stage (pretrain/model/mudd_program.py): `n_slots`, the buffer's slots (X_j
    up to the stage's last block); `received`, {(i, s): the partial sum of M_i's stream s
    over the X_j before the stage}, added to the stage's own terms (from slot lo, the
    stage's first block). A `mudd_s` source is one stream of an outgoing partial sum,
    formed in plain ops."""

    def __init__(self, weights: tuple[nn.ParameterDict, nn.ParameterDict, nn.ParameterDict],
                 layout: MuddLayout, eps: float, like: torch.Tensor, functional: bool = False,
                 record: dict | None = None, n_slots: int | None = None,
                 received: dict[tuple[int, str], torch.Tensor] | None = None):
        self.static, self.w1, self.w2 = weights
        self.layout, self.eps, self.record = layout, eps, record
        self.received = received or {}
        n_slots = layout.n_layers + 1 if n_slots is None else n_slots
        self.buffers = None if functional else MuddBuffers(n_slots, like)

    def hold(self, j: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.buffers is not None:
            x = store(self.buffers, j, x)
        return x, x

    def mix(self, source: Source, handles: list, live: torch.Tensor | None):
        i, key = source.index, str(source.index)
        names, rows = self.layout.stream_names(i), slice(None)
        if source.kind != "mudd":  # one stream of an outgoing partial sum
            s = names.index(source.kind[len("mudd_"):])
            names, rows = names[s:s + 1], slice(s, s + 1)
        streams = ()
        if source.terms:
            dynamic, lo, hi = self.layout.dynamic, source.terms[0], source.terms[-1]
            weights = mix_weights(self.static[key], self.w1[key] if dynamic else None,
                                  self.w2[key] if dynamic else None, handles[-1], self.eps)
            if self.record is not None and source.kind == "mudd":
                self.record[i] = weights.detach().expand(
                    handles[-1].numel() // handles[-1].shape[-1], *weights.shape[-2:])
            weights = weights[..., rows, lo:hi + 1]  # hi < i: an outgoing partial sum
            if self.buffers is None or source.kind != "mudd":
                streams = functional_mix(weights, handles)
            else:
                streams = mix(self.buffers, i, weights, handles, lo)
        received = [self.received.get((i, s)) for s in names]
        if any(r is not None for r in received):
            streams = tuple(received) if not streams else tuple(
                y + r for y, r in zip(streams, received, strict=True))
        return streams if len(streams) > 1 else streams[0]
