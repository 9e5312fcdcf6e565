"""Attention Residuals (Kimi Team, arXiv 2603.15031): each sub-layer's input is a softmax
over earlier sub-layer outputs, weighted per token by a learned query against the outputs
normalised by RMSNorm (docs/connections.md#attention-residuals has the equations).

With the conventions of attnres_layout.py (sub-layers 1..L, consumers 1..L + 1, X_j the
held running sums), consumer c forms

    h_c = sum_{j in sources(c)} a_{c,j} X_j,   a_{c,.} = softmax_j(w_c . (g_c * X_j / rms(X_j)))

with w_c its query (zeros at init, so every a_{c,.} is uniform and, the sub-layers being
pre-norm, the model equals the Transformer up to the norms' eps) and g_c its key norm's
weight (ones at init). `w_c * g_c` is one effective query, so each source's key costs one
dot product and its RMS.

Here: the model's parameters (`AttnResWeights`), the weights of one consumer's mix for
analysis (`depth_weights`), and the connection state that the block program's interpreter
runs (`AttnResConnections`, pretrain/model/program.py), whole or as a pipeline stage: the
mix itself in two phases is attnres_mix.py; the program and what crosses a stage boundary,
attnres_program.py.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from pretrain.model.attnres_layout import AttnResLayout
from pretrain.model.attnres_mix import (
    group_prefix,
    merge_partial,
    merge_states,
    mix_logits,
    token_major,
)
from pretrain.model.program import Source

QUERY, KEY_NORM = "attnres_query", "attnres_key_norm"  # parameter names (init, optimizer)


class AttnResWeights:
    """The queries and key-norm weights of every consumer, one (L + 1, H) matrix each,
    replicated on every rank (a pipeline stage uses its consumers' rows)."""

    def __init__(self, layout: AttnResLayout, d_model: int):
        self.layout, self.d_model = layout, d_model

    def new_parameters(self) -> tuple[nn.Parameter, nn.Parameter]:
        shape = (self.layout.n_sublayers + 1, self.d_model)
        return nn.Parameter(torch.zeros(shape)), nn.Parameter(torch.ones(shape))


def depth_weights(query: torch.Tensor, xs: list[torch.Tensor], eps: float) -> torch.Tensor:
    """The softmax weights a_j of the mix over the sources `xs` (each (..., H)) for the
    effective query (H,), as (n, ...): for analysis (no gradient)."""
    with torch.no_grad():
        s, _ = mix_logits(token_major(xs), query.unsqueeze(0), eps)  # (T, n, 1)
        return torch.softmax(s[..., 0], dim=1).T.reshape(len(xs), *xs[0].shape[:-1])


class AttnResConnections:
    """The connection state of a forward pass (training or cached inference alike: the mix
    is per token, so a decoding step needs nothing from earlier tokens but the KV cache).

    The mix runs in two phases (pretrain/model/attnres_mix.py): the softmax over a group's
    completed sums for a span of its consumers at once (`prefix[c]`: weighted mean and
    log-sum-exp, made when the span's first consumer is mixed, from that consumer's
    handles), then each consumer merges its own partial sum. A span ends at the group's
    last consumer or at `last`, whichever comes first (never before the consumer itself).
    A checkpoint unit runs on a state `within` its own consumers, so no prefix made inside
    a unit is read outside it, and a recomputed unit makes the same prefixes again
    (parallel/strategies/checkpointing.py). `record`: a dict that gets each consumer's
    weights over its sources (analysis).

    On a pipeline stage (pretrain/model/attnres_program.py), `last` is the stage's last
    consumer; `received[c]` is consumer c's state over the completed sums before the stage
    (its handles are the sources after them), merged with the prefix over those; `sends`
    are the consumers whose states it passes on (`attnres_state`, `attnres_lse` sources)."""

    def __init__(self, query: torch.Tensor, key_norm: torch.Tensor, eps: float,
                 layout: AttnResLayout, record: dict | None = None, last: int | None = None,
                 *, received: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
                 sends: tuple[int, ...] = ()):
        self.queries = query * key_norm  # (L + 1, H): w_c * g_c
        self.eps, self.layout, self.record = eps, layout, record
        self.last = layout.n_sublayers + 1 if last is None else last
        self.prefix: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # c -> (o_c, lse_c)
        # The stream's shape (a state arrives and leaves in it), kept as (T, H) and (T,).
        self.shape = next(iter(received.values()))[0].shape if received else None
        self.received = {c: (o.reshape(-1, o.shape[-1]), lse.reshape(-1))
                         for c, (o, lse) in (received or {}).items()}
        self.sends = sends
        self.sent: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    def within(self, last: int) -> AttnResConnections:
        """A state of the same pass (the same queries) whose prefix spans end by consumer
        `last` (0: one consumer each)."""
        state = copy.copy(self)
        state.last, state.prefix = last, {}
        return state

    def hold(self, j: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x

    def mix(self, source: Source, handles: list, live: torch.Tensor | None) -> torch.Tensor:
        c, size = source.index, self.layout.group
        if source.kind == "attnres_state":
            # Contiguous to be sent (a prefix's o is a view across the consumers).
            return self._send(handles)[c][0].reshape(self._shape(handles)).contiguous()
        if source.kind == "attnres_lse":
            return torch.stack([self.sent[c][1] for c in self.sends]).reshape(
                len(self.sends), *self._shape(handles)[:-1])
        if self.record is not None:
            self.record[c] = depth_weights(self.queries[c - 1], handles, self.eps)
        first = (c - 1) // size * size  # the group's X_j: its consumers are first + 1..
        partial = c - 1 != first  # the sources end with the partial sum X_{c-1}
        if c not in self.prefix:
            end = max(c, min(first + size, self.last, self.layout.n_sublayers + 1))
            self.prefix.update(self._states(range(c, end + 1),
                                            handles[:-1] if partial else handles))
        o, lse = self.prefix.pop(c)
        # In the sources' dtype (bf16 for a bf16 module; fp32 under autocast, X_0 being
        # fp32); X_0 (a source of every consumer) has the parameters', which stands in for it
        # on a stage that received it folded into a state.
        dtype = functools.reduce(torch.promote_types, (h.dtype for h in handles),
                                 self.queries.dtype)
        if not partial:  # the prefix is the mix
            # A copy: o is a view into the storage of all the span's prefixes, which the
            # branch's norm would otherwise keep alive until the backward.
            return o.reshape(self._shape(handles)).to(dtype, copy=True)
        return merge_partial(o, lse, handles[-1], self.queries[c - 1], self.eps).to(dtype)

    def _shape(self, handles: list) -> torch.Size:
        """The stream's shape: a handle's, else a received state's (or the last seen)."""
        if handles:
            self.shape = handles[0].shape
        return self.shape

    def _states(self, consumers: range, sums: list[torch.Tensor]
                ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{c: consumer c's state over the completed sums `sums`, merged with its received
        state if any} (the received state alone when `sums` is empty)."""
        if not sums:
            return {c: self.received[c] for c in consumers}
        rows = slice(consumers.start - 1, consumers.stop - 1)
        states = dict(zip(consumers, group_prefix(self.queries[rows], sums, self.eps),
                          strict=True))
        for c, (o, lse) in states.items():
            if c in self.received:
                states[c] = merge_states(*self.received[c], o, lse)
        return states

    def _send(self, sums: list[torch.Tensor]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The states of the consumers in `sends` over every completed sum so far (`sums`,
        those made or received raw here, and the received states), all at once."""
        if self.sent is None:
            self.sent = self._states(range(self.sends[0], self.sends[-1] + 1), sums)
        return self.sent
